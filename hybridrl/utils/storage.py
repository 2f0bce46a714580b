"""Storage faults named: a full disk, an I/O error, a permission or a vanished mount.

A failed write deep in torch reads like a riddle (``RuntimeError: [enforce fail at
inline_container.cc] . unexpected pos 704 vs 598``, or an ``OSError`` several wrappers deep in a
Ray task error or a distributed-checkpoint exception). ``StorageError`` says instead which folder,
what the OS said (ENOSPC, EIO, EACCES, ...), how many bytes the write needed (when known) and how
many are free, and which checkpoint is the last good one (a failed save never replaces it: saves
are written into a temporary folder and renamed only once complete).

``check_free_space`` is the check before a save: the previous checkpoint's size against the free
space of the folder. ``named_storage_faults`` turns a storage fault raised inside its block into a
``StorageError``; any other error passes through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator

__all__ = [
    "StorageError",
    "check_free_space",
    "dir_size",
    "find_storage_fault",
    "free_bytes",
    "named_storage_faults",
]

STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "input/output error (the disk or the network filesystem failed)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only filesystem",
    errno.ENOENT: "the folder vanished (unmounted or deleted)",
    errno.ESTALE: "stale file handle (the network filesystem went away)",
    errno.ENOTCONN: "the filesystem is not connected (a FUSE mount ended)",
}
_TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


class StorageError(RuntimeError):
    """A write to the run's storage failed, or would not fit; the message names folder and bytes."""


def dir_size(path: str) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def free_bytes(path: str) -> int | None:
    """Free bytes for this user on the filesystem of `path` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _walk(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
        for arg in getattr(e, "args", ()):
            if isinstance(arg, BaseException):
                todo.append(arg)


def find_storage_fault(exc: BaseException) -> str | None:
    """What went wrong with storage in `exc` (its causes included), or None for any other error."""
    for e in _walk(exc):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            name = errno.errorcode.get(e.errno, str(e.errno))
            where = f" at {e.filename}" if e.filename else ""
            return f"{name}: {STORAGE_ERRNOS[e.errno]}{where}"
    for e in _walk(exc):
        text = str(e)
        if any(marker in text for marker in _TORCH_WRITE_FAILURES):
            first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
            return f"a write stopped short, as on a full disk ({first})"
    return None


def _message(what: str, folder: str, cause: str, needed: int | None, last_good: str | None) -> str:
    free = free_bytes(folder)
    need = f"{needed:,} bytes needed" if needed else "bytes needed unknown"
    have = f"{free:,} bytes free" if free is not None else "free space unknown (the folder cannot be reached)"
    good = (
        f"the last good checkpoint, {last_good}, is untouched and loadable"
        if last_good
        else "no checkpoint yet"
    )
    return (
        f"{what} in {folder} failed: {cause}; {need}, {have}. {good}. Free space there (or fix the mount / "
        "permissions), or point the run at another folder, and run the same command again to resume"
    )


def check_free_space(folder: str, needed: int, what: str, last_good: str | None) -> None:
    """Raise StorageError before writing `needed` bytes into `folder` when fewer are free."""
    free = free_bytes(folder)
    if needed > 0 and free is not None and free < needed:
        raise StorageError(_message(what, folder, "not enough free space", needed, last_good))


@contextlib.contextmanager
def named_storage_faults(
    what: str, folder: str, *, needed: int | None = None, last_good: str | None = None
) -> Iterator[None]:
    """Within the block, a storage fault (also wrapped in Ray / DCP errors) raises StorageError."""
    try:
        yield
    except StorageError:
        raise
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause = find_storage_fault(e)
        if cause is None:
            raise
        raise StorageError(_message(what, folder, cause, needed, last_good)) from e
