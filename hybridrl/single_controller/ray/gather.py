"""Waiting for a Ray worker group's results: every wait is bounded (utils/deadlines.py), and a failed,
dead or hung rank becomes a `WorkerGroupError` naming the group, the rank and the method (a lost
node: `NodeLostError` naming the node and its ranks); the futures a non-blocking call returns."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from hybridrl.protocol import DataProto, DataProtoFuture
from hybridrl.single_controller.ray.nodes import (
    node_lost_error,
)
from hybridrl.single_controller.worker_group import (
    WorkerDiedError,
    WorkerGroupError,
    WorkerHungError,
)
from hybridrl.utils import deadlines

__all__ = [
    "WorkerGroupDataProtoFuture",
    "WorkerGroupFuture",
    "gather_refs",
    "get_one",
    "hung_error",
    "poll_refs",
]


# ----------------------------------------------------------------------------------------------
# waiting for results
# ----------------------------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _wrap_error(err: RayError, group: str, rank: int, method: str) -> WorkerGroupError:
    text = _ANSI.sub("", str(err))
    lost = node_lost_error(err, group, rank, method)  # the actor's whole node is gone
    if lost is not None:
        return lost
    if isinstance(err, RayActorError):
        return WorkerDiedError(
            f"worker group {group!r}: the actor of rank {rank} died before or while running {method!r} "
            f"({type(err).__name__}): {text}",
            group=group,
            rank=rank,
            method=method,
            cause=err,
        )
    cause = getattr(err, "cause", None)
    if isinstance(err, RayTaskError) and isinstance(cause, WorkerHungError):
        # the rank gave up waiting on another group's result: that group's rank is the hung one
        return WorkerHungError(
            f"worker group {group!r}: rank {rank} gave up in {method!r} waiting for its input: {cause}",
            group=cause.group,
            rank=cause.rank,
            method=cause.method,
            cause=err,
        )
    kind = "raised" if isinstance(err, RayTaskError) else f"failed with {type(err).__name__}"
    return WorkerGroupError(
        f"worker group {group!r}: rank {rank} {kind} in {method!r}. Remote traceback:\n{text}",
        group=group,
        rank=rank,
        method=method,
        cause=err,
    )


def gather_refs(
    refs: Sequence[ray.ObjectRef],
    *,
    group: str,
    method: str,
    ranks: Sequence[int],
    timeout_s: float | None = None,
    timeout_key: str = deadlines.STEP_KEY,
    limit_label: str | None = None,
    inspect: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """``ray.get`` on the refs of several ranks, failing fast and never waiting forever.

    While some ranks still run, results that are already there are checked, so one rank that
    raised or died surfaces at once (as a WorkerGroupError naming group, rank and method) even
    if the other ranks block, e.g. in a collective waiting for the dead one. When no rank has
    finished for ``timeout_s`` (default: ``trainer.step_timeout_s``), a WorkerHungError names the
    group, the first unfinished rank, the method, how long it waited and ``timeout_key``
    (``limit_label``, when given, says how the limit follows from the key). ``inspect(i, value)``,
    when given, sees each value as it arrives (it may raise to end the wait).
    """
    refs = list(refs)
    limit = deadlines.step_timeout() if timeout_s is None else float(timeout_s)
    values: dict[int, Any] = {}

    def take(done: list[int]) -> None:
        got = _get_ready([refs[i] for i in done], [ranks[i] for i in done], group, method)
        for i, value in zip(done, got):
            if inspect is not None:
                inspect(i, value)
            values[i] = value

    stuck, idle_s, total_s = poll_refs(refs, limit, take)
    if stuck:
        label = limit_label or f"{timeout_key}={limit:g}"
        raise hung_error(group, [ranks[i] for i in stuck], method, idle_s, total_s, label, timeout_key)
    return [values[i] for i in range(len(refs))]


def poll_refs(
    refs: Sequence[ray.ObjectRef], limit_s: float, take: Callable[[list[int]], None]
) -> tuple[list[int], float, float]:
    """Wait for every ref, handing the indices of each set that becomes ready to ``take``.

    Polls ``ray.wait`` with a growing interval (20 ms doubling to 500 ms) so that a ready result is
    seen while the others still run (``take`` may raise to end the wait). Returns
    ``(unfinished indices, idle_s, total_s)``: no unfinished index when all finished, else the ones
    still running after ``limit_s`` without any ref finishing.
    """
    pending = list(range(len(refs)))
    timeout = 0.02
    t0 = last_progress = time.monotonic()
    while pending:
        ready, _ = ray.wait([refs[i] for i in pending], num_returns=len(pending), timeout=timeout)
        ready_ids = {r.hex() for r in ready}
        done = [i for i in pending if refs[i].hex() in ready_ids]
        if done:
            take(done)
            finished = set(done)
            pending = [i for i in pending if i not in finished]
            last_progress = time.monotonic()
        now = time.monotonic()
        if pending and now - last_progress >= limit_s:
            return pending, now - last_progress, now - t0
        timeout = min(timeout * 2, 0.5, max(limit_s - (now - last_progress), 0.001))
    return [], 0.0, time.monotonic() - t0


def hung_error(
    group: str, stuck: list[int], method: str, idle_s: float, total_s: float, label: str, key: str
) -> WorkerHungError:
    return WorkerHungError(
        f"worker group {group!r}: rank {stuck[0]} is alive but made no progress in {method!r} for "
        f"{idle_s:.1f} s (waited {total_s:.1f} s in all; unfinished ranks {stuck}); {label}. "
        f"Find what rank {stuck[0]} waits on (a collective another rank never entered, a lock, a "
        f"remote service), or raise {key} if the step is just slow.",
        group=group,
        rank=stuck[0],
        method=method,
    )


def _get_ready(refs: list[ray.ObjectRef], ranks: list[int], group: str, method: str) -> list[Any]:
    """The values of refs that are ready, in one ray.get; on an error, rank by rank to name it."""
    try:
        return ray.get(refs)
    except RayError:
        return [get_one(ref, group, rank, method) for ref, rank in zip(refs, ranks)]


def get_one(ref: ray.ObjectRef, group: str, rank: int, method: str) -> Any:
    try:
        return ray.get(ref)  # ready (gather_refs' ray.wait): does not wait
    except RayError as err:
        raise _wrap_error(err, group, rank, method) from None


class WorkerGroupFuture:
    """Result of a non-blocking call: ``get()`` waits and returns what the blocking call would."""

    def __init__(
        self,
        refs: list[ray.ObjectRef],
        collect: Callable[[list[Any]], Any],
        group: str,
        method: str,
        ranks: list[int],
    ) -> None:
        self.refs, self._collect, self._group, self._method, self._ranks = refs, collect, group, method, ranks

    def get(self) -> Any:
        return self._collect(
            gather_refs(self.refs, group=self._group, method=self._method, ranks=self._ranks)
        )

    def __repr__(self) -> str:
        return f"WorkerGroupFuture({self._group!r}.{self._method}, ranks={self._ranks})"


@dataclass
class WorkerGroupDataProtoFuture(DataProtoFuture):
    """DataProtoFuture whose ``get()`` reports failures with group, rank and method."""

    group: str = ""
    method: str = ""
    ranks: list[int] = field(default_factory=list)

    def get(self) -> DataProto:
        limit, label = self.wait_limit(), None
        if self.waiter:  # inside a worker: see DataProtoFuture / deadlines.nested_timeout
            step = self.timeout_s or deadlines.step_timeout()
            label = (
                f"{deadlines.STEP_KEY}={step:g}, of which {self.waiter} waits "
                f"{deadlines.NESTED_FRACTION:g} ({limit:g} s) for this input"
            )
        outputs = gather_refs(
            self.futures,
            group=self.group,
            method=self.method,
            ranks=self.ranks,
            timeout_s=limit,
            limit_label=label,
        )
        output = self.collect_fn(outputs)
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output
