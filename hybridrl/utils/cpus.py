"""How many CPU cores (torch threads) each worker of a CPU-only run gets: `trainer.cpus_per_worker`.

`auto` (the default) divides the CPUs this process may use among the slots of a node, after
leaving one core to the driver and Ray's own processes when there are cores to spare
(`auto_cpus_per_worker`). An explicit positive integer always wins. With more than one thread a
worker also gets `OMP_WAIT_POLICY=PASSIVE` (`thread_env`): OpenMP's default lets idle threads spin,
which made two threads 3x slower than one on a loaded 2-core machine, while sleeping threads made
two threads 1.8x faster than one there (bench/threads.py).
"""

from __future__ import annotations

import os

AUTO = "auto"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_cpus_per_worker(cpus: int, slots: int) -> int:
    """Cores per slot when `cpus` cores are shared by `slots` worker slots (>= 1).

    One core is left to the driver (data, rewards, advantages) and Ray's processes only when
    every slot still gets two or more: the synchronous driver mostly waits while the workers
    compute, so on a small machine it shares their cores instead of idling one.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    reserve = 1 if cpus - 1 >= 2 * slots else 0
    return max(1, (cpus - reserve) // slots)


def resolve_cpus_per_worker(
    value, slots: int, cpus: int | None = None, key: str = "trainer.cpus_per_worker"
) -> int:
    """`value` ('auto'/None or a positive integer) -> the cores (threads) of one worker slot."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return auto_cpus_per_worker(available_cpus() if cpus is None else cpus, slots)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number != int(number) or number < 1:
        raise ValueError(f"{key}={value!r}: use 'auto' or a positive integer (CPU cores per worker slot)")
    return int(number)


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a worker process running `threads` torch threads (set before torch loads).

    OMP_WAIT_POLICY=PASSIVE for more than one thread; a value already in the environment wins.
    """
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if threads > 1:
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return env
