"""Data placement for Megatron ranks under the worker group's plain DP dispatch.

The worker group splits a batch into one chunk per rank (`Dispatch.DP_COMPUTE_PROTO`). Megatron
needs the same rows on every rank of one model replica (its TP x PP ranks) and distinct rows only
across data-parallel ranks. `gather_replica_batch` all-gathers the chunks of the replica's ranks,
so each replica computes on the concatenation (= its data-parallel shard), and `own_rows` gives
back the rows of this rank's chunk, so the dispatcher's concatenation of per-rank outputs is the
full batch in order. Results that only the last pipeline stage computes are broadcast first
(`broadcast_from_last_stage`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.protocol import DataProto

__all__ = ["broadcast_from_last_stage", "gather_replica_batch", "own_rows"]


def _replica_group():
    from megatron.core import parallel_state as ps

    return ps.get_model_parallel_group()


def gather_replica_batch(data: DataProto) -> tuple[DataProto, slice]:
    """(the replica's batch, the rows of this rank's chunk in it). No-op when the replica is one rank."""
    group = _replica_group()
    size = dist.get_world_size(group)
    if size == 1:
        return data, slice(0, len(data))
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, data, group=group)
    me = dist.get_rank(group)
    start = sum(len(p) for p in parts[:me])
    merged = DataProto.concat(parts)
    merged.meta_info = dict(data.meta_info)
    return merged, slice(start, start + len(data))


def own_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """This rank's rows of a replica-wide result."""
    return t[rows]


def broadcast_from_last_stage(value: Any) -> Any:
    """The last pipeline stage's `value` (tensor or picklable object) on every stage of this replica."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = ps.get_pipeline_model_parallel_group()
    src = dist.get_process_group_ranks(group)[-1]
    box = [value if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
