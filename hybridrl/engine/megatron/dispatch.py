"""Results of the last pipeline stage on every stage of a Megatron model replica.

The worker group's mesh dispatch (`ParallelDims.train_mesh`) gives every rank of one replica
(its TP x PP ranks) the same rows; losses, log-probs and values exist only on the last pipeline
stage, so `broadcast_from_last_stage` hands them to the other stages (metrics must agree on all
ranks, and the collecting rank may be any of them).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["broadcast_from_last_stage"]


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
