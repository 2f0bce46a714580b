"""Per-phase floors of a training step: the update against a measured GEMM peak, generation against a
measured decode bound (`trainer.log_floors`; bench/compare_trl.py `--floors` prints the same numbers).

- **Update**: the arithmetic the PPO loss needs, ``6 * (N_body * T_all + N_head * T_resp)`` FLOPs
  per pass over the batch (every token through the decoder layers, the vocabulary head only at the
  response positions, as the fused head computes it; attention's quadratic term left out, so the
  fraction is a slight underestimate), times `ppo_epochs`, over ``update_s * ranks * peak``. The
  peak is a (1024 x hidden) @ (hidden x intermediate) matmul loop: the model's MLP shape at
  training sizes, on one slot's threads, the faster of torch.matmul (MKL) and, on CPU, oneDNN's
  linear (15-20% faster on the AVX-512 EPYC). With the shared-prompt forward the caller counts
  each prompt once per group (the tokens that forward computes), not once per row.
- **Generation**: response tokens / (generation seconds without the weight sync) over ``ranks *
  bound``; the bound is `rows` / the time of every linear layer of one decode step (the model's
  own shapes, each with its own weights, so they stream from memory as in decoding) at M = the
  rows one rank decodes at once, the fastest of F.linear, oneDNN on the dense weight and oneDNN on
  a packed weight (what the HF rollout runs on CPU, cpu/decode_gemm.py). Attention,
  sampling and the engine's bookkeeping are left out, so it is an upper bound on decode tokens/s.

Fractions near 1 mean a phase is at the limit of the machine; both floors take a few seconds to
measure, once, at start-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridrl.cpu.onednn import onednn_available, onednn_linear, pack_weight

__all__ = ["Floors", "ModelShapes", "measure_floors", "phase_fractions", "update_flops"]


@dataclass(frozen=True)
class ModelShapes:
    """The linear-layer shapes of a decoder: hidden, MLP width, K/V width, vocabulary, layers, and
    the parameters of the decoder layers' linears (body) and of the vocabulary head."""

    hidden: int
    inter: int
    kv: int
    vocab: int
    layers: int
    q: int  # heads * head_dim

    @classmethod
    def of(cls, hf_config: Any) -> ModelShapes:
        c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads) * head_dim
        return cls(
            int(c.hidden_size),
            int(c.intermediate_size),
            kv,
            int(c.vocab_size),
            int(c.num_hidden_layers),
            heads * head_dim,
        )

    @property
    def body_params(self) -> int:
        return self.layers * (
            2 * self.hidden * self.q + 2 * self.hidden * self.kv + 3 * self.hidden * self.inter
        )

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def decode_linears(self) -> list[tuple[int, int]]:
        """(out, in) of every linear of one decode step: q, k, v, o, gate, up, down per layer, the head."""
        h, i, kv, q = self.hidden, self.inter, self.kv, self.q
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * self.layers + [(self.vocab, h)]


@dataclass(frozen=True)
class Floors:
    """What one slot of this machine can do for this model (measured by `measure_floors`)."""

    shapes: ModelShapes
    gemm_peak_flops: float  # FLOP/s of the MLP-shaped matmul on one slot
    decode_rows: int  # M of the decode-step measurement: rows one rank decodes at once
    decode_step_s: float  # seconds of every linear of one decode step at M = decode_rows
    decode_form: str  # "linear", "onednn" or "onednn_packed", the fastest
    gemm_form: str = "matmul"  # "matmul" or "onednn", the faster at the peak's shape

    @property
    def decode_bound_tokens_per_s(self) -> float:
        return self.decode_rows / self.decode_step_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gemm_peak(
    shapes: ModelShapes, dtype: torch.dtype, device: torch.device, seconds: float
) -> tuple[float, str]:
    """(FLOP/s, form) of (1024 x hidden) @ (hidden x intermediate) repeated for ~`seconds`: the
    faster of torch.matmul and, on CPU in float32, oneDNN's linear on the same product."""
    a = torch.randn(1024, shapes.hidden, dtype=dtype, device=device)
    b = torch.randn(shapes.hidden, shapes.inter, dtype=dtype, device=device)
    forms: dict[str, Any] = {"matmul": lambda: a @ b}
    onednn = onednn_linear if device.type == "cpu" and dtype == torch.float32 and onednn_available() else None
    if onednn is not None:
        bt = b.t().contiguous()  # (intermediate, hidden): the linear layer's weight layout
        forms["onednn"] = lambda: onednn(a, bt)
    best: dict[str, float] = {}
    for name, f in forms.items():
        try:
            for _ in range(3):
                f()
        except RuntimeError:
            continue  # oneDNN's op is not in every build
        _sync(device)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / len(forms):
            f()
            n += 1
        _sync(device)
        best[name] = 2.0 * 1024 * shapes.hidden * shapes.inter * n / (time.perf_counter() - start)
    form = max(best, key=best.get)
    return best[form], form


def measure_decode_step(
    shapes: ModelShapes, rows: int, dtype: torch.dtype, device: torch.device, repeats: int = 5
) -> tuple[float, str]:
    """(seconds, form) of every linear of one decode step at M = `rows`, the faster form's median."""
    weights = [torch.randn(o, i, dtype=dtype, device=device) * 0.02 for o, i in shapes.decode_linears()]
    xs = {
        k: torch.randn(rows, k, dtype=dtype, device=device) for k in {i for _, i in shapes.decode_linears()}
    }
    forms: dict[str, tuple[Any, list[torch.Tensor]]] = {"linear": (lambda x, w: F.linear(x, w), weights)}
    onednn = onednn_linear if device.type == "cpu" and onednn_available() else None
    if onednn is not None:
        forms["onednn"] = (onednn, weights)
        if dtype == torch.float32:
            try:  # the HF rollout's form: each weight packed once (cpu/decode_gemm.py)
                packed = [pack_weight(w, rows) for w in weights]
                forms["onednn_packed"] = (onednn, packed)
            except (RuntimeError, AttributeError):
                pass
    best: dict[str, float] = {}
    for name, (f, ws) in forms.items():
        try:
            f(xs[weights[0].shape[1]], ws[0])
        except (RuntimeError, AttributeError):
            continue  # oneDNN's op is not in every build
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for w, x_w in zip(ws, weights):
                f(xs[x_w.shape[1]], w)
            _sync(device)
            times.append(time.perf_counter() - start)
        best[name] = statistics.median(times[1:])
    form = min(best, key=best.get)
    return best[form], form


def measure_floors(
    hf_config: Any,
    *,
    decode_rows: int,
    train_dtype: torch.dtype = torch.float32,
    decode_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seconds: float = 1.0,
) -> Floors:
    """Measure both floors for the model of `hf_config` with the caller's torch thread count.

    Args:
        decode_rows: rows one rollout rank decodes at once (prompts x n / rollout ranks).
        train_dtype / decode_dtype: compute dtypes of the update and of generation.
        seconds: how long the GEMM loop runs.
    """
    if decode_rows < 1:
        raise ValueError(f"measure_floors: decode_rows must be >= 1, got {decode_rows}")
    shapes, dev = ModelShapes.of(hf_config), torch.device(device)
    peak, gemm_form = measure_gemm_peak(shapes, train_dtype, dev, seconds)
    step_s, form = measure_decode_step(shapes, decode_rows, decode_dtype, dev)
    return Floors(shapes, peak, decode_rows, step_s, form, gemm_form)


def update_flops(shapes: ModelShapes, all_tokens: float, response_tokens: float) -> float:
    """6 (N_body T_all + N_head T_resp): one forward + backward over T_all tokens, T_resp of them through the head."""
    return 6.0 * (shapes.body_params * all_tokens + shapes.head_params * response_tokens)


def phase_fractions(
    floors: Floors,
    *,
    all_tokens: float,
    response_tokens: float,
    update_s: float | None,
    gen_s: float | None,
    ranks: int = 1,
    epochs: int = 1,
) -> dict[str, float]:
    """Achieved / floor of one step's update and generation (1.0 = at the floor).

    Args:
        all_tokens / response_tokens: valid prompt + response tokens and response tokens of the batch.
        update_s: seconds of the actor update (None or <= 0: not reported).
        gen_s: seconds of generation without the weight sync (None or <= 0: not reported).
        ranks: training ranks (each a slot with `floors`' peak) = rollout ranks.
        epochs: `ppo_epochs`, passes of the update over the batch.

    Returns:
        `perf/floor/update_frac_of_gemm_peak` = epochs * update_flops / (update_s * ranks * peak),
        `perf/floor/gen_frac_of_decode_bound` = response_tokens / (gen_s * ranks * bound),
        and the two floors (`perf/floor/gemm_peak_gflops`, `perf/floor/decode_bound_tokens_per_s`).
    """
    if ranks < 1 or epochs < 1:
        raise ValueError(f"phase_fractions: ranks and epochs must be >= 1, got {ranks}, {epochs}")
    out = {
        "perf/floor/gemm_peak_gflops": floors.gemm_peak_flops / 1e9,
        "perf/floor/decode_bound_tokens_per_s": floors.decode_bound_tokens_per_s,
    }
    if update_s and update_s > 0:
        flops = epochs * update_flops(floors.shapes, all_tokens, response_tokens)
        out["perf/floor/update_frac_of_gemm_peak"] = flops / (update_s * ranks * floors.gemm_peak_flops)
    if gen_s and gen_s > 0:
        out["perf/floor/gen_frac_of_decode_bound"] = response_tokens / (
            gen_s * ranks * floors.decode_bound_tokens_per_s
        )
    return out
