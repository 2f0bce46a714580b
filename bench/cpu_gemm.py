"""CPU GEMMs of the ~100M bench model: decode steps over the row count M (F.linear, weight first,
oneDNN, oneDNN on packed weights), and with `--train` a training forward + backward (F.linear vs
oneDNN's linear, cpu/train_linear.py).

Step mode (default): one "step" runs every linear layer of the real-vocabulary ~100M Qwen2
(bench/real_model.py: 12 layers of hidden 768, 4 KV heads of 64, MLP 2048, 32k head) once on an
(M, in) float32 input, each layer with its own weights (as in the model: they do not stay in
cache). Formulations:

- `linear`: F.linear(x, W, b) (what nn.Linear runs);
- `wfirst`: (W @ x^T)^T made contiguous (hybridrl/cpu/decode_gemm.py) in every layer;
- `rule`: what the HF rollout runs: its form (`packed` where torch has oneDNN, else `wfirst`)
  where `decode_gemm_applies` (rows, weight size, threads), else `linear`;
- `onednn`: torch.ops.mkldnn._linear_pointwise on the dense weight (torch's own oneDNN);
- `packed`: the same op on each weight's packed copy (made once, outside the timing).

`--per-shape`: one layer shape at a time (enough copies of the weight to leave the cache),
F.linear / wfirst time per shape and M: the table the rule's weight-size bound comes from.

The formulations alternate within each round (A B C A B C ...); the tables print the median ms
(or us) and the ratios to `linear`, with the load average. Usage:

    python bench/cpu_gemm.py [--threads 2] [--rows 1,4,16,64,256,1024] [--rounds 5] [--per-shape]
    python bench/cpu_gemm.py --train [--train-rows 16 --seq 309 --response 256] [--rounds 4]

`--train`: the bench model (random weights) runs forward + backward over `--train-rows` x `--seq` tokens
(the loss: logsumexp of the head at the last `--response` positions), once with plain nn.Linear and
once with oneDNN's training linear installed, alternating per round; prints seconds per round,
the oneDNN / F.linear ratio and the largest gradient deviation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import load_average, print_header, print_table

from hybridrl.cpu.decode_gemm import (
    DEFAULT_DECODE_GEMM_MAX_ROWS,
    decode_gemm_applies,
    linear_weight_first,
    resolve_form,
)
from hybridrl.cpu.onednn import onednn_linear as _onednn
from hybridrl.cpu.onednn import pack_weight

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
    return _onednn(x, w, b)


_PACKED: dict[int, torch.Tensor] = {}  # id(weight) -> its packed copy (made at the warm-up call)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if id(w) not in _PACKED:
        _PACKED[id(w)] = pack_weight(w, 16)
    return _onednn(x, _PACKED[id(w)], b)


def rule_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    form = resolve_form("auto")
    if decode_gemm_applies(x, w, DEFAULT_DECODE_GEMM_MAX_ROWS, form=form):
        return packed_linear(x, w, b) if form == "onednn" else linear_weight_first(x, w, b)
    return F.linear(x, w, b)


FORMS = {
    "linear": F.linear,
    "wfirst": linear_weight_first,
    "rule": rule_linear,
    "onednn": onednn_linear,
    "packed": packed_linear,
}
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


def train_bench(rows: int, seq: int, response: int, rounds: int) -> None:
    """Forward + backward of the bench model with F.linear vs oneDNN's training linear, alternating."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridrl.cpu.train_linear import install_onednn_linear, uninstall_onednn_linear

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    ids = torch.randint(0, VOCAB, (rows, seq))

    def step(onednn: bool) -> tuple[float, torch.Tensor]:
        (install_onednn_linear if onednn else uninstall_onednn_linear)(model.model)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        hidden = model.model(input_ids=ids).last_hidden_state[:, -response:]
        (hidden @ model.lm_head.weight.t()).logsumexp(-1).mean().backward()
        return time.perf_counter() - t0, model.model.layers[0].mlp.up_proj.weight.grad.clone()

    _, g_lin = step(False)
    _, g_dnn = step(True)
    dev = float((g_lin - g_dnn).abs().max() / g_lin.abs().max())
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for onednn in (False, True):
            times[onednn].append(step(onednn)[0])
    ratios = [d / f for f, d in zip(times[False], times[True])]
    print(
        f"forward + backward, {rows} x {seq} tokens (head at {response}), {torch.get_num_threads()} thread(s)"
    )
    print_table(
        ["round", "F.linear s", "oneDNN s", "oneDNN / F.linear"],
        [[str(i + 1), f"{f:.2f}", f"{d:.2f}", f"{r:.3f}"] for i, (f, d, r) in enumerate(zip(times[False], times[True], ratios))],
    )  # fmt: skip
    print(
        f"median oneDNN / F.linear: {statistics.median(ratios):.3f}; largest relative gradient deviation {dev:.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forms", default="linear,wfirst,rule,onednn,packed")
    parser.add_argument("--per-shape", action="store_true", help="one layer shape at a time")
    parser.add_argument(
        "--train", action="store_true", help="training forward + backward, F.linear vs oneDNN"
    )
    parser.add_argument("--train-rows", type=int, default=16, help="--train: rows (sequences)")
    parser.add_argument("--seq", type=int, default=309, help="--train: tokens per row")
    parser.add_argument("--response", type=int, default=256, help="--train: positions through the head")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.train:
        print_header(f"training linears, {torch.get_num_threads()} thread(s), float32")
        train_bench(args.train_rows, args.seq, args.response, args.rounds)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in load_average())}")
        return
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
