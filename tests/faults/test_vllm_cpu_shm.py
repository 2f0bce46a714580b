"""Leftover vLLM-CPU shared-memory segments: which ones start-up removes, which it must keep.

Real files under /dev/shm (names unique to this test), a real mapping held by a live child
process, real dead pids. No vLLM needed: the names follow vLLM-CPU's scheme
`{ident}-tp:{n}-[{ranks}]-cpushm_{rank}`.
"""

from __future__ import annotations

import mmap
import os
import secrets
import subprocess
import sys
import time

import pytest

from hybridrl.rollout.vllm_cpu_shm import SHM_DIR, remove_own_segments, remove_stale_segments

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _make(name: str, age_s: float = 0.0) -> str:
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


@pytest.fixture
def names():
    """A group name unique to this test (ranks no real run uses) and cleanup of what is left."""
    tag = f"{secrets.randbelow(10**6) + 9 * 10**6}-{secrets.randbelow(10**6) + 9 * 10**6}"
    made: list[str] = []

    def make(ident: str, rank: int, age_s: float = 0.0) -> str:
        made.append(_make(f"{ident}-tp:0-[{tag}]-cpushm_{rank}", age_s))
        return os.path.basename(made[-1])

    yield make
    for p in made:
        if os.path.exists(p):
            os.unlink(p)


def test_stale_segments_of_dead_runs_are_removed_and_live_ones_kept(names):
    dead, live = _dead_pid(), os.getpid()
    legacy_old = names("", 0, age_s=600)  # vLLM's own name, unmapped, old: stale
    legacy_new = names("", 1)  # vLLM's own name, just made: its creator may be about to map it
    ours_dead = names(f"hybridrl-{dead}-0123abcd", 0)
    ours_live = names(f"hybridrl-{live}-0123abcd", 0, age_s=600)
    mapped = names(f"hybridrl-{dead}-4567cdef", 1, age_s=600)  # creator gone, a peer still maps it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap,os,sys,time\n"
            f"f=open(os.path.join({SHM_DIR!r},{mapped!r}),'r+b'); m=mmap.mmap(f.fileno(),4096)\n"
            "print('mapped',flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        removed = remove_stale_segments()
    finally:
        holder.kill()
        holder.wait()
    mine = {legacy_old, legacy_new, ours_dead, ours_live, mapped}
    assert set(removed) & mine == {legacy_old, ours_dead}
    left = set(os.listdir(SHM_DIR)) & mine
    assert left == {legacy_new, ours_live, mapped}
    # the holder is gone now: its segment goes at the next start-up
    assert mapped in remove_stale_segments()


def test_segment_mapped_by_this_process_is_kept(names):
    seg = names("", 0, age_s=600)
    with open(os.path.join(SHM_DIR, seg), "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert seg not in remove_stale_segments()
        assert os.path.exists(os.path.join(SHM_DIR, seg))


def test_another_users_segment_is_kept(names):
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    seg = names(f"hybridrl-{_dead_pid()}-0123abcd", 0, age_s=600)
    os.chown(os.path.join(SHM_DIR, seg), 12345, 12345)
    assert seg not in remove_stale_segments()


def test_remove_own_segments_removes_only_what_this_rank_created(names):
    ident = f"hybridrl-{os.getpid()}-89abcdef"
    r0, r1 = names(ident, 0), names(ident, 1)
    other = names(f"hybridrl-{os.getpid()}-fedcba98", 0)
    # names() ranks are [a-b] with a = global rank of group rank 0
    global_rank0 = int(r0.split("[")[1].split("-")[0])
    assert remove_own_segments(ident, global_rank0) == [r0]
    left = set(os.listdir(SHM_DIR))
    assert r0 not in left and r1 in left and other in left
