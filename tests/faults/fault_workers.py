"""Worker classes of the fault tests (shipped to the Ray actors by value)."""

from __future__ import annotations

import os
import time

from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Dispatch, Worker, register
from hybridrl.utils import deadlines


class NapWorker(Worker):
    """A worker whose `nap` hangs (alive, sleeping) on one rank."""

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, rank_to_hang: int, seconds: float) -> int:
        if self.rank == rank_to_hang:
            time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class HangingScorer:
    """A reward-model replica whose `score` never answers (alive, sleeping)."""

    def __init__(self, seconds: float = 3600.0) -> None:
        self.seconds = seconds

    def score(self, seqs: list[list[int]]) -> list[float]:
        time.sleep(self.seconds)
        return [0.0] * len(seqs)


class ProducerWorker(Worker):
    """Hands its result to another group as a future; `produce` can hang (alive, sleeping)."""

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: DataProto, seconds: float) -> DataProto:
        time.sleep(seconds)
        return data

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class ConsumerWorker(Worker):
    """Resolves futures and object refs of another group inside the worker."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.ONE_TO_ALL)
    def timeouts(self) -> tuple[float, float]:
        return deadlines.step_timeout(), deadlines.reward_timeout()

    @register(Dispatch.ONE_TO_ALL)
    def wait_for(self, boxed: list, seconds: float, how: str) -> str:
        """Wait (inside this worker) for the ObjectRef in `boxed` (boxed: Ray does not resolve it)."""
        if how == "get":
            deadlines.get_refs(boxed[0], what="ConsumerWorker.wait_for", timeout_s=seconds)
        else:
            deadlines.wait_refs(boxed, what="ConsumerWorker.wait_for", timeout_s=seconds)
        return "ready"
