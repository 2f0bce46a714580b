"""Where the zero-argument run's start-up goes, per backend, measured side by side (A B A B ...).

Each round starts a fresh child per variant that builds the zero-argument PPO run exactly as
`python -m hybridrl.trainer.main_ppo` does (`build_trainer`) and times its phases:
    imports       hybridrl's trainer modules, torch, transformers (before the clock of the target)
    config        Hydra compose + load_config
    prepare_run   tokenizer, datasets, reward functions, tracker
    peak_flops    the one-slot matmul peak for the MFU metric
    ray_init      ray.init (0 with the local backend)
    workers       worker process(es) and models, rollout engine (start_workers)
    first_step    with --first-step: one training step and the final validation
Variants: `local` (trainer.backend=local, the default for one CPU slot) and `ray`
(trainer.backend=ray). "after imports" = config + prepare_run + peak_flops + ray_init + workers.

Run:
    python bench/startup.py                 # 2 rounds x (local, ray)
    python bench/startup.py --rounds 3 --variants local,ray
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

PHASES = ("imports", "config", "prepare_run", "peak_flops", "ray_init", "workers", "first_step")


def child(backend: str, out: str, first_step: bool) -> None:
    t0 = time.perf_counter()
    import transformers  # noqa: F401  (imported before the clock, as TRL's benchmark does)
    from hydra import compose, initialize_config_module
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import hybridrl.workers.engine_workers  # noqa: F401
    from hybridrl.trainer.ppo import setup as S
    from hybridrl.trainer.ppo.config import load_config
    from hybridrl.trainer.ppo.launch import start_ray
    from hybridrl.trainer.ppo.workers import start_workers, uses_ray

    t = {"imports": time.perf_counter() - t0}
    cpu = {"imports": time.process_time()}
    cpu_prev = [time.process_time()]

    def lap(name, t_prev):
        now = time.perf_counter()
        t[name] = now - t_prev
        c = time.process_time()
        cpu[name], cpu_prev[0] = c - cpu_prev[0], c
        return now

    now = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HYBRIDRL_LOG_DIR"] = os.path.join(tmp, "logs")
        overrides = [
            f"trainer.backend={backend}",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.make_report=false",
            "trainer.progress_bar=false",
            f"trainer.default_local_dir={tmp}/ckpt",
        ]
        with initialize_config_module("hybridrl.trainer.config", version_base=None):
            config = load_config(compose("ppo_trainer", overrides=overrides))
        now = lap("config", now)
        run = S.prepare_run(config)
        now = lap("prepare_run", now)
        peak = S._peak_flops(config)
        now = lap("peak_flops", now)
        if uses_ray(config):
            tr = config.trainer
            start_ray(tr.nnodes * tr.n_gpus_per_node * tr.cpus_per_worker)
        now = lap("ray_init", now)
        workers = start_workers(config, peak_flops=peak)
        now = lap("workers", now)
        if first_step:
            trainer = S.RayPPOTrainer(
                config,
                run.tokenizer,
                workers,
                run.train_loader,
                run.val_loader,
                run.reward_fn,
                run.val_reward_fn,
                run.tracker,
            )
            try:
                trainer.fit()
            finally:
                trainer.tracker.finish()
        run.tracker.finish()
        workers.shutdown()
        t["first_step"] = time.perf_counter() - now if first_step else 0.0
    # CPU seconds of this process (all its threads) per phase: with the local backend every phase
    # runs here, so on a busy machine this is what the start-up would take idle (the phases are
    # single-threaded apart from model building); with Ray the worker processes are not counted.
    t["cpu_after_imports"] = sum(
        cpu.get(k, 0.0) for k in ("config", "prepare_run", "peak_flops", "ray_init", "workers")
    )
    t["cpu_imports"] = cpu["imports"]
    for k in ("config", "prepare_run", "peak_flops", "workers"):
        t[f"cpu_{k}"] = cpu.get(k, 0.0)
    Path(out).write_text(json.dumps(t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="local,ray")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--first-step", action="store_true", help="also time one training step (+ final validation)"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.out, args.first_step)
        return
    C.print_header("zero-argument start-up by phase (bench/startup.py)")
    names = args.variants.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        for r in range(args.rounds):
            for n in names:
                load = C.load_average()[0]
                env = {**os.environ, "PYTHONPATH": str(C.REPO)}
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        n,
                        "--out",
                        out,
                        *(["--first-step"] if args.first_step else []),
                    ],
                    env=env,
                    check=True,
                )
                t = json.loads(Path(out).read_text())
                t["after_imports"] = sum(
                    t[k] for k in ("config", "prepare_run", "peak_flops", "ray_init", "workers")
                )
                runs[n].append(t)
                print(
                    f"round {r + 1} {n} (load avg {load:.2f}): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in t.items())
                )
    keys = [
        *PHASES,
        "after_imports",
        "cpu_imports",
        "cpu_config",
        "cpu_prepare_run",
        "cpu_peak_flops",
        "cpu_workers",
        "cpu_after_imports",
    ]
    med = {n: {k: C.median([t[k] for t in runs[n]]) for k in keys} for n in names}
    rows = [
        [
            k,
            *(C.fmt(med[n][k]) for n in names),
            *(C.fmt(med[n][k] / med[names[-1]][k]) if med[names[-1]][k] else "-" for n in names[:-1]),
        ]
        for k in keys
    ]
    C.print_table(["phase (s, median)", *names, *(f"{n} / {names[-1]}" for n in names[:-1])], rows)
    per = [a["after_imports"] / b["after_imports"] for a, b in zip(runs[names[0]], runs[names[-1]])]
    print(f"{names[0]} / {names[-1]} start-up after imports per round: {', '.join(f'{x:.2f}' for x in per)}")
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
