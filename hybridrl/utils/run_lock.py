"""One writer per run folder: a lock file held by the live driver.

``RunLock(root)`` creates ``root/run.lock`` with ``O_CREAT | O_EXCL`` (atomic on local filesystems
and on NFSv3+ shares) and writes who holds it: host, boot id, pid and the process's start time,
the run's label and command line. While held, a daemon thread refreshes the file's modification
time every ``HEARTBEAT_S`` seconds. The lock is removed on every exit Python sees (return, error,
SystemExit from a signal, atexit); a process killed outright (SIGKILL, node loss) leaves it behind,
and the next run decides whether it is stale:

* same machine (same host name and boot id): stale when the pid is gone, or belongs to a process
  started at another time (the pid was reused); exact, immediate.
* another machine, or this one before a reboot (a folder on a shared filesystem): stale when the
  heartbeat stopped ``STALE_AFTER_S`` seconds ago (by the file's modification time, which the file
  server sets).

A stale lock is taken over with a message naming the dead run; a live one refuses the new run at
once (``RunFolderBusy``) naming the other run and the keys to change.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid

__all__ = ["HEARTBEAT_S", "LOCK_FILE", "STALE_AFTER_S", "RunFolderBusy", "RunLock", "stale_reason"]

LOCK_FILE = "run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0


class RunFolderBusy(RuntimeError):
    """Another live run holds the run folder's lock."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def describe(info: dict) -> str:
    """`pid 123 on host h (run p/e, since 2026-...; command ...)`."""
    what = [f"run {info['label']}" if info.get("label") else "", f"since {info.get('since', '?')}"]
    if info.get("command"):
        what.append(f"command: {info['command'][:300]}")
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} ({'; '.join(w for w in what if w)})"


def stale_reason(info: dict, mtime: float, now: float | None = None) -> str | None:
    """Why the lock `info` (written at `mtime`) belongs to a dead run; None while it may be alive."""
    now = time.time() if now is None else now
    same_machine = info.get("host") == socket.gethostname() and info.get("boot_id") == _boot_id()
    if same_machine and isinstance(info.get("pid"), int):
        pid = info["pid"]
        if not _pid_alive(pid):
            return f"process {pid} is gone"
        started = process_start_ticks(pid)
        if info.get("start_ticks") is not None and started is not None and started != info["start_ticks"]:
            return f"pid {pid} now belongs to another process"
        return None
    age = now - mtime
    if age > STALE_AFTER_S:
        return f"its heartbeat stopped {age:.0f} s ago (a live run refreshes it every {HEARTBEAT_S:g} s)"
    return None


class RunLock:
    """The lock of one run folder, held by this process (a context manager; re-entrant: no).

    Args:
        root: the run folder (trainer.default_local_dir); created if missing.
        label: what the other run's message calls this run (project/experiment).
    """

    def __init__(self, root: str, label: str = "") -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.path = os.path.join(self.root, LOCK_FILE)
        self.label = label
        self.token = uuid.uuid4().hex
        self._created_root = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _info(self) -> dict:
        return {
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "pid": os.getpid(),
            "start_ticks": process_start_ticks(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "label": self.label,
            "command": " ".join(sys.argv),
            "token": self.token,
        }

    def acquire(self) -> RunLock:
        """Take the lock, or take over a stale one; raises RunFolderBusy while another run is alive."""
        if not os.path.isdir(self.root):
            os.makedirs(self.root, exist_ok=True)
            self._created_root = True
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._info(), f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            self._thread = threading.Thread(target=self._heartbeat, name="hybridrl-run-lock", daemon=True)
            self._thread.start()
            return self
        raise RunFolderBusy(f"could not take {self.path}: other runs keep taking it; start one run at a time")

    def _take_over_or_refuse(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return  # released meanwhile: try again
        try:
            info = json.loads(text)
        except ValueError:
            info = {}
            if time.time() - mtime < HEARTBEAT_S:  # being written right now
                raise RunFolderBusy(self._busy_message({"since": "just now"})) from None
        reason = stale_reason(info, mtime) if info else "the lock file is unreadable"
        if reason is None:
            raise RunFolderBusy(self._busy_message(info))
        aside = f"{self.path}.stale-{self.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside) as f:
            if f.read() != text:  # another new run took it between our read and the rename: give it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                os.unlink(aside)
                return
        os.unlink(aside)
        print(
            f"[hybridrl] taking over the lock of {self.root} from a run that ended without releasing it "
            f"({describe(info)}): {reason}",
            file=sys.stderr,
            flush=True,
        )

    def _busy_message(self, info: dict) -> str:
        return (
            f"trainer.default_local_dir={self.root} is in use by another live run: {describe(info)}. Two "
            "runs writing one folder would interleave their checkpoints. Wait for that run to end (or stop "
            "it), or give this run a folder of its own: trainer.default_local_dir (or "
            f"trainer.experiment_name / trainer.project_name). Lock file: {self.path}"
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the folder vanished: the save will report it

    def _still_ours(self) -> bool:
        try:
            with open(self.path) as f:
                return json.load(f).get("token") == self.token
        except (OSError, ValueError):
            return False

    def release(self) -> None:
        """Remove the lock if this process still holds it (idempotent)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        atexit.unregister(self.release)
        if self._still_ours():
            try:
                os.unlink(self.path)
            except OSError:
                pass
        if self._created_root:
            try:
                os.rmdir(self.root)  # only if the run wrote nothing else there
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
