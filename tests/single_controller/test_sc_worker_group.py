"""RayWorkerGroup on 2- and 3-rank groups of toy workers: every dispatch mode, futures, errors,
a gloo process group. The groups are shared by the session (conftest.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

from hybridrl.protocol import DataProto, DataProtoFuture
from hybridrl.single_controller import WorkerDiedError, WorkerGroupError
from hybridrl.single_controller.ray import WorkerGroupFuture


def _proto(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)}, non_tensors={"s": [f"r{i}" for i in range(n)]})


def test_ranks_see_their_env(group):
    ws = group.world_size
    infos = group.env()
    assert [i["rank"] for i in infos] == list(range(ws))
    assert [i["RANK"] for i in infos] == [str(r) for r in range(ws)]
    assert {i["WORLD_SIZE"] for i in infos} == {str(ws)} and {i["world_size"] for i in infos} == {ws}
    assert [i["local_rank"] for i in infos] == list(range(ws)) and {i["local_world_size"] for i in infos} == {
        ws
    }
    assert {(i["master_addr"], i["master_port"]) for i in infos} == {(group.master_addr, group.master_port)}
    assert group.master_port > 0 and len({i["pid"] for i in infos}) == ws
    assert {i["omp_num_threads"] for i in infos} == {"1"} and {i["device"] for i in infos} == {"cpu"}


def test_one_to_all(group):
    assert group.add(1, y=2) == [(r, 1 + 2 + 5) for r in range(group.world_size)]


def test_one_to_all_with_big_values(group):
    # the same DataProto and tensor go to every rank (stored once in the object store)
    weights = torch.tensor([1, 0, 2, 0, 0])
    assert group.proto_sum(_proto(5), weights=weights) == [
        (r, 5, 0 * 1 + 2 * 2) for r in range(group.world_size)
    ]


def test_all_to_all(group):
    ws = group.world_size
    xs, factors = [10 + r for r in range(ws)], [r + 1 for r in range(ws)]
    assert group.scale(xs, factor=factors) == [(r, (10 + r) * (r + 1)) for r in range(ws)]
    with pytest.raises(ValueError, match=f"one entry per rank \\(length {ws}\\)"):
        group.scale([1] * (ws + 1), factor=factors)


def test_rank_zero(group):
    assert group.whoami("t") == (0, "t")
    assert group.whoami_exec_rank_zero("u") == (0, "u")


def test_dp_compute(group):
    ws = group.world_size
    assert group.sum_list([[r, 1, 1] for r in range(ws)]) == [(r, r + 2) for r in range(ws)]


# rank that handles each of 7 rows: 7 rows padded to 8 (2 ranks: 4 + 4) or 9 (3 ranks: 3 + 3 + 3)
RANK_OF_ROW = {2: [0, 0, 0, 0, 1, 1, 1], 3: [0, 0, 0, 1, 1, 1, 2]}


def test_dp_compute_proto_pads_unpads_keeps_order(group):
    out = group.mark(_proto(7))
    assert len(out) == 7
    assert out.batch["x"].tolist() == [2 * i for i in range(7)]
    assert out.batch["rank"].tolist() == RANK_OF_ROW[group.world_size]
    assert out.non_tensor_batch["s"].tolist() == [f"r{i}" for i in range(7)]
    assert out.meta_info["rows_seen"] == {2: 4, 3: 3}[group.world_size]


def test_dp_compute_proto_with_func(group):
    out = group.apply(lambda d, rank: DataProto.from_dict({"y": d.batch["x"] + 100 * rank}), _proto(7))
    assert out.batch["y"].tolist() == [i + 100 * r for i, r in enumerate(RANK_OF_ROW[group.world_size])]


def test_dp_compute_metric(group):
    ws = group.world_size
    rows = 6 // ws
    expected = [{"rank": r, "rows": rows, "x_sum": sum(range(r * rows, (r + 1) * rows))} for r in range(ws)]
    assert group.metric(_proto(6)) == expected
    with pytest.raises(ValueError, match="not divisible"):
        group.metric(_proto(7))


def test_non_blocking_calls_return_futures(group):
    fut = group.mark_async(_proto(7))
    assert isinstance(fut, DataProtoFuture)
    assert fut.get().batch["x"].tolist() == [2 * i for i in range(7)]
    plain = group.add_async(1)
    assert isinstance(plain, WorkerGroupFuture)
    assert plain.get() == [(r, 6) for r in range(group.world_size)]


def test_future_feeds_next_call_without_driver_materialisation(group):
    n = 2 * group.world_size
    fut = group.mark_async(_proto(n))
    kinds = group.arg_kind(fut)  # materialize_futures=False: the worker sees what the driver sent
    # the group's own future class (its waits have a deadline and name the group), chunked per rank
    assert kinds.non_tensor_batch["arg_kind"].tolist() == ["WorkerGroupDataProtoFuture"] * n
    assert kinds.batch["x"].tolist() == [2 * i for i in range(n)]
    assert group.mark(group.mark_async(_proto(n))).batch["x"].tolist() == [4 * i for i in range(n)]


def test_custom_dispatch_modes(group):
    ws = group.world_size
    out = group.total(list(range(1, 11)))
    assert out["total"] == 55
    expected = {2: [[1, 3, 5, 7, 9], [2, 4, 6, 8, 10]], 3: [[1, 4, 7, 10], [2, 5, 8], [3, 6, 9]]}[ws]
    assert [items for items, _ in out["per_rank"]] == expected
    assert group.rank_of() == ("last", ws - 1)


def test_bound_methods_are_discoverable(group2):
    assert str(inspect.signature(group2.add)) == "(x: 'int', y: 'int' = 0) -> 'tuple[int, int]'"
    assert group2.add.__doc__ == "Return (rank, x + y + offset)." and group2.add.__name__ == "add"
    assert {"add", "mark", "metric", "total", "env"} <= set(group2.method_names) <= set(dir(group2))
    assert len(group2.workers) == 2 and group2.world_size == 2


def test_execute_all_and_rank_zero(group):
    assert group.execute_all("plain_method", 2) == [200 + r for r in range(group.world_size)]
    assert group.execute_rank_zero("plain_method", 3) == 300
    with pytest.raises(AttributeError, match="no method 'missing'"):
        group.execute_all("missing")


def test_worker_exception_names_group_rank_method_and_traceback(group3):
    with pytest.raises(WorkerGroupError) as err:
        group3.fail_on(1)
    msg = str(err.value)
    assert "'toy3'" in msg and "rank 1" in msg and "'fail_on'" in msg
    # the remote traceback: the raising line of the worker and the exception
    assert 'sc_toy_workers.py", line' in msg and "in fail_on" in msg and "ValueError: boom on rank 1" in msg
    assert "\x1b[" not in msg  # no terminal colour codes
    assert not isinstance(err.value, WorkerDiedError)
    assert (err.value.rank, err.value.method, err.value.group) == (1, "fail_on", "toy3")
    assert group3.add(0) == [(r, 5) for r in range(3)]  # the group is still usable


def test_gloo_process_group_across_actors(group2):
    assert group2.init_pg() == [(0, 2), (1, 2)]
    # all_reduce(sum) of [rank + 1, 10 * rank] over ranks 0 and 1
    assert group2.all_reduce_rank() == [[3.0, 10.0], [3.0, 10.0]]


def test_every_rank_starts_from_the_same_torch_seed(group):
    """A Ray worker process arrives with a random torch seed; the Worker base class reseeds, so a
    fresh initialisation (a critic's value head) is the same on every rank and in every launch."""
    import torch

    from hybridrl.single_controller.base import FRESH_PROCESS_SEED

    expected = torch.rand(4, generator=torch.Generator().manual_seed(FRESH_PROCESS_SEED)).tolist()
    assert group.init_draw() == [expected] * group.world_size
