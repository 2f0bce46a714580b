"""Storage faults named: a full disk (a real small tmpfs), an I/O error injected at the write call.

Each failed write ends the run with a StorageError naming the folder, the bytes needed and free
and the last good checkpoint, which stays loadable (a run resumes from it).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
import torch

from hybridrl.utils import checkpointing as ck
from hybridrl.utils.storage import StorageError, find_storage_fault
from tests.faults.test_checkpoint_runs import _run


@pytest.fixture
def small_disk(tmp_path):
    """`mount(size)`: a tmpfs of `size` bytes under tmp_path (needs the right to mount; else skipped)."""
    mounted = []

    def mount(size: int, name: str = "disk"):
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _ckpt_size(tmp_path) -> int:
    _run(tmp_path / "probe", "logs", ["trainer.total_training_steps=1"])
    root = str(tmp_path / "probe" / "ckpt")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def test_a_full_disk_ends_the_run_naming_it_and_the_last_good_checkpoint_resumes(tmp_path, small_disk):
    size = _ckpt_size(tmp_path)
    disk = small_disk(int(size * 1.6))  # one checkpoint fits, a second one does not
    args = ["trainer.total_training_steps=3", f"trainer.default_local_dir={disk}/ckpt"]
    with pytest.raises(StorageError) as err:
        _run(tmp_path, "a", args)
    msg = str(err.value)
    good = ck.step_dir(f"{disk}/ckpt", 1)
    assert f"saving checkpoint step 2 in {disk}/ckpt failed" in msg, msg
    assert "bytes needed" in msg and "bytes free" in msg and f"last good checkpoint, {good}" in msg, msg
    assert ck.list_checkpoints(f"{disk}/ckpt") == [1] and ck.verify(good) is None
    assert not os.path.exists(ck.tmp_step_dir(f"{disk}/ckpt", 2))
    rows = _run(
        tmp_path,
        "b",
        ["trainer.total_training_steps=2", f"trainer.default_local_dir={disk}/ckpt", "trainer.save_freq=-1"],
    )
    assert [r["step"] for r in rows] == [2]  # resumed from step 1


def test_a_disk_too_small_for_the_first_save_names_enospc(tmp_path, small_disk):
    disk = small_disk(64 * 1024)
    with pytest.raises(StorageError) as err:
        _run(tmp_path, "a", ["trainer.total_training_steps=1", f"trainer.default_local_dir={disk}/ckpt"])
    msg = str(err.value)
    assert f"saving checkpoint step 1 in {disk}/ckpt failed" in msg and "no checkpoint yet" in msg, msg
    assert "ENOSPC" in msg or "write stopped short" in msg, msg
    assert ck.list_checkpoints(f"{disk}/ckpt") == []


def test_an_io_error_at_the_write_call_is_named(tmp_path, monkeypatch):
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if str(f).endswith("data.pt") and "global_step_2" in str(f):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(StorageError) as err:
        _run(tmp_path, "a", ["trainer.total_training_steps=3"])
    msg = str(err.value)
    root = str(tmp_path / "ckpt")
    assert "EIO: input/output error" in msg and f"last good checkpoint, {ck.step_dir(root, 1)}" in msg, msg
    assert ck.list_checkpoints(root) == [1] and ck.latest_pointer(root) == 1


def test_a_full_rollout_dump_folder_is_named(tmp_path, small_disk):
    disk = small_disk(4096, "dumps")
    (disk / "filler").write_bytes(b"x" * 4096)
    with pytest.raises(
        StorageError, match=rf"writing the rollout dump \(trainer.rollout_data_dir\) in {disk}"
    ):
        _run(tmp_path, "a", ["trainer.total_training_steps=1", f"trainer.rollout_data_dir={disk}"])


def test_storage_faults_are_found_through_wrappers():
    inner = OSError(errno.ENOSPC, "No space left on device", "/x/y")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("worker failed") from e
    except RuntimeError as outer:
        assert find_storage_fault(outer) == "ENOSPC: no space left on the device at /x/y"
    torch_riddle = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert "write stopped short" in find_storage_fault(torch_riddle)
    assert find_storage_fault(ValueError("bad data")) is None


@pytest.mark.slow
def test_a_full_disk_in_a_ray_worker_ends_the_run_naming_it(ray_faults, tmp_path, small_disk):
    """The same full disk, written by the worker actor's process (trainer.backend=ray): the error
    crosses Ray (a task error around torch's write failure) and still names folder, bytes and the
    last good checkpoint, which resumes."""
    size = _ckpt_size(tmp_path)
    disk = small_disk(int(size * 1.6))
    args = ["trainer.backend=ray", "trainer.total_training_steps=3", f"trainer.default_local_dir={disk}/ckpt"]
    with pytest.raises(StorageError) as err:
        _run(tmp_path, "a", args)
    msg = str(err.value)
    good = ck.step_dir(f"{disk}/ckpt", 1)
    assert f"saving checkpoint step 2 in {disk}/ckpt failed" in msg, msg
    assert "bytes needed" in msg and "bytes free" in msg and f"last good checkpoint, {good}" in msg, msg
    assert ck.list_checkpoints(f"{disk}/ckpt") == [1] and ck.verify(good) is None
    rows = _run(tmp_path, "b", [*args[:1], "trainer.total_training_steps=2", args[2], "trainer.save_freq=-1"])
    assert [r["step"] for r in rows] == [2]  # resumed from step 1


def test_a_full_disk_under_the_file_logger_is_named_and_keeps_whole_lines(small_disk):
    from hybridrl.utils.tracking import _File

    disk = small_disk(8192, "logs")
    logger = _File(str(disk), "metrics.jsonl", None)
    logger.log({"a": 1.0}, step=1)
    (disk / "filler").write_bytes(b"x" * (8192 - 4096))  # tmpfs pages: the next page is the last one
    with pytest.raises(
        StorageError, match=rf"writing the file logger's metrics.jsonl \(trainer.logger=file\) in {disk}"
    ):
        for step in range(2, 10_000):  # fill the last page, then fail
            logger.log({"a": 1.0, "padding": "y" * 200}, step=step)
    lines = (disk / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))
