"""Plot a run's curves from its metrics.jsonl: `python -m hybridrl.report RUN_DIR [--out PATH]`.

RUN_DIR is the `file` tracker's folder (it holds `metrics.jsonl`); the figure goes to
`RUN_DIR/report.png`. Panels, each left out when its metrics are missing: training score,
validation score (every `val-core/*/*/mean@*`), KL (`actor/ppo_kl`, `actor/kl_loss`), entropy,
response length and throughput. The trainer calls `make_report(run_dir)` at the end of a run.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import math
import os
import sys
from typing import Any

__all__ = ["PANELS", "load_metrics", "make_report", "main"]

logger = logging.getLogger(__name__)

# (title, y label, metric patterns, band (min, max) patterns or None)
PANELS: list[tuple[str, str, tuple[str, ...], tuple[str, str] | None]] = [
    ("training score", "score", ("critic/score/mean",), ("critic/score/min", "critic/score/max")),
    ("validation", "score", ("val-core/*/mean@*",), None),
    ("KL to reference / old policy", "KL", ("actor/ppo_kl", "actor/kl_loss"), None),
    ("entropy", "nats / token", ("actor/entropy",), None),
    ("response length", "tokens", ("response_length/mean",), ("response_length/min", "response_length/max")),
    ("throughput", "tokens / s / worker", ("perf/throughput",), None),
]


def load_metrics(path: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] sorted by step; a step logged twice (a resumed run) keeps its last value.

    Blank lines are ignored; a line that is not JSON is skipped with a warning (the last line of a
    killed run may be cut short); null values (non-finite when logged) are skipped.
    """
    series: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("report: %s line %d skipped (%s)", path, lineno, e)
                continue
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    series.setdefault(key, {})[step] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


def _match(series: dict[str, Any], patterns: tuple[str, ...]) -> list[str]:
    keys: list[str] = []
    for pattern in patterns:
        keys += [k for k in sorted(series) if fnmatch.fnmatchcase(k, pattern) and k not in keys]
    return keys


def _label(key: str) -> str:
    if key.startswith("val-core/"):
        return key.removeprefix("val-core/")
    return key


def make_report(run_dir: str, out: str | None = None) -> str:
    """Draw the panels from `run_dir/metrics.jsonl` into a PNG; returns its path.

    `run_dir` may also be the path of a `.jsonl` metrics file; the PNG then goes next to it.

    Raises:
        FileNotFoundError: no metrics.jsonl in run_dir.
        ValueError: the file holds none of the plotted metrics (the message lists what it holds).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(run_dir) and run_dir.endswith(".jsonl"):  # a metrics file given directly
        path, run_dir = run_dir, os.path.dirname(run_dir) or "."
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: RUN_DIR must be the folder of the 'file' tracker (trainer.logger includes 'file')"
        )
    series = load_metrics(path)
    panels = [(title, ylabel, _match(series, pats), band) for title, ylabel, pats, band in PANELS]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise ValueError(
            f"{path} holds none of the plotted metrics ({[p for _, _, pats, _ in PANELS for p in pats]}); "
            f"it has {sorted(series)[:20]}"
        )
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    height = 3.4 * nrows
    fig = Figure(figsize=(5.0 * ncols, height))
    # fixed margins: constrained layout costs more than drawing the whole figure
    fig.subplots_adjust(
        left=0.08, right=0.98, bottom=0.55 / height, top=1 - 0.75 / height, wspace=0.3, hspace=0.5
    )
    FigureCanvasAgg(fig)
    for i, (title, ylabel, keys, band) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        for key in keys:
            steps, values = zip(*series[key])
            marker = "o" if len(steps) <= 20 else None
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.4, label=_label(key))
        if band and all(b in series for b in band):
            lo, hi = dict(series[band[0]]), dict(series[band[1]])
            steps = sorted(set(lo) & set(hi))
            ax.fill_between(
                steps, [lo[s] for s in steps], [hi[s] for s in steps], alpha=0.15, label="min-max"
            )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 or band or keys[0].startswith("val-core/"):
            ax.legend(fontsize=7)
    last = max(s for pts in series.values() for s, _ in pts)
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))} (last step {last})")
    out = out or os.path.join(run_dir, "report.png")
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="folder holding metrics.jsonl (the 'file' tracker's log_dir)")
    parser.add_argument("--out", default=None, help="output PNG (default RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    try:
        print(make_report(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
