"""Two source trees of hybridrl side by side: the same main_ppo run from each, alternating, with ratios.

For a refactor or any hot-path change: check out the other revision somewhere (`git worktree add
/tmp/base <rev>`) and run

    python bench/ab_trees.py --a /tmp/base --b . --rounds 3 -- trainer.total_training_steps=20

Each round runs A then B (then B then A in the next round, so drift in the machine's speed falls on
both), each run in a fresh process with PYTHONPATH set to its tree. It prints, per run and as the
median over rounds, the median per-step seconds of the stages it reads from the file logger
(timing_s/step, gen, update_actor, ...), and the ratio B / A (below 1: B is faster). It also says
whether the two trees logged identical non-timing metrics on the last round (same seed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

STAGES = (
    "timing_s/step",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/update_actor",
    "timing_s/update_weights",
)


def _is_time(key: str) -> bool:
    return (
        key.startswith("timing")
        or key.endswith(("update_s", "throughput", "time_per_step", "gbytes_per_s"))
        or ("mfu" in key or "seconds" in key or "balance_max_min_ratio" in key)
    )


def run_tree(tree: str, overrides: list[str], workdir: str, env: dict | None = None) -> list[dict]:
    """One main_ppo run from `tree` (extra environment `env`); the rows of its metrics file.

    The run's output goes to `output.log` in its log folder; its tail is printed when it fails.
    """
    log_dir = tempfile.mkdtemp(dir=workdir)
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.path.abspath(tree), "HYBRIDRL_LOG_DIR": log_dir}
    cmd = [
        sys.executable,
        "-m",
        "hybridrl.trainer.main_ppo",
        "trainer.logger=[console,file]",
        "trainer.make_report=false",
        "trainer.progress_bar=false",
        f"trainer.default_local_dir={log_dir}/ckpt",
        *overrides,
    ]
    log_path = os.path.join(log_dir, "output.log")
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"main_ppo from {tree} exited with {rc}; the end of its output:\n{tail}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def stage_medians(rows: list[dict]) -> dict[str, float]:
    out = {}
    for key in STAGES:
        values = [r[key] for r in rows[1:] if key in r]  # step 1 holds the warm-up
        if values:
            out[key] = statistics.median(values)
    return out


def same_metrics(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    return all({k: v for k, v in ra.items() if not _is_time(k)} == {k: v for k, v in rb.items() if not _is_time(k)}
               for ra, rb in zip(a, b))  # fmt: skip


def alternate(
    trees: dict[str, str], overrides: dict[str, list[str]], rounds: int, env: dict | None = None
) -> tuple[dict[str, list[dict]], bool]:
    """Run trees {"A": path, "B": path} alternating (A B, then B A, ...) with their overrides.

    Returns the per-round stage medians of each tree and whether the two logged identical
    non-timing metrics on the last round.
    """
    per = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            rows = {}
            for name in order:
                rows[name] = run_tree(trees[name], overrides[name], workdir, env)
                per[name].append(stage_medians(rows[name]))
                print(f"round {r + 1} {name}: " + ", ".join(f"{k}={v:.4f}" for k, v in per[name][-1].items()),
                      flush=True)  # fmt: skip
        identical = same_metrics(rows["A"], rows["B"])
    return per, identical


def ratios(per: dict[str, list[dict]]) -> dict[str, dict]:
    """Per stage: the medians of A and B, the per-round ratios B / A and their median."""
    out = {}
    for key in STAGES:
        pairs = [(a[key], b[key]) for a, b in zip(per["A"], per["B"]) if key in a and key in b]
        if pairs:
            r = [y / x for x, y in pairs]
            out[key] = {
                "a": statistics.median(x for x, _ in pairs),
                "b": statistics.median(y for _, y in pairs),
                "ratios": r,
                "median": statistics.median(r),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="tree A (the baseline)")
    p.add_argument("--b", required=True, help="tree B")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("overrides", nargs="*", help="main_ppo overrides (after --)")
    args = p.parse_args()
    overrides = args.overrides or ["trainer.total_training_steps=20"]
    per, identical = alternate({"A": args.a, "B": args.b}, {"A": overrides, "B": overrides}, args.rounds)
    print(f"non-timing metrics identical on the last round: {identical}")
    for key, r in ratios(per).items():
        print(f"{key}: A {r['a']:.4f} s, B {r['b']:.4f} s, B/A per round "
              f"{', '.join(f'{x:.3f}' for x in r['ratios'])} (median {r['median']:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
