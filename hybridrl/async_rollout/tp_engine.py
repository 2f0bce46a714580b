"""Tensor-parallel rollout engines behind the AsyncRolloutManager's one-handle-per-worker contract.

With `actor_rollout_ref.rollout.tensor_model_parallel_size = N` the rollout group's workers
`[k*N, (k+1)*N)` are the TP ranks of engine k (vLLM's `external_launcher` grouping over the
rollout group's own process group, as in main_ppo). The manager dispatches whole chunks to
*engines*: `EngineHandle` gives it one handle per engine whose `generate_sequences.remote(x)` /
`load_weights.remote(p, v)` (and partial rollout's `abort_generation.remote(v, ready)`) call the
method on every TP rank with the same arguments (vLLM needs
identical prompts on all ranks; each rank loads its own slice of the full tensors) and return
the ObjectRef of TP rank 0, whose result is the engine's (the other ranks' results are equal and
dropped).

A TP rank that dies leaves its peers blocked in the engine's collectives. A watcher thread per
engine therefore ends the whole engine (`ray.kill` of every rank) as soon as any rank's call
fails with a dead actor or raises, and records which rank failed and how. The manager asks
`call_failure(handle, err)` what a failed call means: an engine with a dead rank is one dead
worker (its chunk goes back to the queue, the surviving engines take it; docs/async.md
"Failures"), named by the rank that died; an engine one of whose ranks *raised* stops the run with
that rank's error, as a TP = 1 worker that raises does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from hybridrl.single_controller.ray.nodes import node_lost_error

__all__ = ["EngineHandle", "call_failure", "engine_handles", "worker_label"]

_WATCH_S = 0.2  # how often the watcher looks at the calls in flight
_SETTLE_S = 10.0  # how long a failed call waits for the watcher to say which rank failed and how
_GRACE_S = 5.0  # how long a rank's error waits for a peer's call to fail as a dead actor


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
        self.failed_rank: int | None = None  # the TP rank whose call failed first
        self.rank_died: bool | None = None  # True: that rank's process died; False: it raised
        self.error_text = ""  # that rank's error in full (its remote traceback when it raised)
        self._failed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"hybridrl-tp-engine-{index}", daemon=True)
        self._watcher.start()

    @property
    def label(self) -> str:
        """How messages name this engine."""
        return f"rollout engine {self.index} (rollout workers {self.first_worker}..{self.first_worker + len(self.actors) - 1})"

    @property
    def generate_sequences(self) -> _FanOut:
        return _FanOut(self, "generate_sequences")

    @property
    def load_weights(self) -> _FanOut:
        return _FanOut(self, "load_weights")

    @property
    def abort_generation(self) -> _FanOut:
        """Partial rollout: every TP rank is asked (its own control thread; the ranks then agree on
        the decode step through the engine's TP group, rollout/vllm_rollout.py)."""
        return _FanOut(self, "abort_generation")

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
                    self._check(rank, method, ref, inflight)
            with self._lock:
                self._inflight = [x for x in self._inflight if x[2].hex() not in done]

    def _check(self, rank: int, method: str, ref: ray.ObjectRef, inflight: list) -> None:
        try:
            ray.get(ref, timeout=0)
        except RayActorError as err:
            self._end(rank, method, "died", err)
        except RayError as err:
            self._end(*self._blame(rank, method, err, inflight))

    def _blame(self, rank: int, method: str, err: BaseException, inflight: list) -> tuple:
        """A rank raised: when a peer died, the raise is most likely its consequence (a collective
        with a dead peer fails with gloo's error before Ray has declared the peer dead), so the
        peers' calls in flight get up to _GRACE_S to fail as dead actors; the first dead one is
        blamed, else the rank that raised."""
        peers = [(r, m, x) for r, m, x in inflight if r != rank]
        if peers:
            ray.wait([x for _, _, x in peers], num_returns=len(peers), timeout=_GRACE_S)
        for r, m, x in peers:
            try:
                ray.get(x, timeout=0)
            except RayActorError as peer_err:
                return r, m, "died", peer_err
            except RayError:
                continue
        return rank, method, "raised", err

    def _end(self, rank: int, method: str, what: str, err: BaseException) -> None:
        """A rank failed: end every rank of the engine, so none is left blocked in a collective."""
        if self.failure is not None:
            return
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.failed_rank, self.rank_died = rank, what == "died"
        self.failure = (
            f"rollout engine {self.index}: TP rank {rank} (rollout worker {self.first_worker + rank}) {what} in "
            f"{method} ({first})"
        )
        self.error_text = str(err)
        print(f"[hybridrl.async] {self.failure}; ending the engine's {len(self.actors)} TP ranks")
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except (RayError, ValueError):
                pass
        self._failed.set()
        self._stop.set()

    def wait_failure(self, timeout_s: float) -> bool:
        """Block until the watcher has ended the engine (True) or `timeout_s` passed (False)."""
        return self._failed.wait(timeout_s)

    def close(self) -> None:
        """Stop the watcher thread."""
        self._stop.set()
        self._watcher.join(timeout=4 * _WATCH_S)


def worker_label(handle: Any, rank: int) -> str:
    """How the manager's messages name worker `rank`: "rollout worker r", or the engine's label."""
    return handle.label if isinstance(handle, EngineHandle) else f"rollout worker {rank}"


def call_failure(handle: Any, err: BaseException, settle_s: float = _SETTLE_S) -> tuple[bool, str]:
    """What a failed call on a manager worker handle means: (dead, message).

    A plain actor: dead when the error is a RayActorError. An engine: its first failing TP rank
    decides (dead if that rank's process died, not dead if it raised: then the message carries its
    remote traceback); the call's own error may come before the watcher has decided (rank 0 blocked
    in a collective with a dead peer fails with gloo's error, or is killed by the watcher), so this
    waits up to `settle_s` for the watcher.
    """
    if isinstance(handle, EngineHandle) and handle.wait_failure(settle_s):
        if handle.rank_died:
            return True, str(handle.failure)
        return False, f"{handle.failure}:\n{handle.error_text}"
    lost = node_lost_error(
        err, "rollout", -1, "generate_sequences", advice=False
    )  # its whole node left the cluster
    return isinstance(err, RayActorError), str(lost or err)
