"""EngineHandle (hybridrl/async_rollout/tp_engine.py) with real Ray actors standing for the TP ranks:
the fan-out contract, and what the watcher does when one rank dies or raises while its peer is
blocked (the peer sleeps, as a rank blocked in a collective with a dead peer does). The same paths
with real vLLM TP engines: tests/async/test_async_tp.py."""

from __future__ import annotations

import os
import time

import pytest

from hybridrl.async_rollout.tp_engine import EngineHandle, call_failure, engine_handles, worker_label

pytestmark = pytest.mark.usefixtures("ray_local")


def _rank_cls():
    import ray

    @ray.remote(num_cpus=0)
    class Rank:
        """One TP rank: records its calls; `how` maps a rank to "die", "raise" or "block"."""

        def __init__(self, rank: int) -> None:
            self.rank, self.calls = rank, []

        def _act(self, how: dict) -> None:
            what = how.get(self.rank)
            if what == "die":
                os._exit(1)
            if what == "raise":
                raise ValueError(f"bad payload on rank {self.rank}")
            if what == "block":
                time.sleep(60)

        def generate_sequences(self, x, how=None):
            self._act(how or {})
            self.calls.append(("generate_sequences", x))
            return {"rank": self.rank, "x": x}

        def load_weights(self, payload, version, how=None):
            self._act(how or {})
            self.calls.append(("load_weights", version))
            return float(version)

        def seen(self):
            return self.calls

    return Rank


def _engine(n: int = 2, first_worker: int = 0) -> EngineHandle:
    cls = _rank_cls()
    return EngineHandle(0, [cls.remote(r) for r in range(n)], first_worker)


def test_every_rank_gets_every_call_in_order_and_rank0_answers():
    import ray

    engine = _engine()
    try:
        assert ray.get(engine.load_weights.remote({"w": 1}, 3)) == 3.0
        out = ray.get(engine.generate_sequences.remote("prompts"))
        assert out == {"rank": 0, "x": "prompts"}
        calls = [("load_weights", 3), ("generate_sequences", "prompts")]
        assert [ray.get(a.seen.remote()) for a in engine.actors] == [calls, calls]
        assert engine.failure is None
        assert worker_label(engine, 0) == "rollout engine 0 (rollout workers 0..1)"
        assert worker_label(engine.actors[0], 4) == "rollout worker 4"
    finally:
        engine.close()


def test_engine_handles_group_consecutive_workers():
    cls = _rank_cls()
    actors = [cls.remote(r) for r in range(4)]
    assert engine_handles(actors, 1) == actors
    engines = engine_handles(actors, 2)
    try:
        assert [e.actors for e in engines] == [actors[:2], actors[2:]]
        assert [e.first_worker for e in engines] == [0, 2]
    finally:
        for e in engines:
            e.close()
    with pytest.raises(ValueError, match="3 rollout workers do not split into engines of 2"):
        engine_handles(actors[:3], 2)


def test_a_dead_rank_ends_the_engine_and_is_named():
    import ray
    from ray.exceptions import RayActorError

    engine = _engine(first_worker=2)
    try:
        t0 = time.monotonic()
        ref = engine.generate_sequences.remote("p", {0: "block", 1: "die"})
        with pytest.raises(RayActorError):
            ray.get(ref, timeout=30)  # rank 0 would sleep 60 s: the watcher killed it
        assert time.monotonic() - t0 < 30
        dead, why = call_failure(engine, RayActorError())
        assert dead
        assert why.startswith("rollout engine 0: TP rank 1 (rollout worker 3) died in generate_sequences")
        assert engine.failed_rank == 1 and engine.rank_died
    finally:
        engine.close()


def test_a_raising_rank_ends_the_engine_and_stops_the_run_with_its_error():
    import ray
    from ray.exceptions import RayActorError

    engine = _engine()
    try:
        ref = engine.load_weights.remote({}, 1, {0: "block", 1: "raise"})
        with pytest.raises(RayActorError):
            ray.get(ref, timeout=30)
        dead, why = call_failure(engine, RayActorError())
        assert not dead  # a bug, not a lost process: the manager raises it
        assert "TP rank 1 (rollout worker 1) raised in load_weights" in why
        assert "bad payload on rank 1" in why
    finally:
        engine.close()


def test_plain_workers_are_classified_by_their_error():
    from ray.exceptions import RayActorError, RayTaskError

    assert call_failure(object(), RayActorError())[0]
    assert not call_failure(object(), RayTaskError("f", "tb", ValueError("x")))[0]
