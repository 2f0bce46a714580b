"""Cluster path: a local Ray head on 127.0.0.1, the quickstart submitted with `ray job submit`.

Slow (starts a whole Ray cluster and a job): run with `python -m pytest -m slow tests/e2e/test_cluster.py`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.ppo_runs import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ray_job_submit_quickstart(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "NUM_CPUS": "2", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_JOB_ADDRESS", None)
    overrides = [*SMALL, "trainer.save_freq=2"]
    proc = subprocess.run(
        ["bash", str(ROOT / "recipes/cluster/submit_quickstart.sh"), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "succeeded" in log.lower(), log[-4000:]
    assert (tmp_path / "logs" / "metrics.jsonl").exists()
    assert (tmp_path / "ckpt" / "global_step_2" / "actor").is_dir()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
