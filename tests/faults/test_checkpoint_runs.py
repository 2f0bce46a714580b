"""Whole PPO runs (built-in tiny model, in-process backend: no Ray) against checkpoint faults.

Two runs sharing a folder, a resume with `del_local_ckpt_after_load` that ends before its next
save, and a corrupted newest checkpoint: each ends with nothing lost and a message naming the
cause.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest

from hybridrl.trainer.ppo.checkpoints import CheckpointDirError
from hybridrl.trainer.ppo.launch import run_ppo_config
from hybridrl.utils import checkpointing as ck
from tests.e2e.ppo_runs import compose_config, read_metrics


class _MakesADirectory:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


BASE = ["trainer.backend=local", "trainer.save_freq=1", "trainer.test_freq=-1", "data.val_max_samples=4"]


def _run(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    """One run writing checkpoints to tmp_path/ckpt; returns its logged training steps."""
    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / name)
    run_ppo_config(compose_config([*BASE, *overrides], tmp_path))
    path = tmp_path / name / "metrics.jsonl"
    return [r for r in read_metrics(path) if "actor/pg_loss" in r] if path.exists() else []


def _meta(tmp_path, step: int) -> dict:
    return ck.read_meta(ck.step_dir(str(tmp_path / "ckpt"), step))


def test_another_run_in_the_same_folder_is_refused(tmp_path):
    _run(tmp_path, "a", ["trainer.total_training_steps=1"])
    first = _meta(tmp_path, 1)
    assert first["run_id"] and first["config_fingerprint"] and first["global_step"] == 1
    with pytest.raises(CheckpointDirError) as err:
        _run(tmp_path, "b", ["trainer.total_training_steps=2", "actor_rollout_ref.actor.optim.lr=3e-6"])
    msg = str(err.value)
    assert "actor_rollout_ref.actor.optim.lr" in msg and "trainer.default_local_dir" in msg
    with pytest.raises(CheckpointDirError, match="resume_mode=disable"):
        _run(tmp_path, "c", ["trainer.total_training_steps=2", "trainer.resume_mode=disable"])
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == [1]
    assert _meta(tmp_path, 1) == first  # untouched


def test_del_after_load_waits_for_the_next_save_and_resume_keeps_the_run_id(tmp_path, capsys):
    _run(tmp_path, "a", ["trainer.total_training_steps=2"])
    run_id = _meta(tmp_path, 2)["run_id"]
    # resumes step 2, has nothing left to train, so never saves: the loaded folder must stay
    assert (
        _run(tmp_path, "b", ["trainer.total_training_steps=2", "trainer.del_local_ckpt_after_load=true"])
        == []
    )
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == [1, 2]
    rows = _run(
        tmp_path,
        "c",
        [
            "trainer.total_training_steps=3",
            "trainer.del_local_ckpt_after_load=true",
        ],
    )
    assert [r["step"] for r in rows] == [3]
    out = capsys.readouterr().out
    assert "deleted" in out and "global_step_2" in out
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == [1, 3]
    assert _meta(tmp_path, 3)["run_id"] == run_id


def test_unloadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    _run(tmp_path, "a", ["trainer.total_training_steps=2"])
    data = tmp_path / "ckpt" / "global_step_2" / "data.pt"
    data.write_bytes(b"\x00" * data.stat().st_size)  # same size: the manifest cannot tell
    rows = _run(tmp_path, "b", ["trainer.total_training_steps=3"])
    out = capsys.readouterr().out
    assert "global_step_2 cannot be used" in out and "trying the next older one" in out
    assert "resumed from" in out and "global_step_1 (global step 1)" in out
    assert [r["step"] for r in rows] == [2, 3]
    # a truncated actor shard is caught by the manifest before anything is loaded
    shard = next(p for p in (tmp_path / "ckpt" / "global_step_3" / "actor").rglob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(16)
    rows = _run(tmp_path, "c", ["trainer.total_training_steps=4"])
    out = capsys.readouterr().out
    assert "global_step_3 cannot be used" in out and "bytes" in out
    assert [r["step"] for r in rows] == [3, 4]
    # a crafted .metadata (manifest edited to match) is refused before any worker unpickles it
    marker = tmp_path / "code_ran"
    step4 = tmp_path / "ckpt" / "global_step_4"
    with open(step4 / "actor" / "model" / ".metadata", "wb") as f:
        pickle.dump(_MakesADirectory(str(marker)), f)
    meta = ck.read_meta(str(step4))
    meta["manifest"]["actor/model/.metadata"] = (step4 / "actor" / "model" / ".metadata").stat().st_size
    (step4 / ck.META_FILE).write_text(json.dumps(meta))
    rows = _run(tmp_path, "d", ["trainer.total_training_steps=5"])
    out = capsys.readouterr().out
    assert "global_step_4 cannot be used (UnsafeCheckpointError" in out and "mkdir" in out
    assert not marker.exists()
    assert [r["step"] for r in rows] == [4, 5]
    # garbled bytes of the same size in a weight shard: the load itself fails (DCP raises a
    # BaseException); run d rewrote step 4, so that is where the run continues
    shard = next(p for p in (tmp_path / "ckpt" / "global_step_5" / "actor" / "model").glob("*.distcp"))
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    rows = _run(tmp_path, "e", ["trainer.total_training_steps=6"])
    out = capsys.readouterr().out
    said = [line[-400:] for line in out.splitlines() if "cannot be used" in line or "resumed" in line]
    assert "global_step_5 cannot be used (CheckpointException" in out, said
    assert "global_step_4 (global step 4)" in out, said
    assert [r["step"] for r in rows] == [5, 6]


def test_time_based_save_and_the_warning_when_nothing_is_saved(tmp_path, capsys):
    assert _run(tmp_path, "a", ["trainer.total_training_steps=1", "trainer.save_freq=-1"])
    assert "writes no checkpoint" in capsys.readouterr().out
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == []
    _run(
        tmp_path,
        "b",
        ["trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.save_freq_secs=0.001"],
    )
    assert "writes no checkpoint" not in capsys.readouterr().out
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == [1, 2]


def test_sigkill_during_a_save_then_resume(tmp_path):
    """The driver (worker in-process) is SIGKILLed while `global_step_2.tmp` is being written;
    the resume starts from a complete checkpoint and the run ends at its last step."""
    import signal
    import subprocess
    import sys
    import time

    from tests.e2e.ppo_runs import SMALL

    ckpt = tmp_path / "ckpt"
    args = [*SMALL, *BASE, "trainer.total_training_steps=3", f"trainer.default_local_dir={ckpt}"]
    env = {**os.environ, "HYBRIDRL_LOG_DIR": str(tmp_path / "a")}
    cmd = [sys.executable, "-m", "hybridrl.trainer.main_ppo", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (ckpt / "global_step_2.tmp").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its second save"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print({"killed_mid_save": (ckpt / "global_step_2.tmp").exists(), "latest": ck.latest_pointer(str(ckpt))})
    start = ck.latest_pointer(str(ckpt))
    assert start in (1, 2) and ck.verify(ck.step_dir(str(ckpt), start)) is None
    rows = _run(tmp_path, "b", ["trainer.total_training_steps=3"])
    assert [r["step"] for r in rows] == list(range(start + 1, 4))
    assert ck.list_checkpoints(str(ckpt))[-1] == 3
