"""Named device meshes: one small object knows the parallel dims of a worker group.

A :class:`MeshLayout` lists named dims, outermost first (``{"dp": 2, "tp": 2}``; Megatron:
``{"pp": 2, "dp": 2, "cp": 1, "tp": 2}``). A global rank is the row-major index of its
coordinates, so the last dim varies fastest (tp neighbours are adjacent ranks, as in torch's
``init_device_mesh`` and Megatron's default order). The layout also says

* which dims carry *different data* (``dp_dims``, default ``("dp",)``): the batch is split over
  them; ranks that differ only in the other dims (tp, pp, cp) see the same rows;
* which rank of each data-parallel group *owns the output* (``collect``): per non-dp dim the
  coordinate of the owner, 0 by default, -1 for the last (e.g. the last pipeline stage).

Workers declare a layout under a name (``Worker.set_mesh("rollout", layout)``); the driver
reads every rank's :class:`MeshCoord` and a ``make_mesh_dispatch("rollout")`` method splits its
DataProto over the ``dp`` groups and collects one result per group (``dispatch.py``).
Everything here is pure except :meth:`MeshLayout.build_device_mesh` and
:func:`new_subgroups`, which create torch.distributed groups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MeshCoord", "MeshLayout", "new_subgroups"]


@dataclass(frozen=True)
class MeshCoord:
    """Where one rank sits in one named mesh (what the driver needs to dispatch).

    Attributes:
        rank: global rank in the worker group.
        coords: dim name -> coordinate of this rank.
        dp_rank: index of this rank's data-parallel group, 0..dp_size-1.
        dp_size: number of data-parallel groups (the batch is split this many ways).
        is_collector: this rank's result is the one the driver keeps for its dp group.
    """

    rank: int
    coords: dict[str, int]
    dp_rank: int
    dp_size: int
    is_collector: bool


@dataclass(frozen=True)
class MeshLayout:
    """Named parallel dims of a world of ranks (see the module docstring).

    Build it with :meth:`create`, which validates; the fields are tuples so the layout is
    hashable and picklable.
    """

    dims: tuple[tuple[str, int], ...]
    dp_dims: tuple[str, ...]
    collect: tuple[tuple[str, int], ...]

    @classmethod
    def create(
        cls,
        world_size: int,
        dims: Mapping[str, int],
        dp_dims: Sequence[str] = ("dp",),
        collect: Mapping[str, int] | None = None,
    ) -> MeshLayout:
        """Validate and build a layout.

        Args:
            world_size: number of ranks the mesh covers.
            dims: name -> size, outermost first; one size may be -1 (inferred from world_size).
            dp_dims: dims the batch is split over (each must be in ``dims``).
            collect: non-dp dim -> coordinate of the owning rank (0 default, -1 = last).

        Raises:
            ValueError: naming the sizes and the fix when they do not multiply to world_size,
                a name is unknown or repeated, or a collect coordinate is out of range.
        """
        if world_size < 1:
            raise ValueError(f"MeshLayout: world_size must be >= 1, got {world_size}")
        names = list(dims)
        if not names or any(not isinstance(n, str) or not n.isidentifier() for n in names):
            raise ValueError(f"MeshLayout: dims must map identifier names to sizes, got {dict(dims)}")
        sizes = _infer_sizes(world_size, dict(dims))
        unknown = [d for d in list(dp_dims) + list(collect or {}) if d not in sizes]
        if unknown:
            raise ValueError(f"MeshLayout: dims {unknown} are not in the mesh {sizes}; use one of {names}")
        if len(set(dp_dims)) != len(tuple(dp_dims)):
            raise ValueError(f"MeshLayout: dp_dims {list(dp_dims)} repeats a dim")
        owner = {}
        for name, coord in (collect or {}).items():
            if name in dp_dims:
                raise ValueError(
                    f"MeshLayout: collect names {name!r}, a data-parallel dim; name tp/pp/cp dims only"
                )
            size = sizes[name]
            if not -size <= coord < size:
                raise ValueError(
                    f"MeshLayout: collect[{name!r}]={coord} is outside 0..{size - 1} (or -1 for the last)"
                )
            owner[name] = coord % size
        return cls(tuple(sizes.items()), tuple(dp_dims), tuple(sorted(owner.items())))

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(s for _, s in self.dims)

    @property
    def dp_size(self) -> int:
        """How many ways the batch is split: the product of the dp dims' sizes."""
        return math.prod(self.sizes[d] for d in self.dp_dims)

    def size(self, name: str) -> int:
        """Size of one dim; 1 for a dim the mesh does not have (e.g. "cp" of an FSDP mesh)."""
        return self.sizes.get(name, 1)

    # ---- coordinates ---------------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank (row-major, last dim fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1} of mesh {self.sizes}")
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return {n: out[n] for n in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Global rank of a full set of coordinates (inverse of :meth:`coords`)."""
        rank = 0
        for name, size in self.dims:
            rank = rank * size + coords[name]
        return rank

    def dp_rank(self, rank: int) -> int:
        """Index of the data-parallel group of ``rank`` (row-major over the dp dims)."""
        c = self.coords(rank)
        index = 0
        for name in self.dp_dims:
            index = index * self.sizes[name] + c[name]
        return index

    def is_collector(self, rank: int) -> bool:
        """The rank owning its dp group's output: every non-dp coordinate equals the owner's."""
        owner = dict(self.collect)
        c = self.coords(rank)
        return all(c[n] == owner.get(n, 0) for n in self.names if n not in self.dp_dims)

    def coord(self, rank: int) -> MeshCoord:
        """Everything the driver needs about ``rank`` in this mesh."""
        return MeshCoord(rank, self.coords(rank), self.dp_rank(rank), self.dp_size, self.is_collector(rank))

    def groups(self, dims: Sequence[str]) -> list[list[int]]:
        """Partition of all ranks into groups that differ only in ``dims`` (e.g. ``["tp"]``: one
        list per tensor-parallel group), each sorted, in order of their first rank. Every rank
        must create the same groups in the same order, so this lists all of them."""
        missing = [d for d in dims if d not in self.sizes]
        if missing:
            raise ValueError(f"groups: dims {missing} are not in the mesh {self.sizes}")
        by_key: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            by_key.setdefault(tuple(c[n] for n in self.names if n not in dims), []).append(r)
        return sorted(by_key.values(), key=lambda g: g[0])

    def group_of(self, rank: int, dims: Sequence[str]) -> list[int]:
        """The ranks sharing every coordinate of ``rank`` except those in ``dims``."""
        return next(g for g in self.groups(dims) if rank in g)

    # ---- torch ---------------------------------------------------------------------------------
    def build_device_mesh(self, device_type: str) -> Any:
        """A torch DeviceMesh with these names and sizes over the default process group
        (call ``torch.distributed.init_process_group`` first; every rank must call this)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(s for _, s in self.dims), mesh_dim_names=self.names)

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.dims)


def _infer_sizes(world_size: int, dims: dict[str, int]) -> dict[str, int]:
    """Fill one -1 size from world_size; check every size >= 1 and the product."""
    unknown = [n for n, s in dims.items() if s == -1]
    bad = {n: s for n, s in dims.items() if s != -1 and (int(s) != s or s < 1)}
    if bad or len(unknown) > 1:
        raise ValueError(f"MeshLayout: sizes must be integers >= 1 with at most one -1 to infer, got {dims}")
    known = math.prod(int(s) for s in dims.values() if s != -1)
    if unknown:
        if world_size % known:
            raise ValueError(
                f"MeshLayout: world size {world_size} is not divisible by {known} (the product of {dims} "
                f"without {unknown[0]!r}); choose sizes whose product divides {world_size}"
            )
        dims = {**dims, unknown[0]: world_size // known}
    elif known != world_size:
        raise ValueError(
            f"MeshLayout: sizes {dims} multiply to {known}, but the world has {world_size} ranks; "
            f"make the product {world_size} (or give one size as -1 to infer it)"
        )
    return {n: int(s) for n, s in dims.items()}


def new_subgroups(layout: MeshLayout, dims: Sequence[str], rank: int, backend: str | None = None) -> Any:
    """Create one torch.distributed group per :meth:`MeshLayout.groups` (every rank must call
    this with the same arguments) and return the group containing ``rank``."""
    import torch.distributed as dist

    mine = None
    for ranks in layout.groups(dims):
        group = dist.new_group(ranks=ranks, backend=backend)
        if rank in ranks:
            mine = group
    return mine
