"""Tensor-parallel rollout engines behind the AsyncRolloutManager's one-handle-per-worker contract.

With `actor_rollout_ref.rollout.tensor_model_parallel_size = N` the rollout group's workers
`[k*N, (k+1)*N)` are the TP ranks of engine k (vLLM's `external_launcher` grouping over the
rollout group's own process group, as in main_ppo). The manager dispatches whole chunks to
*engines*: `EngineHandle` gives it one handle per engine whose `generate_sequences.remote(x)` /
`load_weights.remote(p, v)` call the method on every TP rank with the same arguments (vLLM needs
identical prompts on all ranks; each rank loads its own slice of the full tensors) and return
the ObjectRef of TP rank 0, whose result is the engine's (the other ranks' results are equal and
dropped).

A TP rank that dies leaves its peers blocked in the engine's collectives. A watcher thread per
engine therefore ends the whole engine (`ray.kill` of every rank) as soon as any rank's call
fails with a dead actor or raises: rank 0's pending call then fails with RayActorError and the
manager treats the engine as one dead worker (its chunk goes back to the queue, the surviving
engines take it; docs/async.md "Failures").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

__all__ = ["EngineHandle", "engine_handles"]

_WATCH_S = 0.2  # how often the watcher looks at the calls in flight


def engine_handles(actors: Sequence[Any], tp: int) -> list[Any]:
    """The manager's worker handles: the actors themselves for tp = 1, one EngineHandle per engine
    (TP ranks `[k*tp, (k+1)*tp)`) otherwise."""
    if tp == 1:
        return list(actors)
    if len(actors) % tp:
        raise ValueError(f"{len(actors)} rollout workers do not split into engines of {tp} TP ranks")
    return [EngineHandle(k, actors[k * tp : (k + 1) * tp], k * tp) for k in range(len(actors) // tp)]


class _FanOut:
    """`handle.<method>.remote(*args)` of an EngineHandle."""

    def __init__(self, engine: EngineHandle, method: str) -> None:
        self._engine, self._method = engine, method

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self._engine.call(self._method, args, kwargs)


class EngineHandle:
    """The TP ranks of one engine as one actor handle (the manager's worker contract).

    Args:
        index: the engine's number (k).
        actors: its TP ranks' actor handles, TP rank 0 first.
        first_worker: the rollout-group rank of TP rank 0 (for messages).
    """

    def __init__(self, index: int, actors: Sequence[Any], first_worker: int) -> None:
        self.index, self.actors, self.first_worker = index, list(actors), first_worker
        self._inflight: list[tuple[int, str, ray.ObjectRef]] = []  # (TP rank, method, ref)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failure: str | None = None  # why the watcher ended the engine
        self._watcher = threading.Thread(target=self._watch, name=f"hybridrl-tp-engine-{index}", daemon=True)
        self._watcher.start()

    @property
    def generate_sequences(self) -> _FanOut:
        return _FanOut(self, "generate_sequences")

    @property
    def load_weights(self) -> _FanOut:
        return _FanOut(self, "load_weights")

    def call(self, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
        """Call `method` on every TP rank (Ray runs each actor's calls in order, so all ranks see
        the same sequence of calls); returns TP rank 0's ObjectRef."""
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        with self._lock:
            self._inflight.extend((r, method, ref) for r, ref in enumerate(refs))
        return refs[0]

    def _watch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                inflight = list(self._inflight)
            if not inflight:
                self._stop.wait(_WATCH_S)
                continue
            refs = [ref for _, _, ref in inflight]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_WATCH_S)
            done = {r.hex() for r in ready}
            for rank, method, ref in inflight:
                if ref.hex() in done:
                    self._check(rank, method, ref)
            with self._lock:
                self._inflight = [x for x in self._inflight if x[2].hex() not in done]

    def _check(self, rank: int, method: str, ref: ray.ObjectRef) -> None:
        try:
            ray.get(ref, timeout=0)
        except RayActorError as err:
            self._end(rank, method, "died", err)
        except RayError as err:
            self._end(rank, method, "raised", err)

    def _end(self, rank: int, method: str, what: str, err: BaseException) -> None:
        """A rank failed: end every rank of the engine, so none is left blocked in a collective."""
        if self.failure is not None:
            return
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.failure = (
            f"rollout engine {self.index}: TP rank {rank} (rollout worker {self.first_worker + rank}) {what} in "
            f"{method} ({first})"
        )
        print(f"[hybridrl.async] {self.failure}; ending the engine's {len(self.actors)} TP ranks")
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except (RayError, ValueError):
                pass
        self._stop.set()

    def close(self) -> None:
        """Stop the watcher thread."""
        self._stop.set()
        self._watcher.join(timeout=4 * _WATCH_S)
