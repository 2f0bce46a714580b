"""Wall time to the same validation accuracy: synchronous GRPO vs asynchronous GRPO, side by side.

    python bench/async_vs_sync.py [--steps 60] [--val-every 10] [--eta 1] [--repeats 1]
    python bench/async_vs_sync.py --task long --model DIR --variants default partial ...

`--task long` trains on the long-tailed task (hybridrl/data/long_task.py: one sum asked 1-5 times,
responses of 7-44 tokens) from `--model` (the built-in model warm-started on it,
recipes/async/long_tail.sh), responses up to 48 tokens; the partial-rollout measurement of
docs/async.md.

1. The synchronous trainer (main_ppo's quickstart config: one slot with `--sync-cpus` cores,
   default both, hybrid engine) trains `--steps` steps, validating greedily on the full validation set every
   `--val-every` steps. Its final validation accuracy is the target.
2. The asynchronous trainer (main_async: one core for the trainer, one for a rollout worker,
   eta = `--eta`) trains with the same data, batch, learning rate and validation schedule until a
   validation reaches the target (at most `--max-steps-factor` x `--steps` steps), once per
   `--variants` entry (VARIANTS below).

Times are measured from the start of fit() (workers already started; start-up is reported
separately), both including and excluding the time spent in validation. Runs alternate sync,
async, sync, ... so load changes on a shared machine hit both. Prints one table and writes
JSON (`--out`). Never used as a timed assertion in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

VAL_KEYS = {"arith": "val-core/hybridrl/arith/acc/mean@1", "long": "val-core/hybridrl/arith_long/acc/mean@1"}
# Asynchronous configurations (extra overrides); "default" is AReaL's: proximal log-probs
# recomputed by the trainer and the decoupled loss.
STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "publish_weights")
VARIANTS = {
    "default": [],
    "no_recompute": ["async_training.recompute_logprob=false", "async_training.use_decoupled_loss=false"],
    # partial rollout: generation running at a weight update is aborted and resumed (docs/async.md)
    "partial": ["async_training.partial_rollout=true"],
}


def task_overrides(args) -> list[str]:
    """Data, model and lengths of `--task` (nothing for the built-in task: the defaults)."""
    if args.task == "arith":
        return [f"actor_rollout_ref.model.path={args.model}"] if args.model else []
    from hybridrl.data.long_task import ensure_long_data

    if not args.model:
        raise SystemExit(
            "--task long needs --model: the built-in model warm-started on it (recipes/async/long_tail.sh)"
        )
    paths = ensure_long_data(args.data_dir, n_val=args.val_n)
    return [
        f"data.train_files={paths['train']}",
        f"data.val_files={paths['val']}",
        "data.max_prompt_length=96",
        "data.max_response_length=48",
        f"actor_rollout_ref.model.path={args.model}",
    ]


def common_overrides(args, tmp: str) -> list[str]:
    return [
        *task_overrides(args),
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.val_every}",
        "trainer.val_before_train=true",
        "trainer.logger=[console]",
        "trainer.progress_bar=false",
        "trainer.make_report=false",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={tmp}/ckpt",
        f"trainer.seed={args.seed}",
        f"data.seed={42 + args.seed}",
        f"actor_rollout_ref.rollout.seed={args.seed}",
    ]


def build(kind: str, args, tmp: str, extra: list[str]):
    from hydra import compose, initialize_config_module

    if kind == "sync":
        from hybridrl.trainer.ppo.config import load_config
        from hybridrl.trainer.ppo.setup import build_trainer

        with initialize_config_module("hybridrl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=[*common_overrides(args, tmp), *extra])
        return build_trainer(load_config(cfg))
    from hybridrl.trainer.async_ppo.config import load_async_config
    from hybridrl.trainer.async_ppo.launch import compose_async_config
    from hybridrl.trainer.async_ppo.trainer import build_async_trainer

    cfg = compose_async_config(
        [
            *common_overrides(args, tmp),
            f"async_training.max_head_offpolicyness={args.eta}",
            "trainer.cpus_per_worker=1",
            "async_training.rollout_cpus_per_worker=1",
            *extra,
        ]
    )
    return build_async_trainer(load_async_config(cfg))


def run(kind: str, args, extra: list[str], target: float | None, max_steps: int) -> dict:
    """One run; returns its validation curve [(step, wall_s, wall_excl_val_s, acc)] and timings."""
    tmp = tempfile.mkdtemp(prefix=f"bench_{kind}_")
    t_build = time.perf_counter()
    trainer = build(kind, args, tmp, [*extra, f"trainer.total_training_steps={max_steps}"])
    startup = time.perf_counter() - t_build
    curve: list[tuple[int, float, float, float]] = []
    clock = {"t0": 0.0, "val": 0.0}
    validate, log = trainer._validate, trainer.tracker.log
    val_key = VAL_KEYS[args.task]

    def timed_validate():
        t = time.perf_counter()
        try:
            return validate()
        finally:
            clock["val"] += time.perf_counter() - t

    def logged(data, step):
        log(data, step=step)
        if val_key in data:
            wall = time.perf_counter() - clock["t0"]
            curve.append((step, wall, wall - clock["val"], float(data[val_key])))
            if target is not None and data[val_key] >= target:
                trainer.total_training_steps = trainer.global_steps  # stop: target reached

    trainer._validate, trainer.tracker.log = timed_validate, logged
    shutdown = trainer.async_workers.shutdown if kind == "async" else trainer.workers.shutdown
    load0 = os.getloadavg()[0]
    try:
        clock["t0"] = time.perf_counter()
        trainer.fit()
        total = time.perf_counter() - clock["t0"]
    finally:
        trainer.tracker.finish()
        shutdown()
    steps = [h for h in trainer.history if "timing_s/step" in h]
    out = {
        "kind": kind,
        "startup_s": startup,
        "fit_s": total,
        "val_s": clock["val"],
        "steps": len(steps),
        "curve": curve,
        "mean_step_s": statistics.mean(h["timing_s/step"] for h in steps[1:]),
        "median_step_s": statistics.median(h["timing_s/step"] for h in steps[1:]),
        "load_avg_1m": (load0, os.getloadavg()[0]),  # at the start and the end of fit()
        "final_acc": curve[-1][3] if curve else None,
        "breakdown_s": {k: statistics.mean(h.get(f"timing_s/{k}", 0.0) for h in steps[1:]) for k in STAGES},
    }
    if kind == "async":
        out["mean_staleness"] = statistics.mean(h.get("async/staleness/mean", 0.0) for h in steps)
        out["rollout_idle_frac"] = statistics.mean(h.get("async/rollout_idle_frac", 0.0) for h in steps[1:])
        out["train_wait_s"] = statistics.mean(h.get("async/train_wait_s", 0.0) for h in steps[1:])
        last = steps[-1]
        for key in ("async/partial/aborts_sent", "async/partial/resumed_groups"):
            out[key.rsplit("/", 1)[1]] = last.get(key, 0.0)
        out["mixed_version_frac"] = statistics.mean(
            h.get("async/partial/mixed_version_frac", 0.0) for h in steps
        )
    out["response_length"] = statistics.mean(h.get("response_length/mean", 0.0) for h in steps)
    return out


def time_to(curve, target: float) -> tuple[float, float, int] | None:
    for step, wall, wall_excl, acc in curve:
        if acc >= target:
            return wall, wall_excl, step
    return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--steps", type=int, default=60, help="synchronous steps; its final accuracy is the target"
    )
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--eta", type=int, default=1, help="async_training.max_head_offpolicyness")
    p.add_argument("--max-steps-factor", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sync-cpus", type=int, default=2, help="trainer.cpus_per_worker of the synchronous run")
    p.add_argument(
        "--variants",
        nargs="*",
        default=["default", "no_recompute"],
        choices=sorted(VARIANTS),
        help="asynchronous configurations to run against the same synchronous target",
    )
    p.add_argument(
        "--task",
        choices=sorted(VAL_KEYS),
        default="arith",
        help="arith: the built-in task; long: long-tailed",
    )
    p.add_argument("--model", default=None, help="actor_rollout_ref.model.path (--task long: required)")
    p.add_argument(
        "--data-dir", default="/tmp/hybridrl_long_task", help="--task long: where its parquet files go"
    )
    p.add_argument("--val-n", type=int, default=200, help="--task long: validation prompts")
    p.add_argument(
        "--fixed-steps",
        action="store_true",
        help="asynchronous runs train exactly --steps steps too (no stop at the target): compares final accuracy",
    )
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every run (sync and async)")
    p.add_argument("--out", default="bench_async_vs_sync.json")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as C

    info = C.print_header("synchronous vs asynchronous GRPO (bench/async_vs_sync.py)")
    cap = C.parallel_capacity()
    print(
        f"parallel capacity of this machine: one 1-thread matmul process {cap['alone_gflops']:.0f} GFLOP/s alone, "
        f"two side by side {' + '.join(f'{x:.0f}' for x in cap['pair_gflops'])} GFLOP/s = "
        f"{cap['capacity']:.2f}x one process (2.0 = two independent cores); overlapping two stages can "
        "gain at most this",
        flush=True,
    )
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
            }
        },
    )
    results = []
    base_seed = args.seed
    for r in range(args.repeats):
        args.seed = base_seed + r  # another data order and other samples each repeat
        sync = run("sync", args, [f"trainer.cpus_per_worker={args.sync_cpus}", *args.extra], None, args.steps)
        target = sync["curve"][-1][3]
        ts = time_to(sync["curve"], target)
        for name in args.variants:
            limit = args.steps if args.fixed_steps else int(args.steps * args.max_steps_factor)
            asyn = run(
                "async", args, [*VARIANTS[name], *args.extra], None if args.fixed_steps else target, limit
            )
            ta = time_to(asyn["curve"], target)
            results.append(
                {
                    "repeat": r,
                    "seed": args.seed,
                    "variant": name,
                    "target_acc": target,
                    "sync": sync,
                    "async": asyn,
                    "sync_time_to_target": ts,
                    "async_time_to_target": ta,
                }
            )
            print(report(results[-1]), flush=True)
    print(summary(results), flush=True)
    with open(args.out, "w") as f:
        json.dump(
            {"args": vars(args), "machine": info, "parallel_capacity": cap, "results": results}, f, indent=1
        )
    ray.shutdown()
    return {"results": results}


def summary(results: list[dict]) -> str:
    """Medians over repeats, per variant: per-step throughput ratio and time-to-target ratio."""
    lines = ["summary (median over repeats; ratios > 1 mean async is faster):"]
    for name in dict.fromkeys(r["variant"] for r in results):
        rs = [r for r in results if r["variant"] == name]
        per_step = statistics.median(r["sync"]["median_step_s"] / r["async"]["median_step_s"] for r in rs)
        reached = [r for r in rs if r["sync_time_to_target"] and r["async_time_to_target"]]
        ttt = [r["sync_time_to_target"][1] / r["async_time_to_target"][1] for r in reached]
        ttt_s = f"{statistics.median(ttt):.2f}x ({', '.join(f'{x:.2f}' for x in ttt)})" if ttt else "n/a"
        lines.append(
            f"  {name:13s} per step {per_step:.2f}x; time to target without validation {ttt_s}; "
            f"target reached {len(reached)}/{len(rs)}; final accuracy {_med(r['async']['final_acc'] for r in rs):.3f} "
            f"(sync {_med(r['sync']['final_acc'] for r in rs):.3f})"
        )
    by = {(r["seed"], r["variant"]): r for r in results}
    pairs = [(by[s, "default"], by[s, "partial"]) for s, v in by if v == "partial" and (s, "default") in by]
    if pairs:  # the partial-rollout target: its speed-up over main_ppo / the speed-up without it
        gain = [d["async"]["median_step_s"] / p["async"]["median_step_s"] for d, p in pairs]
        lines.append(
            f"  partial / default per-step speed-up: median {statistics.median(gain):.2f}x "
            f"({', '.join(f'{x:.2f}' for x in gain)})"
        )
    return "\n".join(lines)


def _med(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def report(res: dict) -> str:
    s, a = res["sync"], res["async"]
    ts, ta = res["sync_time_to_target"], res["async_time_to_target"]
    lines = [
        f"[{res['variant']}] target validation accuracy (sync final, step {s['curve'][-1][0]}): "
        f"{res['target_acc']:.3f}"
    ]
    for name, run_, t in (("sync", s, ts), ("async", a, ta)):
        curve = " ".join(f"{st}:{acc:.2f}@{w:.0f}s" for st, w, _, acc in run_["curve"])
        reach = f"step {t[2]}, {t[0]:.1f} s ({t[1]:.1f} s without validation)" if t else "not reached"
        lines.append(
            f"  {name:5s} start-up {run_['startup_s']:.0f} s, {run_['steps']} steps, "
            f"{run_['median_step_s']:.3f} s/step (median; mean {run_['mean_step_s']:.3f}), "
            f"response length {run_['response_length']:.1f}, load {run_['load_avg_1m'][0]:.1f}-"
            f"{run_['load_avg_1m'][1]:.1f}, target: {reach}"
        )
        lines.append(f"        curve step:acc@wall {curve}")
        lines.append(
            "        mean s/step: " + ", ".join(f"{k} {v:.3f}" for k, v in run_["breakdown_s"].items())
        )
    if "mean_staleness" in a:
        lines.append(
            f"  async mean staleness {a['mean_staleness']:.2f}, rollout idle {a['rollout_idle_frac']:.0%}, "
            f"trainer wait {a['train_wait_s']:.3f} s/step, aborts {a['aborts_sent']:.0f}, resumed groups "
            f"{a['resumed_groups']:.0f}, mixed-version responses {a['mixed_version_frac']:.0%}"
        )
    if ts and ta:
        lines.append(
            f"  speed-up to target: {ts[0] / ta[0]:.2f}x wall, {ts[1] / ta[1]:.2f}x without validation; "
            f"per step {s['mean_step_s'] / a['mean_step_s']:.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
