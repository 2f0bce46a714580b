"""Dispatch functions, @register and Worker without any Ray actor (fast unit tests)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto, DataProtoFuture
from hybridrl.single_controller import (
    Dispatch,
    DispatchPlan,
    Execute,
    Worker,
    get_dispatch_mode,
    get_register_spec,
    register,
    register_dispatch_mode,
)
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool


def _proto(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)}, non_tensors={"s": [f"r{i}" for i in range(n)]})


def test_one_to_all_and_rank_zero_plans():
    plan = Dispatch.ONE_TO_ALL.dispatch_fn(3, 1, y=2)
    assert plan.rank_args == [(1,)] * 3 and plan.rank_kwargs == [{"y": 2}] * 3 and plan.ranks is None
    assert Dispatch.ONE_TO_ALL.collect_fn(["a", "b", "c"], plan.context) == ["a", "b", "c"]
    plan = Dispatch.RANK_ZERO.dispatch_fn(3, "t")
    assert plan.ranks == [0] and plan.rank_args == [("t",)]
    assert Dispatch.RANK_ZERO.collect_fn(["only"], plan.context) == "only"


@pytest.mark.parametrize("mode", ["ALL_TO_ALL", "DP_COMPUTE"])
def test_elementwise_plans_and_bad_lengths(mode):
    m = get_dispatch_mode(mode)
    plan = m.dispatch_fn(2, [1, 2], k=["a", "b"])
    assert plan.rank_args == [(1,), (2,)] and plan.rank_kwargs == [{"k": "a"}, {"k": "b"}]
    with pytest.raises(ValueError, match=r"length 2\), got a list of length 3"):
        m.dispatch_fn(2, [1, 2, 3])
    with pytest.raises(ValueError, match="ONE_TO_ALL"):
        m.dispatch_fn(2, 5)


def test_dp_compute_proto_pads_7_rows_on_3_ranks():
    plan = Dispatch.DP_COMPUTE_PROTO.dispatch_fn(3, _proto(7), "cfg")
    assert plan.context == 2  # 7 -> 9 rows: the pad repeats rows 0 and 1
    chunks = [a[0] for a in plan.rank_args]
    assert [c.batch["x"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 0, 1]]
    assert [c.non_tensor_batch["s"].tolist() for c in chunks][2] == ["r6", "r0", "r1"]
    assert [a[1] for a in plan.rank_args] == ["cfg"] * 3  # non-DataProto args are broadcast
    out = Dispatch.DP_COMPUTE_PROTO.collect_fn(chunks, plan.context)
    assert out.batch["x"].tolist() == list(range(7))
    assert out.non_tensor_batch["s"].tolist() == [f"r{i}" for i in range(7)]


def test_dp_compute_proto_rejects_mismatched_lengths_and_non_proto_outputs():
    with pytest.raises(ValueError, match="different lengths"):
        Dispatch.DP_COMPUTE_PROTO.dispatch_fn(2, _proto(4), other=_proto(6))
    with pytest.raises(TypeError, match="must return a DataProto"):
        Dispatch.DP_COMPUTE_PROTO.collect_fn([_proto(2), {"not": "proto"}], 0)


def test_dp_compute_metric_never_pads():
    plan = Dispatch.DP_COMPUTE_METRIC.dispatch_fn(2, _proto(6))
    assert [a[0].batch["x"].tolist() for a in plan.rank_args] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="not divisible by world_size=2"):
        Dispatch.DP_COMPUTE_METRIC.dispatch_fn(2, _proto(7))


def test_dp_compute_proto_with_func_sends_function_first():
    def f(data, rank):
        return data

    plan = Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.dispatch_fn(2, f, _proto(3))
    assert plan.context == 1 and all(a[0] is f for a in plan.rank_args)
    assert [a[1].batch["x"].tolist() for a in plan.rank_args] == [[0, 1], [2, 0]]
    with pytest.raises(TypeError, match="first argument must be a function"):
        Dispatch.DP_COMPUTE_PROTO_WITH_FUNC.dispatch_fn(2, _proto(2))


def test_data_proto_future_is_chunked_not_materialised():
    def explode(outputs):
        raise AssertionError("the driver must not materialise the future")

    fut = DataProtoFuture(collect_fn=explode, futures=[])
    plan = Dispatch.DP_COMPUTE_PROTO.dispatch_fn(2, fut)
    pieces = [a[0] for a in plan.rank_args]
    assert all(isinstance(p, DataProtoFuture) and p.dispatch_fn is not None for p in pieces)
    assert [p.dispatch_fn.keywords for p in pieces] == [{"index": 0, "chunks": 2}, {"index": 1, "chunks": 2}]
    assert plan.context == 0


def test_register_dispatch_mode_errors():
    with pytest.raises(ValueError, match="already exists"):
        register_dispatch_mode("ONE_TO_ALL", lambda ws: None, lambda o, c: o)
    with pytest.raises(ValueError, match="public identifier"):
        register_dispatch_mode("not a name", lambda ws: None, lambda o, c: o)
    with pytest.raises(ValueError, match="unknown dispatch mode 'NOPE'.*register_dispatch_mode"):
        register(dispatch_mode="NOPE")
    with pytest.raises(TypeError, match="Dispatch is a namespace"):
        Dispatch()
    with pytest.raises(ValueError, match="one entry per called rank"):
        DispatchPlan([(1,), (2,)], [{}])


def test_custom_mode_becomes_a_dispatch_attribute():
    name = "UNIT_TEST_EVEN_RANKS"
    if name not in Dispatch.names():
        register_dispatch_mode(
            name,
            lambda ws, x: DispatchPlan(
                [(x,)] * len(range(0, ws, 2)), [{}] * len(range(0, ws, 2)), list(range(0, ws, 2))
            ),
            lambda outs, ctx: sum(outs),
        )
    mode = getattr(Dispatch, name)
    assert get_dispatch_mode(name) is mode and repr(mode) == f"Dispatch.{name}"
    assert mode.dispatch_fn(5, "x").ranks == [0, 2, 4]


class _Local(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.ALL, blocking=False)
    def compute(self, data: DataProto, scale: float = 1.0) -> DataProto:
        """Doc of compute."""
        return data

    @register(Dispatch.ONE_TO_ALL)
    def echo(self, value):
        return value

    @register(Dispatch.ONE_TO_ALL, materialize_futures=False)
    def raw(self, value):
        return value


class _ResolvedFuture(DataProtoFuture):
    def get(self):
        return "resolved"


def test_register_keeps_method_and_records_spec():
    spec = get_register_spec(_Local.compute)
    assert spec.dispatch_mode is Dispatch.DP_COMPUTE_PROTO and spec.blocking is False
    assert spec.execute_mode is Execute.ALL and spec.materialize_futures is True
    assert _Local.compute.__name__ == "compute" and _Local.compute.__doc__ == "Doc of compute."
    assert list(inspect.signature(_Local.compute).parameters) == ["self", "data", "scale"]
    w = _Local()
    fut = _ResolvedFuture(collect_fn=None, futures=[])
    assert w.echo(fut) == "resolved" and w.echo(value=fut) == "resolved"
    assert w.raw(fut) is fut
    with pytest.raises(TypeError, match="Execute member"):
        register(Dispatch.ONE_TO_ALL, execute_mode="all")


def test_worker_reads_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    w = _Local()
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (0, 1, 0, 1)
    assert w.master_addr is None and w.master_port is None and w.device == torch.device("cpu")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert (w.rank, w.world_size, w.master_port) == (3, 4, 1234)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        _ = w.rank


def test_bad_classes_and_pools_fail_early():
    with pytest.raises(TypeError, match="not a subclass of .*Worker"):
        RayClassWithInitArgs(dict)
    with pytest.raises(ValueError, match="positive slot counts"):
        RayResourcePool([2, 0], use_gpu=False)
    with pytest.raises(ValueError, match="cpus_per_slot"):
        RayResourcePool([2], use_gpu=False, cpus_per_slot=0)
    pool = RayResourcePool([2, 3], use_gpu=True, cpus_per_slot=4, max_colocate_count=2)
    assert pool.world_size == 5 and pool.num_threads == 4
    assert pool.actor_resources() == {"num_cpus": 2.0, "num_gpus": 0.5}
    assert RayResourcePool([1], use_gpu=False, cpus_per_slot=0.25).num_threads == 1


def test_numpy_is_kept_as_object_rows():
    # non-tensor rows survive the split/collect round trip unchanged
    data = _proto(5)
    plan = Dispatch.DP_COMPUTE_PROTO.dispatch_fn(2, data)
    out = Dispatch.DP_COMPUTE_PROTO.collect_fn([a[0] for a in plan.rank_args], plan.context)
    assert isinstance(out.non_tensor_batch["s"], np.ndarray) and out.non_tensor_batch["s"].dtype == object
    assert len(out) == 5
