"""Soak run: many steps of the zero-argument task with frequent checkpoints.

    nice -n 15 python scripts/soak.py --steps 2000 --save-freq 50 --keep 2 --workdir /tmp/soak

Phase 1 runs `python -m hybridrl.trainer.main_ppo` (the zero-argument settings, with
`trainer.total_training_steps=--steps`, `trainer.save_freq=--save-freq`,
`trainer.max_actor_ckpt_to_keep=--keep`, validation off) in a subprocess and, every time the
logged step passes a multiple of `--rss-every`, prints the resident memory (RSS) of the driver
and of every Ray worker process (`ray::...`, a descendant of the driver) and the checkpoint
folders on disk. At the end it checks:

* RSS of the driver and of the workers (summed) at the last sample is < `--max-growth` (5%)
  above the sample at step `--rss-from` (200);
* the checkpoint folder holds exactly `--keep` checkpoints (the last ones) and nothing else;

Phase 2 resumes the older kept checkpoint (`resume_mode=resume_path`, fresh folder) and trains
to the same final step: every logged training metric of the resumed steps must equal phase 1's,
and the resumed run's final checkpoint must hold the same actor weights.

Exit status 0 when every check passes. A JSON summary goes to `<workdir>/soak.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import psutil

# Metrics that differ between identical runs (wall clock, throughput, memory).
_VOLATILE = (
    "timing",
    "perf/",
    "throughput",
    "time",
    "mfu",
    "memory",
    "rss",
    "seconds",
    "per_s",
    "tok/s",
    "weight_sync/",
)


def _env(log_dir: str) -> dict[str, str]:
    env = {**os.environ, "HYBRIDRL_LOG_DIR": log_dir, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _overrides(args, ckpt: str) -> list[str]:
    return [
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100000",
        f"trainer.save_freq={args.save_freq}",
        f"trainer.max_actor_ckpt_to_keep={args.keep}",
        f"trainer.max_critic_ckpt_to_keep={args.keep}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.make_report=false",
        "trainer.progress_bar=false",
        "trainer.log_freq=100",
        f"trainer.default_local_dir={ckpt}",
        *args.extra,
    ]


def _last_step(metrics: str) -> int:
    """The step of the last complete line of the file logger's metrics.jsonl (0 before any)."""
    if not os.path.exists(metrics):
        return 0
    with open(metrics, "rb") as f:
        f.seek(max(0, os.path.getsize(metrics) - 65536))
        lines = [ln for ln in f.read().split(b"\n") if ln.strip()]
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, json.JSONDecodeError):
            continue
    return 0


def _rss(pid: int) -> tuple[int, dict[int, tuple[str, int]]]:
    """RSS (bytes) of the driver and of each Ray worker process below it: {pid: (title, rss)}."""
    driver = psutil.Process(pid)
    workers: dict[int, tuple[str, int]] = {}
    for child in driver.children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                workers[child.pid] = (title.split()[0][:40], child.memory_info().rss)
        except psutil.Error:
            continue
    return driver.memory_info().rss, workers


def _folders(ckpt: str) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if n.startswith("global_step_")) if os.path.isdir(ckpt) else []


def run_phase1(args) -> dict:
    """Train `args.steps` steps, sampling RSS every `args.rss_every` steps."""
    ckpt, logs = os.path.join(args.workdir, "ckpt"), os.path.join(args.workdir, "logs")
    cmd = [sys.executable, "-m", "hybridrl.trainer.main_ppo", *_overrides(args, ckpt)]
    print("soak: phase 1:", " ".join(cmd), flush=True)
    with open(os.path.join(args.workdir, "phase1.log"), "w") as out:
        proc = subprocess.Popen(cmd, env=_env(logs), stdout=out, stderr=subprocess.STDOUT)
        samples, next_at, t0, most = [], args.rss_every, time.time(), 0
        while proc.poll() is None:
            step = _last_step(os.path.join(logs, "metrics.jsonl"))
            if step >= next_at:
                try:
                    driver, workers = _rss(proc.pid)
                except psutil.Error:
                    break
                wsum = sum(r for _, r in workers.values())
                folders = _folders(ckpt)
                most = max(most, len(folders))
                samples.append({"step": step, "driver": driver, "workers": wsum, "n_workers": len(workers)})
                print(
                    f"soak: step {step:5d}  {time.time() - t0:7.0f} s  driver RSS {driver / 2**20:7.1f} MiB  "
                    f"workers ({len(workers)}) RSS {wsum / 2**20:7.1f} MiB  checkpoints {folders}",
                    flush=True,
                )
                next_at = (step // args.rss_every + 1) * args.rss_every
            time.sleep(1.0)
    if proc.returncode != 0:
        sys.exit(f"soak: phase 1 failed (exit {proc.returncode}); see {args.workdir}/phase1.log")
    return {"samples": samples, "most_folders_seen": most, "seconds": time.time() - t0}


def check_rss(samples: list[dict], start: int, limit: float) -> dict:
    base = next((s for s in samples if s["step"] >= start), None)
    if base is None or base is samples[-1]:
        return {"ok": False, "why": f"no RSS samples after step {start}"}
    # the last sample with all the workers (one taken while the run shuts down has fewer)
    last = [s for s in samples if s["n_workers"] == base["n_workers"]][-1]
    growth = {k: last[k] / base[k] - 1.0 for k in ("driver", "workers") if base[k] > 0}
    kept = [s for s in samples if base["step"] <= s["step"] <= last["step"]]
    peak = {k: max(s[k] for s in kept) / base[k] - 1.0 for k in growth}
    return {
        "ok": bool(growth) and all(g < limit for g in growth.values()),
        "base_step": base["step"],
        "last_step": last["step"],
        "growth": growth,
        "peak_growth": peak,
    }


def _training_rows(path: str) -> dict[int, dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


def _actor_tensors(step_path: str) -> dict:
    """The actor's weights of one checkpoint, read through hybridrl's own safe DCP reader."""
    from hybridrl.trainer.offline.model_merger import find_shard_dir, load_sharded_state_dict

    return load_sharded_state_dict(find_shard_dir(os.path.join(step_path, "actor")))


def _same(a: float, b: float) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def run_phase2(args) -> dict:
    """Resume the older kept checkpoint into a fresh folder and train to `args.steps`: the
    resumed steps' metrics and the final actor weights must equal phase 1's exactly."""
    import torch

    ckpt = os.path.join(args.workdir, "ckpt")
    kept = [int(n.rsplit("_", 1)[1]) for n in _folders(ckpt)]
    start = min(kept)
    src = os.path.join(ckpt, f"global_step_{start}")
    ckpt2, logs2 = os.path.join(args.workdir, "ckpt_resume"), os.path.join(args.workdir, "logs_resume")
    extra = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={src}"]
    cmd = [sys.executable, "-m", "hybridrl.trainer.main_ppo", *_overrides(args, ckpt2), *extra]
    print("soak: phase 2:", " ".join(cmd), flush=True)
    with open(os.path.join(args.workdir, "phase2.log"), "w") as out:
        rc = subprocess.call(cmd, env=_env(logs2), stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        return {"ok": False, "why": f"resume failed (exit {rc}); see {args.workdir}/phase2.log"}
    full = _training_rows(os.path.join(args.workdir, "logs", "metrics.jsonl"))
    resumed = _training_rows(os.path.join(logs2, "metrics.jsonl"))
    want = list(range(start + 1, args.steps + 1))
    diffs = []
    for step in want:
        a, b = full.get(step, {}), resumed.get(step, {})
        keys = [k for k in a if isinstance(a[k], (int, float)) and not any(v in k for v in _VOLATILE)]
        diffs += [(step, k, a[k], b.get(k)) for k in keys if not _same(a[k], b.get(k))]
    wa = _actor_tensors(os.path.join(ckpt, f"global_step_{args.steps}"))
    wb = _actor_tensors(os.path.join(ckpt2, f"global_step_{args.steps}"))
    weights_equal = set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    ok = sorted(resumed) == want and not diffs and weights_equal
    return {
        "ok": ok,
        "resumed_from": start,
        "resumed_steps": [min(resumed, default=None), max(resumed, default=None)],
        "n_metric_differences": len(diffs),
        "first_differences": diffs[:5],
        "weights_equal": weights_equal,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-freq", type=int, default=50)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--rss-every", type=int, default=100)
    ap.add_argument("--rss-from", type=int, default=200)
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--workdir", default="/tmp/hybridrl_soak")
    ap.add_argument("extra", nargs="*", help="more main_ppo overrides (key=value)")
    args = ap.parse_args(argv)
    if os.path.exists(args.workdir):
        shutil.rmtree(args.workdir)
    os.makedirs(args.workdir)
    p1 = run_phase1(args)
    rss = check_rss(p1["samples"], args.rss_from, args.max_growth)
    folders = _folders(os.path.join(args.workdir, "ckpt"))
    want = [
        f"global_step_{s}"
        for s in range(args.steps - (args.keep - 1) * args.save_freq, args.steps + 1, args.save_freq)
    ]
    disk = {"ok": folders == sorted(want), "folders": folders, "most_seen": p1["most_folders_seen"]}
    print(f"soak: RSS {json.dumps(rss)}", flush=True)
    print(f"soak: checkpoints {json.dumps(disk)}", flush=True)
    resume = run_phase2(args)
    print(f"soak: resume {json.dumps(resume, default=str)}", flush=True)
    summary = {
        "phase1_seconds": p1["seconds"],
        "rss": rss,
        "disk": disk,
        "resume": resume,
        "samples": p1["samples"],
    }
    with open(os.path.join(args.workdir, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    ok = rss["ok"] and disk["ok"] and resume["ok"]
    print("soak: PASS" if ok else "soak: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
