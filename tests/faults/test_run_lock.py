"""One writer per run folder: a second live run is refused at once, a dead run's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hybridrl.utils import run_lock
from hybridrl.utils.run_lock import LOCK_FILE, RunFolderBusy, RunLock

_HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[2])  # without importing torch
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
lock = mod.RunLock(sys.argv[1], label="proj/holder").acquire()
print("held", flush=True)
time.sleep(600)
"""


def _hold(root) -> subprocess.Popen:
    """Another process holding the lock of `root` (returns once it is held)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root), run_lock.__file__],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_a_live_holder_refuses_and_a_killed_one_is_taken_over(tmp_path, capsys):
    holder = _hold(tmp_path / "run")
    try:
        started = time.monotonic()
        with pytest.raises(RunFolderBusy) as err:
            RunLock(str(tmp_path / "run"), label="proj/second").acquire()
        assert time.monotonic() - started < 5
        msg = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in msg and "run proj/holder" in msg
        assert "trainer.default_local_dir" in msg and "in use by another live run" in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(str(tmp_path / "run"), label="proj/third").acquire()
    try:
        err = capsys.readouterr().err
        assert "taking over the lock" in err and f"process {holder.pid} is gone" in err
        with open(tmp_path / "run" / LOCK_FILE) as f:
            assert json.load(f)["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_release_on_exit_and_only_of_our_own_lock(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "global_step_1").mkdir()
    with RunLock(str(root)):
        assert (root / LOCK_FILE).exists()
    assert not (root / LOCK_FILE).exists() and (root / "global_step_1").is_dir()
    with pytest.raises(SystemExit):
        with RunLock(str(root)):
            raise SystemExit(143)
    assert not (root / LOCK_FILE).exists()
    lock = RunLock(str(root)).acquire()
    info = json.loads((root / LOCK_FILE).read_text())
    (root / LOCK_FILE).write_text(json.dumps({**info, "token": "someone-else"}))  # taken over meanwhile
    lock.release()
    assert (root / LOCK_FILE).exists()  # not ours any more: left alone
    # a folder the lock created (the run wrote nothing) is removed with it
    with RunLock(str(tmp_path / "fresh")):
        pass
    assert not (tmp_path / "fresh").exists()


def _write_lock(root, **info) -> None:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, LOCK_FILE), "w") as f:
        json.dump(info, f)


def test_a_reused_pid_is_stale_and_another_hosts_lock_goes_by_its_heartbeat(tmp_path, capsys):
    here = {"host": socket.gethostname(), "boot_id": run_lock._boot_id()}
    # our own pid, but recorded with another start time: the pid was reused by this process
    _write_lock(tmp_path / "a", **here, pid=os.getpid(), start_ticks=1)
    RunLock(str(tmp_path / "a")).acquire().release()
    assert "now belongs to another process" in capsys.readouterr().err
    # a lock written on another node of a shared filesystem: alive while its heartbeat is fresh
    _write_lock(tmp_path / "b", host="other-node", boot_id="x", pid=1, label="proj/elsewhere")
    with pytest.raises(RunFolderBusy, match="pid 1 on host other-node"):
        RunLock(str(tmp_path / "b")).acquire()
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(tmp_path / "b" / LOCK_FILE, (old, old))
    RunLock(str(tmp_path / "b")).acquire().release()
    assert "heartbeat stopped" in capsys.readouterr().err


def test_the_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(str(tmp_path)).acquire()
    try:
        old = time.time() - 1000
        os.utime(tmp_path / LOCK_FILE, (old, old))
        time.sleep(0.5)
        assert time.time() - os.stat(tmp_path / LOCK_FILE).st_mtime < 5
    finally:
        lock.release()


@pytest.mark.slow
def test_a_second_training_run_on_a_live_runs_folder_is_refused(tmp_path, capsys):
    """A real run holds its folder (stopped right after its step-2 checkpoint); the same command
    started again is refused before anything starts; after a SIGKILL of the first, it resumes."""
    from hybridrl.trainer.ppo.launch import run_ppo_config
    from tests.e2e.ppo_runs import compose_config, read_metrics
    from tests.e2e.test_resume import ARGS, _launch

    ckpt = tmp_path / "ckpt"
    first = _launch(ckpt, tmp_path / "first", hold_after=2)
    try:
        deadline = time.time() + 300
        while not (ckpt / "global_step_2").exists():
            assert first.poll() is None and time.time() < deadline, first.stdout.read().decode()[-3000:]
            time.sleep(0.05)
        config = compose_config([*ARGS, "trainer.backend=local"], tmp_path)
        config.trainer.default_local_dir = str(ckpt)
        started = time.monotonic()
        with pytest.raises(RunFolderBusy, match=f"pid {first.pid} on host"):
            run_ppo_config(config)
        assert time.monotonic() - started < 5
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / "second")
    config = compose_config([*ARGS, "trainer.backend=local", "trainer.total_training_steps=3"], tmp_path)
    config.trainer.default_local_dir = str(ckpt)
    run_ppo_config(config)
    assert "taking over the lock" in capsys.readouterr().err
    rows = [r for r in read_metrics(tmp_path / "second" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [3]
