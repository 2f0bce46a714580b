"""The records the AsyncRolloutManager keeps: groups, rollout workers, chunks in flight, and the
batch it hands to the trainer (hybridrl/async_rollout/manager.py drives them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hybridrl.protocol import DataProto
from hybridrl.utils import deadlines

__all__ = ["GEN_KEYS", "AsyncBatch", "Chunk", "Group", "RolloutWorkersLostError", "WorkerState", "hung_error"]

GEN_KEYS = ("input_ids", "attention_mask", "position_ids")


class RolloutWorkersLostError(RuntimeError):
    """Every rollout worker died; generation cannot continue."""


@dataclass
class Group:
    """One prompt and its rollout.n responses, from submit to the batch that consumes it."""

    seq: int  # commit order among all submitted groups
    uid: str
    prompt: DataProto  # one prompt row
    commit_version: int = -1
    version: int = -1  # the behaviour policy's version, set when its chunk is dispatched
    result: DataProto | None = None  # rollout.n rows once finished
    partial: dict[str, Any] | None = None  # partial rollout: the rows' prefixes (resume.PARTIAL_KEYS)


def hung_error(rank: int, method: str, waited_s: float) -> RuntimeError:
    """The error of a worker that is alive but did not finish `method` within trainer.step_timeout_s."""
    key = deadlines.STEP_KEY
    return RuntimeError(
        f"rollout worker {rank} is alive but {method} did not finish within {waited_s:.1f} s "
        f"({key}={deadlines.step_timeout():g}); find what it waits on, or raise {key}"
    )


@dataclass
class WorkerState:
    """The manager's view of one rollout worker (its Ray handle, liveness, last version sent)."""

    rank: int
    handle: Any
    alive: bool = True
    busy: bool = False
    version: int = -1  # last version sent with load_weights
    busy_s: float = 0.0  # cumulative busy seconds the worker reported
    busy_s_at_batch: float = 0.0


@dataclass
class Chunk:
    """Whole groups sent to one worker in one generate call."""

    worker: WorkerState
    groups: list[Group]
    rest: DataProto  # the repeated prompt batch minus the generation inputs
    version: int
    started: float = field(default_factory=time.monotonic)  # dispatch time (trainer.step_timeout_s)


@dataclass
class AsyncBatch:
    """One trainer batch from `wait_batch`.

    Attributes:
        data: B * rollout.n rows, whole groups, earliest deadline first; non-tensor
            "policy_version" (int, per row) and "uid".
        versions: the behaviour version of each group (B values).
        staleness: batch index - version for each group.
        metrics: async/* metrics of this batch (staleness histogram, queue depths, idle time).
    """

    data: DataProto
    versions: list[int]
    staleness: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
