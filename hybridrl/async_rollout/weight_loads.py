"""The `load_weights` calls the AsyncRolloutManager has sent and not yet seen finish.

Ray runs an actor's calls in order, so a load sent while a chunk generates runs after it; the
manager only needs to notice when one fails: a dead worker is dropped, any other error stops the
run. The seconds each load took (the worker's return value) are kept for the step's metrics.
"""

from __future__ import annotations

import threading
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from hybridrl.async_rollout.records import WorkerState
from hybridrl.async_rollout.tp_engine import call_failure, worker_label

__all__ = ["WeightLoads"]


class WeightLoads:
    """Pending `load_weights(payload, version)` calls, one entry per (worker, version)."""

    def __init__(self) -> None:
        self._pending: list[tuple[WorkerState, Any, int]] = []
        self._lock = threading.Lock()
        self._seconds: list[float] = []  # of the loads finished since the last `take_seconds`

    def send(self, w: WorkerState, payload: Any, version: int) -> None:
        """Queue `load_weights(payload, version)` on worker `w` (after whatever it runs now)."""
        ref = w.handle.load_weights.remote(payload, version)
        with self._lock:
            self._pending.append((w, ref, version))
        w.version = version

    def drop(self, w: WorkerState) -> None:
        """Forget the loads of a worker that died."""
        with self._lock:
            self._pending = [x for x in self._pending if x[0] is not w]

    def poll(self) -> list[tuple[WorkerState, BaseException | str]]:
        """Check the finished loads without waiting; returns the (worker, error) of dead workers.

        Raises:
            RuntimeError: a worker raised in load_weights (names the worker and the version).
        """
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return []
        ready, _ = ray.wait([r for _, r, _ in pending], num_returns=len(pending), timeout=0)
        done = {r.hex() for r in ready}
        dead = []
        for w, ref, version in pending:
            if ref.hex() not in done:
                continue
            try:
                seconds = ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except RayError as err:  # a TP engine's failure is its first failing rank's (tp_engine.py)
                died, why = call_failure(w.handle, err)
                if not died:
                    raise RuntimeError(
                        f"{worker_label(w.handle, w.rank)} failed to load weights of version {version}:\n{why}"
                    ) from None
                dead.append((w, why))
            else:
                if isinstance(seconds, (int, float)):
                    self._seconds.append(float(seconds))
            with self._lock:
                self._pending = [x for x in self._pending if x[1] is not ref]
        return dead

    def take_seconds(self) -> list[float]:
        """The seconds of every load finished since the last call (and forget them)."""
        with self._lock:
            out, self._seconds = self._seconds, []
        return out
