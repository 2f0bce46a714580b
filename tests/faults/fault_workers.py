"""Worker classes of the fault tests (shipped to the Ray actors by value)."""

from __future__ import annotations

import os
import time

from hybridrl.single_controller.base import Dispatch, Worker, register


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
