"""Staleness gate and consumer rule without Ray: hand-derived cases and an event simulation."""

from __future__ import annotations

import collections
import random

import pytest

from hybridrl.async_rollout.staleness import StalenessError, StalenessManager, select_batch, staleness_metrics


# ------------------------------------------------------------------------------ producer gate
def test_capacity_follows_the_staleness_formula():
    sm = StalenessManager(consumer_batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=100)
    assert sm.capacity(0) == 8  # (0 + 1 + 1) * 4 - 0
    sm.on_commit(8)
    assert sm.capacity(0) == 0
    assert sm.capacity(1) == 4  # (1 + 1 + 1) * 4 - 8
    sm.on_finish(8)
    sm.on_consume(4)
    assert sm.batch_index == 1
    assert sm.capacity(1) == 4  # consumption does not free slots; a new version does


def test_capacity_is_capped_by_concurrency():
    sm = StalenessManager(consumer_batch_size=4, max_head_offpolicyness=3, max_concurrent_rollouts=3)
    assert sm.capacity(0) == 3
    sm.on_commit(3)
    assert sm.capacity(0) == 0
    sm.on_finish(2)
    assert sm.capacity(0) == 2


def test_start_version_counts_earlier_batches_as_done():
    sm = StalenessManager(
        consumer_batch_size=4, max_head_offpolicyness=1, max_concurrent_rollouts=100, start_version=5
    )
    assert sm.batch_index == 5
    assert sm.capacity(5) == 8  # (5 + 1 + 1) * 4 - 5 * 4


def test_counters_reject_impossible_transitions():
    sm = StalenessManager(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    sm.on_commit(2)
    with pytest.raises(ValueError, match="only 2 groups are running"):
        sm.on_finish(3)
    with pytest.raises(ValueError, match="only 0 finished"):
        sm.on_consume(1)
    with pytest.raises(ValueError, match="max_head_offpolicyness"):
        StalenessManager(consumer_batch_size=2, max_head_offpolicyness=-1, max_concurrent_rollouts=8)


# ------------------------------------------------------------------------------ consumer rule
def test_select_takes_earliest_deadlines_in_arrival_order():
    finished = [("a", 3), ("b", 2), ("c", 3), ("d", 2)]
    assert select_batch(finished, [], batch_index=2, batch_size=2) == ["b", "d"]
    assert select_batch(finished, [], batch_index=2, batch_size=3) == ["b", "d", "a"]


def test_select_waits_for_fewer_than_batch_size():
    assert select_batch([("a", 0)], [0], batch_index=0, batch_size=2) is None


def test_select_waits_for_a_group_at_its_deadline():
    # eta = 0: batch 0 needs both version-0 groups, one is still generating.
    assert select_batch([("a", 0), ("x", 1)], [0], batch_index=0, batch_size=2) is None


def test_select_refuses_a_batch_that_would_leave_too_many_old_groups():
    # eta = 2, B = 1. s0, s1 (version 0, deadline 2) still generate; s3 (version 1, deadline 3)
    # is done. Taking s3 into batch 1 would leave two deadline-2 groups for the single slot of
    # batch 2, so the batch waits.
    assert select_batch([("s3", 3)], [2, 2], batch_index=1, batch_size=1) is None
    # once s0 is done it goes first; s1 still fits into batch 2.
    assert select_batch([("s3", 3), ("s0", 2)], [2], batch_index=1, batch_size=1) == ["s0"]


def test_select_raises_when_a_deadline_has_passed():
    with pytest.raises(StalenessError, match="deadline 1 < 2"):
        select_batch([("a", 2)], [1], batch_index=2, batch_size=1)


def test_staleness_metrics_histogram():
    m = staleness_metrics([0, 1, 1, 0], max_head_offpolicyness=2)
    assert m == {
        "async/staleness/mean": 0.5,
        "async/staleness/max": 1.0,
        "async/staleness/hist_0": 0.5,
        "async/staleness/hist_1": 0.5,
        "async/staleness/hist_2": 0.0,
    }
    assert staleness_metrics([], 1) == {}


# ------------------------------------------------------------------------------ simulation
def simulate(eta, batch_size, workers, chunk, max_concurrent, n_batches, seed, use_rule=True):
    """Event simulation of the manager: gate -> queue -> workers with random chunk durations ->
    consumer; the trainer publishes version k+1 when batch k's training ends. Returns the
    consumed batches as lists of (group id, behaviour version)."""
    rng = random.Random(seed)
    sm = StalenessManager(batch_size, eta, max_concurrent)
    version, now, next_gid = 0, 0.0, 0
    input_q: collections.deque[int] = collections.deque()
    deadline: dict[int, int] = {}
    gen_version: dict[int, int] = {}
    busy: list[tuple[float, list[int]] | None] = [None] * workers
    finished: list[tuple[int, int]] = []
    train_until: float | None = None
    batches: list[list[tuple[int, int]]] = []
    while len(batches) < n_batches:
        for _ in range(sm.capacity(version)):  # commit
            input_q.append(next_gid)
            deadline[next_gid] = version + eta
            sm.on_commit(1)
            next_gid += 1
        for w in range(workers):  # dispatch
            if busy[w] is None and input_q:
                groups = [input_q.popleft() for _ in range(min(chunk, len(input_q)))]
                for g in groups:
                    gen_version[g] = version
                    deadline[g] = version + eta
                # heavy-tailed chunk durations make completions arrive out of order
                busy[w] = (now + rng.choice([0.1, 0.2, 0.3, 2.5]), groups)
        if train_until is None:  # the trainer waits for a batch
            done = {g for g, _ in finished}
            unfinished = [d for g, d in deadline.items() if g not in done]
            if use_rule:
                keys = select_batch(finished, unfinished, version, batch_size)
            elif len(finished) >= batch_size:
                keys = [g for g, _ in sorted(finished, key=lambda x: x[1])[:batch_size]]
            else:
                keys = None
            if keys is not None:
                finished = [x for x in finished if x[0] not in keys]
                for g in keys:
                    del deadline[g]
                sm.on_consume(len(keys))
                batches.append([(g, gen_version[g]) for g in keys])
                train_until = now + rng.choice([0.2, 0.5, 1.0])
        events = [b[0] for b in busy if b is not None] + ([train_until] if train_until is not None else [])
        assert events, f"deadlock at batch {len(batches)} (eta={eta}, seed={seed})"
        now = min(events)
        for w in range(workers):
            if busy[w] is not None and busy[w][0] == now:
                finished += [(g, gen_version[g] + eta) for g in busy[w][1]]
                sm.on_finish(len(busy[w][1]))
                busy[w] = None
        if train_until == now:
            version += 1
            train_until = None
    return batches


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_simulated_staleness_never_exceeds_eta(eta):
    seen = set()
    max_seen = 0
    for seed in range(30):
        batches = simulate(
            eta, batch_size=4, workers=3, chunk=1 + seed % 3, max_concurrent=64, n_batches=12, seed=seed
        )
        for k, batch in enumerate(batches):
            assert len(batch) == 4
            for gid, v in batch:
                assert k - eta <= v <= k, (seed, k, gid, v)
                assert gid not in seen
                seen.add(gid)
                max_seen = max(max_seen, k - v)
        seen.clear()
    if eta > 0:
        assert max_seen >= 1  # the simulation really ran ahead


def test_simulated_eta0_is_synchronous():
    for seed in range(10):
        batches = simulate(0, batch_size=4, workers=3, chunk=2, max_concurrent=64, n_batches=6, seed=seed)
        for k, batch in enumerate(batches):
            assert sorted(g for g, _ in batch) == list(range(4 * k, 4 * k + 4))
            assert {v for _, v in batch} == {k}


def test_without_the_consumer_rule_the_bound_breaks():
    """The gate alone (AReaL's formula) lets stragglers exceed eta when groups finish out of order."""
    worst = 0
    for seed in range(30):
        batches = simulate(
            2, batch_size=1, workers=3, chunk=1, max_concurrent=64, n_batches=12, seed=seed, use_rule=False
        )
        worst = max(worst, max(k - v for k, b in enumerate(batches) for _, v in b))
    assert worst > 2
