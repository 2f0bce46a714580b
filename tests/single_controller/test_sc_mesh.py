"""Mesh-aware dispatch on real Ray actors: a pp x dp x tp mesh of 8 toy workers and colocated
roles with their own meshes. Checks that every rank of a tp/pp group sees the same rows, every
input row comes back exactly once and in order, uneven batches are padded and unpadded, the
collecting rank is the configured one, and futures feed the next stage."""

from __future__ import annotations

import pytest
import torch

from hybridrl.protocol import DataProto, DataProtoFuture
from hybridrl.single_controller import MeshLayout

MESH_CPUS = 0.1  # 10 toy actors fit beside the session's other toy groups


def _proto(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)}, non_tensors={"s": [f"r{i}" for i in range(n)]})


def _group(name: str, world: int, cls_with_init):
    from hybridrl.single_controller.ray import RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([world], use_gpu=False, cpus_per_slot=MESH_CPUS, name_prefix=name)
    return RayWorkerGroup(pool, cls_with_init, name_prefix=name), pool


@pytest.fixture(scope="module")
def pp_dp_tp(ray_session):
    """8 ranks: pp=2 (outer) x dp=2 x tp=2 (inner); the last pp stage, tp rank 0 collects."""
    from sc_toy_workers import ToyMeshWorker

    from hybridrl.single_controller.ray import RayClassWithInitArgs

    init = RayClassWithInitArgs(ToyMeshWorker, dims={"pp": 2, "dp": 2, "tp": 2}, collect={"pp": -1})
    wg, pool = _group("mesh8", 8, init)
    yield wg
    wg.shutdown()
    pool.remove()


def _groups_by_dp(wg, mesh: str) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in wg.mesh_coords(mesh):
        out.setdefault(c.dp_rank, []).append(c.rank)
    return out


def test_controller_knows_every_rank_coordinates(pp_dp_tp):
    layout = MeshLayout.create(8, {"pp": 2, "dp": 2, "tp": 2}, collect={"pp": -1})
    coords = pp_dp_tp.mesh_coords("rows")
    assert [c.coords for c in coords] == [layout.coords(r) for r in range(8)]
    assert _groups_by_dp(pp_dp_tp, "rows") == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}
    info = pp_dp_tp.mesh_info("rows")
    assert info.collector_of == (4, 6)  # pp=1 (last stage), tp=0 of dp groups 0 and 1
    assert pp_dp_tp.dp_size("rows") == 2 and pp_dp_tp.dp_size("train") == 8


@pytest.mark.parametrize("n", [8, 7, 5])
def test_tp_pp_ranks_see_identical_rows_and_rows_come_back_once_in_order(pp_dp_tp, n):
    pp_dp_tp.pop_seen()
    out = pp_dp_tp.rows(_proto(n))
    # every input row exactly once, in order; non-tensor data kept; padding removed
    assert out.batch["x"].tolist() == list(range(n))
    assert out.non_tensor_batch["s"].tolist() == [f"r{i}" for i in range(n)]
    half = (n + 1) // 2  # padded to a multiple of dp=2, split in two
    assert out.batch["y"].tolist() == [i + 1000 * (i >= half) for i in range(n)]
    assert out.batch["rank"].tolist() == [4 if i < half else 6 for i in range(n)]
    seen = pp_dp_tp.pop_seen()
    for dp_rank, ranks in _groups_by_dp(pp_dp_tp, "rows").items():
        rows = [seen[r] for r in ranks]
        assert all(r == rows[0] for r in rows), (
            f"dp group {dp_rank} (ranks {ranks}) saw different rows: {rows}"
        )
        assert len(rows[0]) == 1 and len(rows[0][0]) == half  # one call, one padded chunk
        real = list(range(dp_rank * half, min(n, (dp_rank + 1) * half)))
        assert rows[0][0][: len(real)] == real


def test_second_mesh_of_same_workers_splits_over_all_ranks(pp_dp_tp):
    pp_dp_tp.pop_seen()
    out = pp_dp_tp.train_rows(_proto(11))  # 11 rows over dp=8: padded to 16
    assert out.batch["x"].tolist() == [10 * i for i in range(11)]
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [len(s[0]) for s in pp_dp_tp.pop_seen()] == [2] * 8


def test_mesh_futures_feed_the_next_stage(pp_dp_tp):
    fut = pp_dp_tp.rows_async(_proto(8))
    assert isinstance(fut, DataProtoFuture)
    out = pp_dp_tp.train_rows(fut)  # chunked lazily over the other mesh's 8 dp ranks
    assert out.batch["x"].tolist() == [10 * i for i in range(8)]
    again = pp_dp_tp.rows(pp_dp_tp.rows_async(_proto(6)))
    assert again.batch["x"].tolist() == list(range(6))


def test_undeclared_mesh_is_a_clear_error(pp_dp_tp):
    with pytest.raises(
        RuntimeError, match=r"ranks \[0, 1, 2, 3, 4, 5, 6, 7\] have not declared mesh 'never_declared'"
    ):
        pp_dp_tp.undeclared(_proto(4))


def test_colocated_roles_dispatch_over_their_own_meshes(ray_session):
    from sc_toy_workers import ToyMeshWorker

    from hybridrl.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls

    cls = create_colocated_worker_cls(
        {
            "actor": RayClassWithInitArgs(ToyMeshWorker, dims={"dp": 1, "tp": 2}),
            "critic": RayClassWithInitArgs(ToyMeshWorker, dims={"dp": 2, "tp": 1}),
        }
    )
    wg, pool = _group("mesh2", 2, cls)
    try:
        roles = wg.spawn(["actor", "critic"])
        assert roles["actor"].mesh_info("rows").collector_of == (0,)
        assert roles["critic"].mesh_info("rows").collector_of == (0, 1)
        assert roles["actor"].rows(_proto(3)).batch["rank"].tolist() == [0, 0, 0]  # tp only: rank 0 answers
        assert roles["critic"].rows(_proto(3)).batch["rank"].tolist() == [0, 0, 1]
        assert roles["actor"].pop_seen() == [[[0, 1, 2]], [[0, 1, 2]]]  # both tp ranks saw every row
        assert roles["critic"].pop_seen() == [[[0, 1]], [[2, 0]]]  # 3 rows padded to 4
    finally:
        wg.shutdown()
        pool.remove()


def test_batch_ref_over_two_meshes_equals_the_driver_path(pp_dp_tp):
    """rows (dp=2, collected from the last pp stage) then train_rows (dp=8): by reference the
    second mesh assembles its rows from the first mesh's collectors' shards; same result."""
    from hybridrl.single_controller.batch_ref import BatchRef

    def flow(batch):
        first = pp_dp_tp.rows(batch)
        first.pop(["x"])  # the input's column: DataProto.union would compare it, BatchRef refuses it
        batch = batch.union(first)
        batch.reorder(torch.tensor([6, 5, 4, 3, 2, 1, 0]))
        return pp_dp_tp.train_rows(batch)

    want = flow(_proto(7))
    got = flow(BatchRef.from_proto(_proto(7)))
    assert isinstance(got, BatchRef)
    pulled = got.pull()
    for k in want.batch.keys():
        assert torch.equal(pulled.batch[k], want.batch[k]), k
    pp_dp_tp.pop_seen()
