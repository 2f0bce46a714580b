"""How hybridrl's GRPO step time grows with batch size, response length and the number of ranks.

Every configuration is one fresh `python -m`-style run of the real trainer (Ray driver + workers,
ONE torch thread per process, the built-in task) in a child process; the first step is warm-up and
the median of the remaining steps is reported, with its split into generate / old log-prob / update.

Axes (the base is 8 prompts x 8 samples, <= 12 new tokens, 1 rank):
  batch     8, 16, 32 prompts (x1, x2, x4 rows)
  length    max response length 12 and 48 with the SFT'd tiny model, which answers in ~9 tokens
            whatever the limit (what a larger *limit* costs: padding), and 12, 24, 48 with the same
            architecture randomly initialised (`model.init_from_scratch=true`), whose responses run
            (nearly) to the limit (what longer *responses* cost)
  ranks     trainer.n_gpus_per_node 1 and 2, same global batch (2 cores: with any other load on the
            machine the two ranks compete with it)

For each axis it prints the step time relative to the first setting and the slope: the step-time
ratio per doubling, (t_last / t_first) ** (1 / doublings). 2.0 is linear growth; < 2 is better.
Configurations run in order, then (with --rounds 2) in reverse order, so drift cancels.

Run:
    python bench/scaling.py                 # ~4-5 min (8 runs)
    python bench/scaling.py --axes batch    # one axis
    python bench/scaling.py --model 30m --steps 4 --axes batch
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import compare_trl  # noqa: E402

AXES = ("batch", "length", "ranks")


def configs(axes: list[str], base_prompts: int, base_len: int) -> list[tuple[str, str, str, list[str]]]:
    """(axis, label, x-value, extra overrides) for each run; the base run is shared by the axes."""
    base = ("base", f"{base_prompts} prompts, <= {base_len} tokens, 1 rank", "1", [])
    out = [base]
    if "batch" in axes:
        for k in (2, 4):
            p = base_prompts * k
            out.append(
                (
                    "batch",
                    f"{p} prompts",
                    str(k),
                    [f"data.train_batch_size={p}", f"actor_rollout_ref.actor.ppo_mini_batch_size={p}"],
                )
            )
    if "length" in axes:
        # The SFT'd tiny model answers in ~9 tokens whatever the limit: this is the cost of a larger limit.
        k = 4
        out.append(
            ("length", f"<= {base_len * k} tokens", str(k), [f"data.max_response_length={base_len * k}"])
        )
        # Random weights (model.init_from_scratch) rarely emit EOS, so responses run (nearly) to the limit:
        # this is the cost of longer responses. (rollout.ignore_eos=true would be the direct way, but the
        # HF engine does not honour it yet: see docs/benchmarks.md.)
        for k in (1, 2, 4):
            out.append(
                (
                    "length_random_init",
                    f"<= {base_len * k} tokens, random init",
                    str(k),
                    [
                        f"data.max_response_length={base_len * k}",
                        "actor_rollout_ref.model.init_from_scratch=true",
                    ],
                )
            )
    if "ranks" in axes:
        out.append(("ranks", "2 ranks", "2", ["trainer.n_gpus_per_node=2"]))
    return out


def micro_overrides(rows: int) -> list[str]:
    """One micro-batch per rank: all of the rank's rows in one forward."""
    return [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
    ]


def slope(t_first: float, t_last: float, factor: float) -> float:
    """Step-time ratio per doubling of the axis."""
    doublings = math.log2(factor)
    return (t_last / t_first) ** (1.0 / doublings) if doublings > 0 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (default), 30m, or a Hugging Face folder")
    p.add_argument("--axes", default=",".join(AXES), help=f"comma-separated subset of {AXES}")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-length", type=int, default=12)
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="2: run the configurations again in reverse order")
    p.add_argument("--hybridrl-override", action="append", help="extra override for every run (repeat)")
    p.add_argument("--json", help="write all numbers to this file")
    args = p.parse_args()
    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    bad = [a for a in axes if a not in AXES]
    if bad:
        raise SystemExit(f"--axes: unknown {bad}; choose from {AXES}")

    info = C.print_header("hybridrl GRPO step-time scaling (bench/scaling.py)")
    compare_trl.builtin_data()
    w = {
        "model": args.model,
        "model_path": C.resolve_bench_model(args.model),
        "prompts": args.prompts,
        "n": args.n,
        "response_length": args.response_length,
        "lr": 3e-5,
        "steps": args.steps,
        "eval": False,
        "hybridrl_overrides": list(args.hybridrl_override or []),
    }
    plan = configs(axes, args.prompts, args.response_length)
    order = list(range(len(plan)))
    if args.rounds > 1:
        order += order[::-1] * (args.rounds - 1)
    results: dict[int, list[dict]] = {i: [] for i in range(len(plan))}
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        for i in order:
            axis, label, _, extra = plan[i]
            prompts = next(
                (int(o.split("=")[1]) for o in extra if o.startswith("data.train_batch_size=")), args.prompts
            )
            ranks = next((int(o.split("=")[1]) for o in extra if o.startswith("trainer.n_gpus_per_node=")), 1)
            extra = [*micro_overrides(prompts * args.n // ranks), *extra]
            print(f"-- {axis}: {label} (load avg {[round(x, 2) for x in C.load_average()]})", flush=True)
            res = C.run_child(
                [
                    compare_trl.__file__,
                    "--child",
                    "hybridrl",
                    "--workload",
                    json.dumps(w),
                    "--extra",
                    json.dumps(extra),
                    "--seed",
                    "0",
                    "--result",
                    result,
                ],
                result,
            )
            s = compare_trl.summarize(res)
            s["rows"] = prompts * args.n
            s["gen_tokens_per_step"] = C.median([x["gen_tokens"] for x in res["steps"][1:]])
            results[i].append(s)
            print(f"   {s['step_s']:.3f} s/step, {s['tokens_per_s']:.0f} generated tok/s", flush=True)

    med = {
        i: {k: C.median([r[k] for r in rs if r[k] is not None]) for k in rs[0]} for i, rs in results.items()
    }
    print(
        f"\nmodel {args.model}, {args.n} samples per prompt, 1 torch thread per process, median of "
        f"{args.steps - 1} steps x {args.rounds} round(s)"
    )
    rows = []
    base_t = med[0]["step_s"]
    for i, (axis, label, _x, _) in enumerate(plan):
        m = med[i]
        rows.append(
            [
                axis,
                label,
                str(int(m["rows"])),
                C.fmt(m["gen_tokens_per_step"]),
                C.fmt(m["step_s"]),
                C.fmt(m["gen_s"]),
                C.fmt(m["weight_sync_s"]),
                C.fmt(m["log_prob_s"]),
                C.fmt(m["update_s"]),
                C.fmt(m["tokens_per_s"]),
                C.fmt(m["step_s"] / base_t),
            ]
        )
    C.print_table(
        [
            "axis",
            "setting",
            "rows",
            "gen tokens",
            "s/step",
            "generate",
            "of which weight sync",
            "old log-prob",
            "update",
            "gen tok/s",
            "x base",
        ],
        rows,
    )
    slopes = {}
    for axis in ("batch", "length", "length_random_init", "ranks"):
        idx = [i for i, c in enumerate(plan) if c[0] == axis]
        if not idx:
            continue
        first = idx[0] if axis == "length_random_init" else 0
        last = idx[-1]
        factor = float(plan[last][2]) / float(plan[first][2])
        if axis == "ranks":
            ratio = med[last]["step_s"] / med[first]["step_s"]
            slopes[axis] = ratio
            print(f"ranks 1 -> 2: step time x{ratio:.2f} (ideal 0.5); speed-up {1 / ratio:.2f}x")
        else:
            slopes[axis] = slope(med[first]["step_s"], med[last]["step_s"], factor)
            verdict = "no worse than linear" if slopes[axis] <= 2.0 else "WORSE than linear"
            print(f"{axis}: step time x{slopes[axis]:.2f} per doubling ({verdict}; 2.00 = linear)")
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")
    C.write_json(
        args.json,
        {"machine": info, "workload": w, "plan": plan, "median": med, "slopes": slopes, "raw": results},
    )


if __name__ == "__main__":
    main()
