"""Dispatch modes: how one driver call is split across the ranks of a worker group, and how the
per-rank results are combined again.

A dispatch mode is a pair of plain functions:

* ``dispatch_fn(world_size, *args, **kwargs) -> DispatchPlan`` decides which ranks are called
  and with which arguments;
* ``collect_fn(outputs, context) -> Any`` turns the list of outputs of the called ranks (in
  rank order) into the value the driver sees. ``context`` is ``DispatchPlan.context``, e.g. the
  number of padding rows to drop again.

The built-in modes are attributes of :class:`Dispatch`; :func:`register_dispatch_mode` adds new
ones (they become ``Dispatch.<NAME>`` too). Nothing here touches Ray: the worker group does the
remote calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridrl.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor, unpad_dataproto
from hybridrl.single_controller.batch_ref import BatchRef

__all__ = [
    "Dispatch",
    "DispatchMode",
    "DispatchPlan",
    "MeshDispatchInfo",
    "get_dispatch_mode",
    "make_mesh_dispatch",
    "register_dispatch_mode",
]


@dataclass
class DispatchPlan:
    """What a dispatch function decided for one call.

    Attributes:
        rank_args: positional arguments for each called rank, in the order of ``ranks``.
        rank_kwargs: keyword arguments for each called rank, in the order of ``ranks``.
        ranks: the ranks to call; None means every rank 0..world_size-1 in order.
        context: anything the matching collect function needs (e.g. the padding size).
    """

    rank_args: list[tuple]
    rank_kwargs: list[dict[str, Any]]
    ranks: list[int] | None = None
    context: Any = None

    def __post_init__(self) -> None:
        n = len(self.rank_args) if self.ranks is None else len(self.ranks)
        if len(self.rank_args) != n or len(self.rank_kwargs) != n:
            raise ValueError(
                f"DispatchPlan: {len(self.rank_args)} rank_args and {len(self.rank_kwargs)} rank_kwargs "
                f"for {n} ranks; a dispatch function must give one entry per called rank."
            )


@dataclass(frozen=True)
class DispatchMode:
    """A named (dispatch_fn, collect_fn) pair. ``returns_data_proto`` marks modes whose collected
    result is a DataProto; their non-blocking calls return a DataProtoFuture. ``mesh`` names the
    device mesh of a mesh-aware mode (see :func:`make_mesh_dispatch`): its dispatch_fn gets a
    :class:`MeshDispatchInfo` instead of the world size."""

    name: str
    dispatch_fn: Callable[..., DispatchPlan] = field(repr=False, compare=False)
    collect_fn: Callable[[list[Any], Any], Any] = field(repr=False, compare=False)
    returns_data_proto: bool = False
    mesh: str | None = None

    def __repr__(self) -> str:
        return f"Dispatch.{self.name}"


class Dispatch:
    """Namespace of the registered dispatch modes (extensible with register_dispatch_mode).

    Built-in modes:
        ONE_TO_ALL: every rank gets the same arguments; returns the list of per-rank results.
        ALL_TO_ALL: every argument is a list of length world_size; rank i gets element i;
            returns the list of per-rank results.
        RANK_ZERO: only rank 0 is called; returns its result.
        DP_COMPUTE: like ALL_TO_ALL, over data-parallel ranks (one list element per rank).
        DP_COMPUTE_PROTO: every DataProto / DataProtoFuture argument is split into world_size
            equal chunks (DataProtos are padded first when len % world_size != 0); other
            arguments go unchanged to every rank. The per-rank DataProtos are concatenated in
            rank order and the padding rows removed.
        DP_COMPUTE_PROTO_WITH_FUNC: the first argument is a function sent to every rank, the rest
            is split as in DP_COMPUTE_PROTO; results are collected as in DP_COMPUTE_PROTO.
        DP_COMPUTE_METRIC: DataProto arguments split as in DP_COMPUTE_PROTO but never padded
            (padding rows would bias metrics: the length must be divisible by world_size);
            returns the list of per-rank results.
    """

    ONE_TO_ALL: DispatchMode
    ALL_TO_ALL: DispatchMode
    RANK_ZERO: DispatchMode
    DP_COMPUTE: DispatchMode
    DP_COMPUTE_PROTO: DispatchMode
    DP_COMPUTE_PROTO_WITH_FUNC: DispatchMode
    DP_COMPUTE_METRIC: DispatchMode

    _modes: dict[str, DispatchMode] = {}

    def __init__(self) -> None:
        raise TypeError(
            "Dispatch is a namespace of modes; use Dispatch.ONE_TO_ALL etc., do not instantiate it"
        )

    @classmethod
    def names(cls) -> list[str]:
        return list(cls._modes)


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[..., DispatchPlan],
    collect_fn: Callable[[list[Any], Any], Any],
    *,
    returns_data_proto: bool = False,
    mesh: str | None = None,
) -> DispatchMode:
    """Add a dispatch mode, available afterwards as ``Dispatch.<name>``.

    Args:
        name: an upper-case identifier not used yet, e.g. "SUM_OVER_RANKS".
        dispatch_fn: ``dispatch_fn(world_size, *args, **kwargs) -> DispatchPlan``.
        collect_fn: ``collect_fn(outputs, context) -> result``; outputs in the plan's rank order.
        returns_data_proto: the collected result is a DataProto (non-blocking calls then return
            a DataProtoFuture that a following DP_COMPUTE_PROTO call can chunk lazily).
        mesh: name of a device mesh the workers declare; dispatch_fn is then called as
            ``dispatch_fn(info: MeshDispatchInfo, *args, **kwargs)``.

    Returns:
        The new mode (also ``Dispatch.<name>``).
    """
    if not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"dispatch mode name {name!r} must be a public identifier such as 'MY_MODE'")
    if name in Dispatch._modes or hasattr(Dispatch, name):
        raise ValueError(
            f"dispatch mode {name!r} already exists (known: {Dispatch.names()}); pick another name"
        )
    if not callable(dispatch_fn) or not callable(collect_fn):
        raise TypeError("register_dispatch_mode: dispatch_fn and collect_fn must be callables")
    mode = DispatchMode(name, dispatch_fn, collect_fn, returns_data_proto, mesh)
    Dispatch._modes[name] = mode
    setattr(Dispatch, name, mode)
    return mode


def get_dispatch_mode(mode: DispatchMode | str) -> DispatchMode:
    """The registered mode for a DispatchMode or its name."""
    name = mode.name if isinstance(mode, DispatchMode) else mode
    if not isinstance(name, str) or name not in Dispatch._modes:
        raise ValueError(
            f"unknown dispatch mode {mode!r}; known modes: {Dispatch.names()}. "
            "Add new ones with register_dispatch_mode(name, dispatch_fn, collect_fn)."
        )
    return Dispatch._modes[name]


# ----------------------------------------------------------------------------------------------
# built-in dispatch / collect functions
# ----------------------------------------------------------------------------------------------
def _broadcast(world_size: int, args: tuple, kwargs: dict[str, Any]) -> DispatchPlan:
    return DispatchPlan([args] * world_size, [kwargs] * world_size)


def dispatch_one_to_all(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return _broadcast(world_size, args, kwargs)


def dispatch_rank_zero(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return DispatchPlan([args], [kwargs], ranks=[0])


def _check_per_rank(world_size: int, name: str, value: Any, mode: str) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != world_size:
        got = (
            f"a {type(value).__name__} of length {len(value)}"
            if isinstance(value, (list, tuple))
            else (f"a {type(value).__name__}")
        )
        raise ValueError(
            f"{mode}: argument {name} must be a list with one entry per rank (length {world_size}), got "
            f"{got}. Use Dispatch.ONE_TO_ALL to send the same value to every rank."
        )


def _dispatch_elementwise(mode: str, world_size: int, args: tuple, kwargs: dict[str, Any]) -> DispatchPlan:
    for i, a in enumerate(args):
        _check_per_rank(world_size, f"#{i}", a, mode)
    for k, v in kwargs.items():
        _check_per_rank(world_size, repr(k), v, mode)
    rank_args = [tuple(a[r] for a in args) for r in range(world_size)]
    rank_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(world_size)]
    return DispatchPlan(rank_args, rank_kwargs)


def dispatch_all_to_all(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return _dispatch_elementwise("ALL_TO_ALL", world_size, args, kwargs)


def dispatch_dp_compute(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return _dispatch_elementwise("DP_COMPUTE", world_size, args, kwargs)


def _split_protos(mode: str, world_size: int, args: tuple, kwargs: dict[str, Any], pad: bool) -> DispatchPlan:
    """Chunk every DataProto / BatchRef / DataProtoFuture argument world_size ways; broadcast the rest.

    DataProtos and BatchRefs are padded (if ``pad``) to a multiple of world_size; the pad size
    goes into the plan's context. A BatchRef's chunks are futures that each rank resolves from
    the object store. DataProtoFutures are chunked lazily (``DataProtoFuture.chunk``): each
    rank resolves only its piece, so their length must already be divisible by world_size.
    """
    lengths = {}
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, (DataProto, BatchRef)):
            lengths[key] = len(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"{mode}: DataProto arguments have different lengths {lengths}; they must describe the same rows"
        )
    pad_size = 0
    if lengths:
        n = next(iter(lengths.values()))
        if n == 0:
            raise ValueError(
                f"{mode}: got an empty DataProto; there is nothing to split across {world_size} ranks"
            )
        if n % world_size and not pad:
            raise ValueError(
                f"{mode}: batch of {n} rows is not divisible by world_size={world_size}. Use a batch size "
                f"that is a multiple of {world_size}, or DP_COMPUTE_PROTO which pads automatically."
            )

    def split(value: Any) -> list[Any]:
        nonlocal pad_size
        if isinstance(value, DataProto):
            if pad:
                value, pad_size = pad_dataproto_to_divisor(value, world_size)
            return value.chunk(world_size)
        if isinstance(value, BatchRef):
            chunks, pad_size = value.shard(world_size, pad)
            return chunks
        if isinstance(value, DataProtoFuture):
            return value.chunk(world_size)
        return [value] * world_size

    split_args = [split(a) for a in args]
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    rank_args = [tuple(a[r] for a in split_args) for r in range(world_size)]
    rank_kwargs = [{k: v[r] for k, v in split_kwargs.items()} for r in range(world_size)]
    return DispatchPlan(rank_args, rank_kwargs, context=pad_size)


def dispatch_dp_compute_proto(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return _split_protos("DP_COMPUTE_PROTO", world_size, args, kwargs, pad=True)


def dispatch_dp_compute_proto_with_func(
    world_size: int, func: Callable, *args: Any, **kwargs: Any
) -> DispatchPlan:
    if not callable(func):
        raise TypeError(
            f"DP_COMPUTE_PROTO_WITH_FUNC: the first argument must be a function to send to every rank, "
            f"got a {type(func).__name__}"
        )
    plan = _split_protos("DP_COMPUTE_PROTO_WITH_FUNC", world_size, args, kwargs, pad=True)
    plan.rank_args = [(func, *a) for a in plan.rank_args]
    return plan


def dispatch_dp_compute_metric(world_size: int, *args: Any, **kwargs: Any) -> DispatchPlan:
    return _split_protos("DP_COMPUTE_METRIC", world_size, args, kwargs, pad=False)


def collect_list(outputs: list[Any], context: Any) -> list[Any]:
    return list(outputs)


def collect_first(outputs: list[Any], context: Any) -> Any:
    return outputs[0]


def concat_and_unpad(outputs: Sequence[DataProto], pad_size: int) -> DataProto:
    """Concatenate per-rank DataProtos in rank order and drop the last ``pad_size`` rows."""
    bad = [i for i, o in enumerate(outputs) if not isinstance(o, DataProto)]
    if bad:
        raise TypeError(
            f"DP_COMPUTE_PROTO: ranks {bad} returned {type(outputs[bad[0]]).__name__}, not a DataProto; "
            "a DP_COMPUTE_PROTO method must return a DataProto (use DP_COMPUTE_METRIC or ONE_TO_ALL "
            "for other results)"
        )
    return unpad_dataproto(DataProto.concat(list(outputs)), pad_size or 0)


def collect_dp_compute_proto(outputs: list[Any], context: Any) -> DataProto:
    return concat_and_unpad(outputs, context or 0)


def collect_batch_ref(outputs: list[Any], context: Any, mode: DispatchMode) -> BatchRef:
    """Collect of a call given a BatchRef: the ranks returned ShardHandles (their results stayed in
    the object store); keep one per chunk (a mesh mode's collecting ranks), in row order."""
    if mode.mesh is not None:
        pad_size, collector_of = context
        outputs = [outputs[r] for r in collector_of]
    else:
        pad_size = context or 0
    return BatchRef.from_handles(outputs, pad_size)


def proto_collect_fn(mode: DispatchMode, context: Any) -> Callable[[list[Any]], Any]:
    """``collect_fn`` bound to a call's context: the one-argument form DataProtoFuture expects."""
    return functools.partial(_apply_collect, mode.collect_fn, context=context)


def _apply_collect(collect_fn: Callable[[list[Any], Any], Any], outputs: list[Any], context: Any) -> Any:
    return collect_fn(outputs, context)


register_dispatch_mode("ONE_TO_ALL", dispatch_one_to_all, collect_list)
register_dispatch_mode("ALL_TO_ALL", dispatch_all_to_all, collect_list)
register_dispatch_mode("RANK_ZERO", dispatch_rank_zero, collect_first)
register_dispatch_mode("DP_COMPUTE", dispatch_dp_compute, collect_list)
register_dispatch_mode(
    "DP_COMPUTE_PROTO", dispatch_dp_compute_proto, collect_dp_compute_proto, returns_data_proto=True
)
register_dispatch_mode(
    "DP_COMPUTE_PROTO_WITH_FUNC",
    dispatch_dp_compute_proto_with_func,
    collect_dp_compute_proto,
    returns_data_proto=True,
)
register_dispatch_mode("DP_COMPUTE_METRIC", dispatch_dp_compute_metric, collect_list)


# ----------------------------------------------------------------------------------------------
# mesh-aware dispatch: split over a named mesh's data-parallel groups, collect once per group
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeshDispatchInfo:
    """What the driver knows about one named mesh of a worker group (built from every rank's
    MeshCoord by the worker group).

    Attributes:
        mesh: the mesh name.
        dp_rank_of: dp group index of each global rank (length world_size).
        collector_of: for each dp group 0..dp_size-1, the global rank whose result is kept.
    """

    mesh: str
    dp_rank_of: tuple[int, ...]
    collector_of: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.dp_rank_of)

    @property
    def dp_size(self) -> int:
        return len(self.collector_of)

    @classmethod
    def from_coords(cls, mesh: str, coords: Sequence[Any]) -> MeshDispatchInfo:
        """Check per-rank MeshCoords (one collector per dp group, dp ranks 0..dp_size-1) and build."""
        dp_sizes = {c.dp_size for c in coords}
        if len(dp_sizes) != 1:
            raise ValueError(
                f"mesh {mesh!r}: ranks disagree on the dp size ({sorted(dp_sizes)}); declare one layout"
            )
        dp_size = dp_sizes.pop()
        collectors: dict[int, list[int]] = {d: [] for d in range(dp_size)}
        for rank, c in enumerate(coords):
            if not 0 <= c.dp_rank < dp_size:
                raise ValueError(
                    f"mesh {mesh!r}: rank {rank} reports dp_rank {c.dp_rank} outside 0..{dp_size - 1}"
                )
            if c.is_collector:
                collectors[c.dp_rank].append(rank)
        bad = {d: r for d, r in collectors.items() if len(r) != 1}
        if bad:
            raise ValueError(
                f"mesh {mesh!r}: every dp group needs exactly one collecting rank; dp group -> collectors: {bad}"
            )
        return cls(mesh, tuple(c.dp_rank for c in coords), tuple(r[0] for _, r in sorted(collectors.items())))


def dispatch_mesh_proto(info: MeshDispatchInfo, *args: Any, **kwargs: Any) -> DispatchPlan:
    """Split DataProto / DataProtoFuture arguments into info.dp_size chunks (padding DataProtos
    as DP_COMPUTE_PROTO does); rank r gets chunk ``info.dp_rank_of[r]``, so every rank of one
    tp/pp group sees the same rows. Other arguments go unchanged to every rank."""
    by_dp = _split_protos(f"mesh {info.mesh!r}", info.dp_size, args, kwargs, pad=True)
    rank_args = [by_dp.rank_args[d] for d in info.dp_rank_of]
    rank_kwargs = [by_dp.rank_kwargs[d] for d in info.dp_rank_of]
    return DispatchPlan(rank_args, rank_kwargs, context=(by_dp.context, info.collector_of))


def collect_mesh_proto(outputs: list[Any], context: tuple[int, tuple[int, ...]]) -> DataProto:
    """Keep the collector's output of each dp group (in dp order), concatenate, unpad."""
    pad_size, collector_of = context
    return concat_and_unpad([outputs[r] for r in collector_of], pad_size)


def mesh_mode_name(mesh: str) -> str:
    return f"MESH_PROTO_{mesh.upper()}"


def make_mesh_dispatch(mesh: str) -> DispatchMode:
    """The DataProto dispatch mode over the mesh a worker declared as ``mesh`` (created once).

    Use it as ``@register(dispatch_mode=make_mesh_dispatch("rollout"))``: the batch is split over
    that mesh's dp groups, every rank of a group gets the same chunk, the result of the group's
    collecting rank is kept (the others return None to the driver), in dp order, padding removed.
    Non-blocking calls return DataProtoFutures as DP_COMPUTE_PROTO does.
    """
    if not isinstance(mesh, str) or not mesh.isidentifier():
        raise ValueError(
            f"make_mesh_dispatch: mesh name must be an identifier such as 'rollout', got {mesh!r}"
        )
    name = mesh_mode_name(mesh)
    if name in Dispatch._modes:
        return Dispatch._modes[name]
    return register_dispatch_mode(
        name, dispatch_mesh_proto, collect_mesh_proto, returns_data_proto=True, mesh=mesh
    )
