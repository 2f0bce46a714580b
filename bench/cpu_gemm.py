"""Decode-step GEMMs on CPU: F.linear vs the weight-first form vs oneDNN, over the row count M.

Step mode (default): one "step" runs every linear layer of the real-vocabulary ~100M Qwen2
(bench/real_model.py: 12 layers of hidden 768, 4 KV heads of 64, MLP 2048, 32k head) once on an
(M, in) float32 input, each layer with its own weights (as in the model: they do not stay in
cache). Formulations:

- `linear`: F.linear(x, W, b) (what nn.Linear runs);
- `wfirst`: (W @ x^T)^T made contiguous (hybridrl/workers/rollout/cpu_gemm.py) in every layer;
- `rule`: what the HF rollout runs: `wfirst` where `decode_gemm_applies` (rows, weight size,
  threads), else `linear`;
- `onednn`: torch.ops.mkldnn._linear_pointwise on the dense weight (torch's own oneDNN).

`--per-shape`: one layer shape at a time (enough copies of the weight to leave the cache),
F.linear / wfirst time per shape and M: the table the rule's weight-size bound comes from.

The formulations alternate within each round (A B C A B C ...); the tables print the median ms
(or us) and the ratios to `linear`, with the load average. Usage:

    python bench/cpu_gemm.py [--threads 2] [--rows 1,4,16,64,256,1024] [--rounds 5] [--per-shape]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import load_average, print_header, print_table

from hybridrl.workers.rollout.cpu_gemm import (
    DEFAULT_DECODE_GEMM_MAX_ROWS,
    decode_gemm_applies,
    linear_weight_first,
)

HIDDEN, KV, MLP, LAYERS, VOCAB = 768, 256, 2048, 12, 32768


def layer_shapes() -> list[tuple[int, int, bool]]:
    """(out, in, has_bias) of every linear of one forward, in order (Qwen2: q/k/v have bias)."""
    per_layer = [
        (HIDDEN, HIDDEN, True),
        (KV, HIDDEN, True),
        (KV, HIDDEN, True),
        (HIDDEN, HIDDEN, False),
        (MLP, HIDDEN, False),
        (MLP, HIDDEN, False),
        (HIDDEN, MLP, False),
    ]
    return per_layer * LAYERS + [(VOCAB, HIDDEN, False)]


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def rule_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if decode_gemm_applies(x, w, DEFAULT_DECODE_GEMM_MAX_ROWS):
        return linear_weight_first(x, w, b)
    return F.linear(x, w, b)


FORMS = {"linear": F.linear, "wfirst": linear_weight_first, "rule": rule_linear, "onednn": onednn_linear}
SHAPES = [(256, 256), (704, 256), (512, 512), (1408, 512), (768, 768), (2048, 768), (768, 2048), (8192, 512)]
SHAPES += [(VOCAB, HIDDEN)]


def per_shape_table(rows: list[int], rounds: int) -> None:
    """us per call of F.linear and wfirst for each (out, in) of SHAPES and M of `rows`."""
    table = []
    for out_f, in_f in SHAPES:
        copies = max(1, (32 << 20) // (out_f * in_f * 4))  # > 32 MiB of weights: out of cache
        ws = [torch.randn(out_f, in_f) for _ in range(copies)]
        cells = [f"{out_f}x{in_f}"]
        for m in rows:
            x = torch.randn(m, in_f)
            reps = max(1, 20_000_000 // (out_f * in_f * max(m, 16)))
            times: dict[str, list[float]] = {"linear": [], "wfirst": []}
            for _ in range(rounds):
                for name in times:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        for w in ws:
                            FORMS[name](x, w, None)
                    times[name].append((time.perf_counter() - t0) / reps / copies * 1e6)
            lin, wf = statistics.median(times["linear"]), statistics.median(times["wfirst"])
            cells.append(f"{lin:.0f} / {wf:.0f} = {lin / wf:.2f}x")
        table.append(cells)
    print("us per call, F.linear / wfirst = speed-up of wfirst")
    print_table(["out x in"] + [f"M={m}" for m in rows], table)


def step_ms(form, weights, xs: dict[int, torch.Tensor], inner: int) -> float:
    """Median-free mean ms of one step (every layer once), over `inner` steps."""
    t0 = time.perf_counter()
    for _ in range(inner):
        for w, b in weights:
            form(xs[w.shape[1]], w, b)
    return (time.perf_counter() - t0) / inner * 1000


def bench_rows(m: int, weights, forms: list[str], rounds: int) -> dict[str, float]:
    xs = {k: torch.randn(m, k) for k in (HIDDEN, MLP)}
    inner = max(1, min(10, 2048 // max(m, 1)))
    for name in forms:  # warm-up
        step_ms(FORMS[name], weights, xs, 1)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name in forms:
            times[name].append(step_ms(FORMS[name], weights, xs, inner))
    return {name: statistics.median(t) for name, t in times.items()}


def check_equal(weights) -> float:
    """Largest |form - F.linear| relative to max |F.linear| over a few layers at M = 5."""
    worst = 0.0
    for w, b in weights[:7] + weights[-1:]:
        x = torch.randn(5, w.shape[1])
        ref = F.linear(x, w, b)
        for form in FORMS.values():
            worst = max(worst, float((form(x, w, b) - ref).abs().max() / ref.abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forms", default="linear,wfirst,rule,onednn")
    parser.add_argument("--per-shape", action="store_true", help="one layer shape at a time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_header(f"decode GEMMs, {torch.get_num_threads()} thread(s), float32")
    if args.per_shape:
        per_shape_table([int(r) for r in args.rows.split(",")], args.rounds)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in load_average())}")
        return
    torch.manual_seed(0)
    weights = [
        (torch.randn(o, i) * 0.02, torch.randn(o) * 0.02 if bias else None) for o, i, bias in layer_shapes()
    ]
    forms = args.forms.split(",")
    print(f"max relative deviation from F.linear: {check_equal(weights):.2e}")
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        ms = bench_rows(m, weights, forms, args.rounds)
        cells = [str(m)] + [f"{ms[f]:.1f}" for f in forms]
        cells += [f"{ms['linear'] / ms[f]:.2f}x" for f in forms if f != "linear" and "linear" in ms]
        rows.append(cells)
    ratio_heads = [f"linear/{f}" for f in forms if f != "linear" and "linear" in forms]
    print_table(["M"] + [f"{f} ms" for f in forms] + ratio_heads, rows)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in load_average())}")


if __name__ == "__main__":
    main()
