"""Checkpoint folders on a real filesystem: durability, atomic replacement, pruning, verification.

No training here (tests/faults/test_checkpoint_runs.py has the whole runs): folders are written
the way the trainer writes them, with hybridrl.utils.checkpointing and RunCheckpoints.
"""

from __future__ import annotations

import json
import os

import pytest

from hybridrl.trainer.ppo.checkpoints import RunCheckpoints, check_part
from hybridrl.trainer.ppo.config import load_config
from hybridrl.utils import checkpointing as ck


def _write_step(root, step: int, run_id: str | None, payload: bytes = b"weights") -> str:
    tmp = ck.tmp_step_dir(str(root), step)
    os.makedirs(os.path.join(tmp, "actor"), exist_ok=True)
    with open(os.path.join(tmp, "actor", "shard.bin"), "wb") as f:
        f.write(payload)
    with open(os.path.join(tmp, "data.pt"), "wb") as f:
        f.write(b"state")
    ck.write_meta(tmp, {"run_id": run_id, "global_step": step} if run_id else {"global_step": step})
    return ck.finalize(str(root), step)


def test_every_file_and_folder_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):  # the real fsync, and which path it was for
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    final = _write_step(tmp_path, 3, "r1")
    tmp = final + ".tmp"
    expected = {tmp, os.path.join(tmp, "actor"), os.path.join(tmp, "actor", "shard.bin")}
    expected |= {os.path.join(tmp, "data.pt"), os.path.join(tmp, ck.META_FILE)}
    assert expected <= set(synced), sorted(expected - set(synced))
    renamed_at = synced.index(str(tmp_path))  # the root, after the rename into place
    assert all(synced.index(p) < renamed_at for p in expected)
    assert synced[-1] == str(tmp_path) and os.path.join(str(tmp_path), ck.LATEST_FILE + ".tmp") in synced


def test_finalize_keeps_the_existing_folder_when_the_new_one_is_missing(tmp_path):
    final = _write_step(tmp_path, 5, "r1", payload=b"good")
    with pytest.raises(FileNotFoundError, match="which is kept"):
        ck.finalize(str(tmp_path), 5)  # no global_step_5.tmp
    with open(os.path.join(final, "actor", "shard.bin"), "rb") as f:
        assert f.read() == b"good"


def test_finalize_over_an_existing_folder_and_an_interrupted_swap(tmp_path):
    _write_step(tmp_path, 5, "r1", payload=b"old")
    final = _write_step(tmp_path, 5, "r1", payload=b"new")
    assert open(os.path.join(final, "actor", "shard.bin"), "rb").read() == b"new"
    assert not os.path.exists(final + ".old")
    # a save that died between its two renames leaves only global_step_5.old
    os.rename(final, final + ".old")
    assert ck.candidates(str(tmp_path)) == []
    assert ck.restore_interrupted(str(tmp_path)) == [final]
    assert ck.candidates(str(tmp_path)) == [final]


def test_pruning_spares_other_runs_the_new_folder_and_the_latest(tmp_path):
    root = str(tmp_path)
    for step in (300, 400):
        _write_step(root, step, "older-run")
    _write_step(root, 50, "new-run")
    # the old rule (oldest steps across runs) deleted the folder just written
    assert ck.prune(root, 2, run_id="new-run", protect={50}) == []
    assert ck.list_checkpoints(root) == [50, 300, 400]
    _write_step(root, 60, "new-run")
    _write_step(root, 70, "new-run")
    assert ck.prune(root, 2, run_id="new-run", protect={70}) == [50]
    assert ck.list_checkpoints(root) == [60, 70, 300, 400]
    # the latest file names 60 (e.g. a resume pointed it there): 60 stays whatever its age
    ck.write_file_atomic(os.path.join(root, ck.LATEST_FILE), "60")
    _write_step(root, 80, "new-run")
    ck.write_file_atomic(os.path.join(root, ck.LATEST_FILE), "60")
    assert ck.prune(root, 1, run_id="new-run", protect={80}) == [70]
    assert ck.list_checkpoints(root) == [60, 80, 300, 400]


def test_verify_finds_truncated_and_missing_files(tmp_path):
    final = _write_step(tmp_path, 1, "r1", payload=b"x" * 1000)
    assert ck.verify(final) is None
    with open(os.path.join(final, "actor", "shard.bin"), "r+b") as f:
        f.truncate(10)
    assert "shard.bin has 10 bytes, 1000 were written" in ck.verify(final)
    os.unlink(os.path.join(final, "actor", "shard.bin"))
    assert "shard.bin is missing" in ck.verify(final)


def test_every_ranks_part_must_be_visible_from_the_driver(tmp_path):
    part = tmp_path / "global_step_1.tmp" / "actor"
    part.mkdir(parents=True)
    (part / "meta.json").write_text(json.dumps({"world_size": 2, "contents": ["extra", "model"]}))
    (part / "extra_state_rank0.pt").write_bytes(b"r0")
    with pytest.raises(
        RuntimeError, match=r"rank 1 of actor wrote no extra_state_rank1.pt.*default_local_dir"
    ):
        check_part(str(part), "actor", 2, 1)
    (part / "extra_state_rank1.pt").write_bytes(b"r1")
    check_part(str(part), "actor", 2, 1)
    os.unlink(part / "meta.json")
    with pytest.raises(RuntimeError, match="rank 0 of actor"):
        check_part(str(part), "actor", 2, 1)


def test_checkpoint_root_is_absolute_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(["trainer.default_local_dir=ckpts/run", "trainer.resume_from_path=~/c/global_step_2"])
    assert cfg.trainer.default_local_dir == str(tmp_path / "ckpts" / "run")
    assert cfg.trainer.resume_from_path == str(tmp_path / "home" / "c" / "global_step_2")


def test_fingerprint_names_the_keys_that_differ_and_ignores_resume_keys():
    a = load_config([])
    b = load_config(
        ["actor_rollout_ref.actor.optim.lr=0.5", "trainer.total_training_steps=99", "data.seed=7"]
    )
    da, db = RunCheckpoints(a).digest, RunCheckpoints(b).digest
    assert ck.differing_keys(da, db) == ["actor_rollout_ref.actor.optim.lr", "data.seed"]
    assert ck.fingerprint(da) != ck.fingerprint(db)
    assert "0.5" not in json.dumps(db)  # hashes only: no config value is written to meta.json


def test_a_key_added_by_a_newer_version_does_not_make_a_run_look_like_another():
    """A checkpoint written before an upgrade that added config keys is still this run's: keys only
    one digest has are not compared; a key both have with another value still is."""
    d = RunCheckpoints(load_config([])).digest
    old = {k: v for k, v in d.items() if not k.startswith("actor_rollout_ref.rollout.trace.")}
    old["a.key.this.version.removed"] = "0123456789ab"
    assert len(old) < len(d) and ck.differing_keys(old, d) == []
    old["data.seed"] = "000000000000"
    assert ck.differing_keys(old, d) == ["data.seed"]
