"""Resume after SIGKILL reproduces the uninterrupted run exactly (CPU, deterministic).

Run A trains 4 steps straight. Run B is the same command, killed with SIGKILL (driver and all its
Ray processes) once the step-2 checkpoint is on disk (held there, so the kill cannot miss it); run C resumes it (trainer.resume_mode=auto)
and must log the same metrics for steps 3 and 4 as run A.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.ppo_runs import SMALL, read_metrics

ARGS = [*SMALL, "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1"]
COMPARED = [
    "critic/score/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "response_length/mean",
    "critic/advantages/mean",
]


# `python -m hybridrl.trainer.main_ppo`, except that the run stops (sleeps) right after its checkpoint of
# step argv[1] is on disk, so the SIGKILL always lands between that checkpoint and the end of the run
# (a tiny run can train its last steps in the poll interval). Nothing else of the run is changed.
_HOLD = """
import runpy, sys, time
import hybridrl.utils.checkpointing as ck
hold, finalize = int(sys.argv.pop(1)), ck.finalize
def held(root, step):
    out = finalize(root, step)
    if step == hold:
        time.sleep(3600)
    return out
ck.finalize = held
runpy.run_module("hybridrl.trainer.main_ppo", run_name="__main__", alter_sys=True)
"""


def _launch(
    ckpt: Path, logs: Path, args: list[str] = ARGS, hold_after: int | None = None
) -> subprocess.Popen:
    env = {**os.environ, "HYBRIDRL_LOG_DIR": str(logs), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    entry = ["-m", "hybridrl.trainer.main_ppo"] if hold_after is None else ["-c", _HOLD, str(hold_after)]
    cmd = [sys.executable, *entry, *args, f"trainer.default_local_dir={ckpt}"]
    return subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def _by_step(rows):
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


def check_sigkill_resume(tmp_path: Path, args: list[str] = ARGS, keys: list[str] = COMPARED) -> None:
    """Run A straight; run B killed after the step-2 checkpoint; run C resumes B: C's steps 3 and 4
    must log A's metrics (`keys`). `args` must train 4 steps and save every 2."""
    _finish(_launch(tmp_path / "a_ckpt", tmp_path / "a_logs", args))
    full = _by_step(read_metrics(tmp_path / "a_logs" / "metrics.jsonl"))

    ckpt = tmp_path / "b_ckpt"
    proc = _launch(ckpt, tmp_path / "b_logs", args, hold_after=2)
    latest = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 400
    while not (latest.exists() and latest.read_text().strip() == "2"):
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
        assert time.time() < deadline, "no step-2 checkpoint appeared"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpt / "global_step_2" / "actor").is_dir() and (ckpt / "global_step_2" / "data.pt").exists()

    text = _finish(_launch(ckpt, tmp_path / "c_logs", args))
    assert "resumed from" in text
    resumed = _by_step(read_metrics(tmp_path / "c_logs" / "metrics.jsonl"))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in keys:
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    check_sigkill_resume(tmp_path)
