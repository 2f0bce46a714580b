"""Per-phase floors of a GRPO step on this machine: the update's GEMM peak and generation's decode bound.

- **Update floor**: the fp32 GEMM peak at `threads` threads (a torch matmul loop and oneDNN's
  linear at training sizes, M = 1024 rows, the model's MLP shape: the faster) against the arithmetic the loss needs,
  `6 * (N_body * T_all + N_head * T_resp)` FLOPs per step: every token through the decoder
  layers, the vocabulary head only at the response positions (both libraries compute it only
  there); attention's quadratic term is left out (small at these lengths), so the achieved
  fraction is a slight underestimate.
- **Generation floor**: the time of every linear layer of one decode step (the model's own shapes,
  each with its own weights, so they stream from memory as in the model) at M = the step's rows,
  the fastest of F.linear, oneDNN and oneDNN on packed weights (the HF rollout's form); bound = rows / that time, in tokens/s. Attention, sampling
  and the engine's bookkeeping are left out, so this is an upper bound on decode tokens/s.
The measurement is the library's (hybridrl/utils/floors.py, which `trainer.log_floors` runs at
start-up); here both are measured in a child process with `threads` torch threads (so the parent's thread count
and imports do not matter); the result is printed by bench/compare_trl.py `--floors` per runner as
achieved FLOP/s over the peak (update) and achieved tokens/s over the bound (generation).

    python bench/floors.py --model real100m --rows 16 --threads 2
    python bench/floors.py --update-tokens 4944 --response-tokens 4096   # + the update's GEMMs alone

`--update-tokens N` also times the update's own GEMMs at their own shapes (every linear's forward,
input-gradient and weight-gradient matmul at N rows, the head at `--response-tokens` rows), each
alone: what the update would take if it were nothing but its GEMMs, at the speed this machine
reaches on those shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

_CHILD = r"""
import json, sys
from transformers import AutoConfig
from hybridrl.utils.floors import measure_floors
f = measure_floors(AutoConfig.from_pretrained(sys.argv[1]), decode_rows=int(sys.argv[2]), seconds=float(sys.argv[3]))
print(json.dumps({"gemm_peak_flops": f.gemm_peak_flops, "gemm_form": f.gemm_form, "decode_step_s": f.decode_step_s, "decode_form": f.decode_form,
                  "decode_rows": f.decode_rows, "decode_bound_tokens_per_s": f.decode_bound_tokens_per_s}))
"""


_GEMM_CHILD = r"""
import json, sys, time, torch
from transformers import AutoConfig
from hybridrl.utils.floors import ModelShapes
m = ModelShapes.of(AutoConfig.from_pretrained(sys.argv[1]))
tokens, resp, reps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
h, i, kv, q = m.hidden, m.inter, m.kv, m.q
shapes = {}  # (out, in, rows) -> how many of them one update runs
for o, k in [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]:
    shapes[(o, k, tokens)] = shapes.get((o, k, tokens), 0) + m.layers
shapes[(m.vocab, h, resp)] = 1
g = torch.Generator().manual_seed(0)
total, rows = 0.0, []
for (o, k, n), count in shapes.items():
    x, w, dy = (torch.randn(n, k, generator=g), torch.randn(o, k, generator=g), torch.randn(n, o, generator=g))
    y, dx, dw = torch.empty(n, o), torch.empty(n, k), torch.empty(o, k)
    best = {}
    for name, fn in (("forward", lambda: torch.mm(x, w.t(), out=y)), ("input grad", lambda: torch.mm(dy, w, out=dx)),
                     ("weight grad", lambda: torch.mm(dy.t(), x, out=dw))):
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        best[name] = min(ts)
    secs = sum(best.values()) * count
    total += secs
    rows.append({"out": o, "in": k, "rows": n, "count": count, "seconds": secs,
                 "gflops": 6 * n * o * k / sum(best.values()) / 1e9, **{f"{a}_s": b for a, b in best.items()}})
print(json.dumps({"seconds": total, "gemms": rows}))
"""


def update_gemm_seconds(
    model_path: str, tokens: int, response_tokens: int, threads: int, reps: int = 3
) -> dict:
    """The update's own GEMMs at its own shapes, each timed alone (best of `reps`), in a child process:
    every linear of the decoder layers at `tokens` rows and the head at `response_tokens` rows, each
    as its forward, input-gradient and weight-gradient matmul (the three GEMMs of one training pass
    through a linear). Their sum is the update's time if nothing but these GEMMs ran, at the speed the
    machine reaches on these shapes (lower than the square-ish peak for thin ones)."""
    env = {**os.environ, **C.ONE_THREAD_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if threads > 1:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    args = [model_path, str(tokens), str(response_tokens), str(reps)]
    out = subprocess.run([sys.executable, "-c", _GEMM_CHILD, *args], env=env, check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def model_shapes(model_path: str) -> dict:
    """hidden, MLP, KV width, vocabulary, layers, and the body / head parameter counts of a HF model."""
    from transformers import AutoConfig

    from hybridrl.utils.floors import ModelShapes

    m = ModelShapes.of(AutoConfig.from_pretrained(model_path))
    return {"hidden": m.hidden, "inter": m.inter, "kv": m.kv, "vocab": m.vocab, "layers": m.layers,
            "body_params": m.body_params, "head_params": m.head_params}  # fmt: skip


def measure(model_path: str, rows: int, threads: int, seconds: float = 3.0) -> dict:
    """The machine's fp32 GEMM peak and the decode-step bound for this model, in a child process."""
    shapes = model_shapes(model_path)
    env = {**os.environ, **C.ONE_THREAD_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if threads > 1:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", _CHILD, model_path, str(rows), str(seconds)],
                         env=env, check=True, capture_output=True, text=True).stdout  # fmt: skip
    return {**shapes, **json.loads(out.strip().splitlines()[-1]), "threads": threads}


def mean_prompt_tokens(model_path: str, train_path: str, limit: int = 64) -> float:
    """Mean chat-templated prompt length (tokens) of the first `limit` prompts of a train parquet."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = pd.read_parquet(train_path)["prompt"][:limit]
    texts = [tok.apply_chat_template([dict(m) for m in p], add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return sum(lens) / len(lens)


def update_flops(floors: dict, prompt_tokens: float, response_tokens: float) -> float:
    """FLOPs one update needs: 6 (N_body T_all + N_head T_resp); T in tokens summed over the batch."""
    return 6.0 * (
        floors["body_params"] * (prompt_tokens + response_tokens) + floors["head_params"] * response_tokens
    )


def phase_fractions(floors: dict, step: dict, prompt_tokens_per_row: float, rows: int) -> dict:
    """Achieved / floor of one step's update and generation (fractions; 1.0 = at the floor).

    Args:
        step: a compare_trl step record (`update_s`, `gen_s`, `gen_tokens`; `weight_sync_s` is
            taken out of the generation time when present).
        prompt_tokens_per_row: mean prompt tokens of one row.
        rows: prompt copies the update's forward computes: the rows (samples) of the step, or its
            distinct prompts when the shared-prompt forward computes each prompt once per group
            (counting every row's prompt there overstated the update's fraction: by 1.11x at 4 x 4
            rows of 53 + 256 tokens, 1.52x at 53 + 48).
    """
    resp = step["gen_tokens"]
    flops = update_flops(floors, prompt_tokens_per_row * rows, resp)
    gen_s = step["gen_s"] - step.get("weight_sync_s", 0.0)
    return {
        "update_frac_of_gemm_peak": flops / step["update_s"] / floors["gemm_peak_flops"]
        if step["update_s"]
        else None,
        "gen_frac_of_decode_bound": resp / gen_s / floors["decode_bound_tokens_per_s"] if gen_s > 0 else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="real100m", help="real100m, tiny, 30m or a HF model folder")
    p.add_argument("--rows", type=int, default=16, help="decode rows (prompts x samples)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--update-tokens", type=int, default=0,
                   help="also time the update's own GEMMs at this many tokens (rows x sequence length)")  # fmt: skip
    p.add_argument("--response-tokens", type=int, default=0, help="with --update-tokens: the head's rows")
    args = p.parse_args()
    C.print_header("per-phase floors (bench/floors.py)")
    if args.model == "real100m":
        from real_model import ensure_real_model

        path = ensure_real_model()["model"]
    else:
        path = C.resolve_bench_model(args.model)
    f = measure(path, args.rows, args.threads)
    print(f"fp32 GEMM peak at {args.threads} thread(s): {f['gemm_peak_flops'] / 1e9:.1f} GFLOP/s ({f['gemm_form']}); decode step "
          f"of every linear at M={args.rows} ({f['decode_form']}): {f['decode_step_s'] * 1e3:.1f} ms -> "
          f"<= {f['decode_bound_tokens_per_s']:.0f} tokens/s")  # fmt: skip
    if args.update_tokens:
        g = update_gemm_seconds(
            path, args.update_tokens, args.response_tokens or args.update_tokens, args.threads
        )
        print(f"\nthe update's GEMMs alone at {args.update_tokens} tokens (head at {args.response_tokens} rows), "
              f"forward + input grad + weight grad, best of 3 each:")  # fmt: skip
        print(
            f"{'out x in':>14} {'rows':>6} {'count':>5} {'fwd ms':>7} {'dX ms':>7} {'dW ms':>7} {'GFLOP/s':>8} {'total s':>8}"
        )
        for r in g["gemms"]:
            print(f"{r['out']:>6} x {r['in']:<5} {r['rows']:>6} {r['count']:>5} {r['forward_s'] * 1e3:>7.1f} "
                  f"{r['input grad_s'] * 1e3:>7.1f} {r['weight grad_s'] * 1e3:>7.1f} {r['gflops']:>8.1f} "
                  f"{r['seconds']:>8.2f}")  # fmt: skip
        print(f"sum: {g['seconds']:.2f} s (GEMM peak above: {f['gemm_peak_flops'] / 1e9:.1f} GFLOP/s)")
    print(f"load average after: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
