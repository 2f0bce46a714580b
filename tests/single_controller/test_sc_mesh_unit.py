"""MeshLayout and the mesh dispatch/collect functions, without Ray (expected values by hand)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.single_controller import MeshCoord, MeshDispatchInfo, MeshLayout
from hybridrl.single_controller.dispatch import collect_mesh_proto, dispatch_mesh_proto


def test_coords_are_row_major_last_dim_fastest():
    m = MeshLayout.create(8, {"pp": 2, "dp": 2, "tp": 2})
    assert m.coords(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert m.coords(1) == {"pp": 0, "dp": 0, "tp": 1}
    assert m.coords(2) == {"pp": 0, "dp": 1, "tp": 0}
    assert m.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert [m.rank_of(m.coords(r)) for r in range(8)] == list(range(8))
    assert [m.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert m.dp_size == 2 and m.size("tp") == 2 and m.size("cp") == 1


def test_groups_partition_the_ranks():
    m = MeshLayout.create(8, {"pp": 2, "dp": 2, "tp": 2})
    assert m.groups(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups(["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups(["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups(["pp", "tp"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert m.group_of(6, ["tp"]) == [6, 7]


def test_collector_is_first_by_default_or_the_configured_coordinate():
    first = MeshLayout.create(4, {"dp": 2, "tp": 2})
    assert [first.is_collector(r) for r in range(4)] == [True, False, True, False]
    last_pp = MeshLayout.create(8, {"pp": 2, "dp": 2, "tp": 2}, collect={"pp": -1})
    assert [r for r in range(8) if last_pp.is_collector(r)] == [4, 6]
    assert last_pp.coord(6) == MeshCoord(6, {"pp": 1, "dp": 1, "tp": 0}, 1, 2, True)


def test_two_dp_dims_and_an_inferred_size():
    m = MeshLayout.create(8, {"replicate": 2, "shard": -1, "tp": 2}, dp_dims=("replicate", "shard"))
    assert m.sizes == {"replicate": 2, "shard": 2, "tp": 2}
    assert [m.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert m.dp_size == 4 and str(m) == "replicate=2 x shard=2 x tp=2"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 4, "dims": {"dp": 3, "tp": 2}}, r"multiply to 6, but the world has 4"),
        ({"world_size": 6, "dims": {"dp": -1, "tp": 4}}, r"world size 6 is not divisible by 4"),
        ({"world_size": 4, "dims": {"dp": -1, "tp": -1}}, r"at most one -1"),
        ({"world_size": 4, "dims": {"dp": 2, "tp": 2}, "dp_dims": ("x",)}, r"\['x'\] are not in the mesh"),
        ({"world_size": 4, "dims": {"dp": 2, "tp": 2}, "collect": {"tp": 2}}, r"outside 0..1"),
        ({"world_size": 4, "dims": {"dp": 2, "tp": 2}, "collect": {"dp": 0}}, r"data-parallel dim"),
    ],
)
def test_bad_layouts_name_the_numbers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeshLayout.create(**kwargs)


def test_dispatch_gives_tp_ranks_the_same_chunk_and_collects_owners_in_order():
    m = MeshLayout.create(4, {"dp": 2, "tp": 2})
    info = MeshDispatchInfo.from_coords("rollout", [m.coord(r) for r in range(4)])
    assert info.dp_rank_of == (0, 0, 1, 1) and info.collector_of == (0, 2)
    data = DataProto.from_dict({"x": torch.arange(5)})
    plan = dispatch_mesh_proto(info, data, 7)
    chunks = [a[0].batch["x"].tolist() for a in plan.rank_args]
    assert chunks == [[0, 1, 2], [0, 1, 2], [3, 4, 0], [3, 4, 0]]  # padded to 6 (pad rows from the start)
    assert [a[1] for a in plan.rank_args] == [7] * 4
    assert plan.rank_args[0][0] is plan.rank_args[1][0]  # one object: shared once in the object store
    outputs = [a[0] if r in (0, 2) else None for r, a in enumerate(plan.rank_args)]
    assert collect_mesh_proto(outputs, plan.context).batch["x"].tolist() == [0, 1, 2, 3, 4]


def test_dispatch_info_rejects_inconsistent_coords():
    m = MeshLayout.create(4, {"dp": 2, "tp": 2})
    coords = [m.coord(r) for r in range(4)]
    coords[1] = MeshCoord(1, coords[1].coords, 0, 2, True)  # two collectors in dp group 0
    with pytest.raises(
        ValueError, match=r"exactly one collecting rank; dp group -> collectors: \{0: \[0, 1\]\}"
    ):
        MeshDispatchInfo.from_coords("rollout", coords)
