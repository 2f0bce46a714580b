"""The fan-out through one dispatcher actor per node (ray/fanout.py) gives what the direct call
gives: the same results, in rank order, for every dispatch mode and for a batch held by
reference, and the same errors naming group, rank and method (a raise, a hang, a death)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from sc_toy_workers import TOY_CPUS, ToyWorker, stage_advantage, stage_log_prob

from hybridrl.protocol import DataProto
from hybridrl.single_controller.batch_ref import BatchRef, NodeShard
from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerGroupError, WorkerHungError
from hybridrl.utils import deadlines


@pytest.fixture
def fanned3(group3):
    """The shared direct 3-rank group, fanning out for one test."""
    assert not group3.fanout  # 3 ranks: below the default's threshold
    group3.fanout = True
    yield group3
    group3.fanout = False


def _proto(n: int) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n * 2).reshape(n, 2)}, non_tensors={"tag": np.array([f"t{i}" for i in range(n)])}
    )


def _rows() -> DataProto:
    return DataProto.from_dict({"x": torch.arange(21.0).reshape(7, 3), "m": torch.ones(7, 3)})


def _calls(wg) -> list:
    """One call of every dispatch mode (and execute_all / execute_rank_zero), results as values."""
    by_ref = BatchRef.from_proto(_rows())
    by_ref = by_ref.union(wg.apply(stage_log_prob, by_ref))  # handles come back, not tensors
    by_ref.reorder(torch.tensor([6, 0, 5, 1, 4, 2, 3]))
    by_ref = by_ref.union(wg.apply(stage_advantage, by_ref))  # the ranks read the shards made above
    marked = wg.mark(_proto(7))  # DP_COMPUTE_PROTO, padded
    return [
        wg.add(1, y=2),  # ONE_TO_ALL
        wg.scale([1, 2, 3], [4, 5, 6]),  # ALL_TO_ALL
        wg.sum_list([[1, 2], [3], []]),  # DP_COMPUTE
        wg.metric(_proto(6)),  # DP_COMPUTE_METRIC
        wg.proto_sum(_proto(4), torch.tensor([1, 10])),  # ONE_TO_ALL, a DataProto and a tensor shared
        wg.total(list(range(10))),  # a custom mode
        wg.rank_of(),  # a custom mode that calls one rank
        wg.whoami("z"),  # RANK_ZERO
        wg.execute_all("plain_method", 2),
        wg.execute_rank_zero("plain_method", 3),
        {k: v.tolist() for k, v in marked.batch.items()},
        marked.non_tensor_batch["tag"].tolist(),
        marked.meta_info,
        {k: v.tolist() for k, v in by_ref.pull().batch.items()},
        by_ref.non_tensor_batch["score"].tolist(),
        by_ref.meta_info,
    ]


def test_fanned_out_calls_equal_direct_calls(group3):
    direct = _calls(group3)
    group3.fanout = True
    try:
        fanned = _calls(group3)
        assert group3._fan.dispatchers  # the calls went through a dispatcher
        by_node = group3.apply(stage_log_prob, BatchRef.from_proto(_rows()))
        assert all(isinstance(r, NodeShard) for p in by_node.parts for r in p.refs)  # one ref per node
        with pytest.raises(AttributeError, match="no method 'missing'"):
            group3.execute_all("missing")
    finally:
        group3.fanout = False
    assert fanned == direct
    assert direct[8] == [200, 201, 202] and direct[0] == [(0, 8), (1, 8), (2, 8)]


def test_a_raise_names_group_rank_and_method(fanned3):
    with pytest.raises(WorkerGroupError) as err:
        fanned3.fail_on(1)
    assert (err.value.group, err.value.rank, err.value.method) == ("toy3", 1, "fail_on")
    assert "in fail_on" in str(err.value) and "ValueError: boom on rank 1" in str(err.value)
    assert not isinstance(err.value, WorkerDiedError)
    assert fanned3.add(0) == [(r, 5) for r in range(3)]  # still usable


def test_a_hang_names_the_first_unfinished_rank(fanned3):
    before = deadlines.step_timeout()
    deadlines.set_step_timeout(1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerHungError) as err:
            fanned3.nap_or_die(-1, 2.0)  # every rank naps past the limit
        assert 1.0 <= time.monotonic() - t0 < 2.0
    finally:
        deadlines.set_step_timeout(before)
    assert (err.value.group, err.value.rank, err.value.method) == ("toy3", 0, "nap_or_die")
    assert "trainer.step_timeout_s=1" in str(err.value)
    assert fanned3.add(0) == [(r, 5) for r in range(3)]  # the naps end; the group is usable


def test_a_death_names_the_rank(ray_session):
    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=False, cpus_per_slot=TOY_CPUS, name_prefix="fan2")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ToyWorker), name_prefix="fan2", fanout=True)
    try:
        with pytest.raises(WorkerDiedError) as err:
            wg.nap_or_die(1, 0.0)
        assert (err.value.group, err.value.rank, err.value.method) == ("fan2", 1, "nap_or_die")
    finally:
        wg.shutdown()
        pool.remove()


def test_by_default_only_calls_that_send_no_tensors_fan_out(group3, monkeypatch):
    """The default (fanout=None): a call that sends the batch through the driver would get its
    results through the dispatcher too, so it goes direct; a BatchRef or control call fans out."""
    from hybridrl.single_controller.ray import base

    fanned = []
    monkeypatch.setattr(base, "FANOUT_MIN_RANKS", 3)
    monkeypatch.setattr(base, "_put_values", lambda a, k: (fanned.append(1), (a, k))[1])
    group3.fanout = None
    try:
        assert group3.fanout
        group3.mark(_proto(7))
        assert fanned == []  # a DataProto: direct
        assert isinstance(
            group3.apply(stage_log_prob, BatchRef.from_proto(_rows())).parts[0].refs[0], NodeShard
        )
        group3.add(1)
        assert len(fanned) == 2
    finally:
        group3.fanout = False
