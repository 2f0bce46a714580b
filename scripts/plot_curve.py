"""Draw a run's learning curve from its logged metrics (the file logger's metrics.jsonl).

    HYBRIDRL_LOG_DIR=outputs/curve python -m hybridrl.trainer.main_ppo 'trainer.logger=[console,file]'
    python scripts/plot_curve.py outputs/curve/metrics.jsonl docs/img/quickstart_curve.png

Plots the greedy validation accuracy at every validation and the mean training reward (score),
smoothed over a window of steps, against the step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VAL = "val-core/hybridrl/arith/acc/mean@1"
TRAIN = "critic/score/mean"


def read(path: Path, key: str) -> tuple[list[int], list[float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", type=Path, help="metrics.jsonl of a run")
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("--val-key", default=VAL)
    ap.add_argument("--train-key", default=TRAIN)
    ap.add_argument("--window", type=int, default=20, help="steps in the training reward's moving average")
    ap.add_argument("--title", default="GRPO, the zero-argument run: built-in model and task, CPU")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs, vv = read(args.metrics, args.val_key)
    ts, tv = read(args.metrics, args.train_key)
    if not vs:
        raise SystemExit(f"{args.metrics} has no {args.val_key!r}: was the file logger on?")
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.plot(vs, [100 * v for v in vv], "o-", ms=3.5, color="#1f77b4", label="greedy validation accuracy")
    if ts:
        ax.plot(ts, [100 * v for v in smooth(tv, args.window)], color="#ff7f0e", lw=1.2,
                label=f"training reward (sampled, mean of {args.window} steps)")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(args.title, fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}: {len(vs)} validations, last {vv[-1]:.3f}, peak {max(vv):.3f}")


if __name__ == "__main__":
    main()
