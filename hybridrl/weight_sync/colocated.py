"""The colocated weight sync: the training side's tensors into the rollout engine of the same process.

The training side produces `(hf_name, full_tensor)` pairs one at a time (the FSDP engine's
`iter_full_params` all-gathers a bucket of parameters per collective and yields them in order).
`sync_weights` pulls them into
buckets of at most `bucket_megabytes` (a tensor larger than that forms its own bucket), then
streams each bucket to `rollout.update_weights`. So at most one bucket of gathered tensors is
alive on the sender, and the engine consumes the stream without building a full state dict.
A disaggregated rollout worker loads what it received the same way (component.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hybridrl.weight_sync.buckets import iter_buckets, tensor_nbytes

__all__ = [
    "per_rank_sync_metrics",
    "sync_weights",
    "wake_and_sync",
    "weight_sync_step_metrics",
]


def sync_weights(
    rollout: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_megabytes: float | None = None,
) -> dict[str, float]:
    """Stream `named_tensors` into `rollout.update_weights` bucket by bucket.

    Args:
        rollout: a BaseRollout (anything with `update_weights(iterable)` works).
        named_tensors: `(hf_name, tensor)` pairs from the training side.
        bucket_megabytes: bucket size; defaults to `rollout.config.update_weights_bucket_megabytes`
            (with `rollout.config.layered_summon`, buckets also end at decoder-layer boundaries).

    Returns:
        metrics: `timing_s/update_weights` (seconds, gather + load), `weight_sync/bytes`
        (bytes pulled from the source), `weight_sync/num_tensors`, `weight_sync/num_buckets`,
        `weight_sync/max_bucket_bytes` and `weight_sync/gbytes_per_s`.
    """
    if bucket_megabytes is None:
        bucket_megabytes = rollout.config.update_weights_bucket_megabytes
    bucket_bytes = int(bucket_megabytes * 2**20)
    stats = {"bytes": 0, "num_tensors": 0, "num_buckets": 0, "max_bucket_bytes": 0}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        by_layer = bool(getattr(rollout.config, "layered_summon", False))
        for bucket in iter_buckets(named_tensors, bucket_bytes, by_layer=by_layer):
            nbytes = sum(tensor_nbytes(t) for _, t in bucket)
            stats["num_buckets"] += 1
            stats["num_tensors"] += len(bucket)
            stats["bytes"] += nbytes
            stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], nbytes)
            yield from bucket
            bucket.clear()  # drop the sender's references as soon as the engine has them

    t0 = time.perf_counter()
    rollout.update_weights(stream())
    elapsed = time.perf_counter() - t0
    return {
        "timing_s/update_weights": elapsed,
        "weight_sync/bytes": float(stats["bytes"]),
        "weight_sync/num_tensors": float(stats["num_tensors"]),
        "weight_sync/num_buckets": float(stats["num_buckets"]),
        "weight_sync/max_bucket_bytes": float(stats["max_bucket_bytes"]),
        "weight_sync/gbytes_per_s": stats["bytes"] / max(elapsed, 1e-9) / 1e9,
    }


def per_rank_sync_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Every rank's bytes and seconds of one sync, as min / max over the world (a collective on
    the default group; {} without torch.distributed). With rollout TP each rank still receives
    the full tensors and its engine keeps its slice, so the bytes are equal on every rank; the
    seconds show the slowest rank the others wait for."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not metrics:
        return {}
    mine = torch.tensor(
        [metrics["weight_sync/bytes"], metrics["timing_s/update_weights"]], dtype=torch.float64
    )
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    table = torch.stack(rows)
    return {
        "weight_sync/bytes_per_rank/min": float(table[:, 0].min()),
        "weight_sync/bytes_per_rank/max": float(table[:, 0].max()),
        "weight_sync/seconds_per_rank/min": float(table[:, 1].min()),
        "weight_sync/seconds_per_rank/max": float(table[:, 1].max()),
    }


def weight_sync_step_metrics(rollout_metrics: dict[str, Any]) -> dict[str, float]:
    """The `weight_sync/*` entries of a rollout output's meta_info["metrics"] (merged over the
    collecting ranks into lists) as one number each: the max over ranks (bytes are equal on
    every rank; for seconds the slowest rank is what the step waits for)."""
    out = {}
    for key, value in rollout_metrics.items():
        if key.startswith("weight_sync/"):
            values = value if isinstance(value, (list, tuple)) else [value]
            out[key] = float(max(values))
    return out


def wake_and_sync(rollout: Any, sync: Callable[[], dict], multi_stage: bool) -> dict:
    """Wake a sleeping engine and load the new weights; returns `sync()`'s metrics.

    veRL's `rollout.multi_stage_wake_up`: True wakes the weights only, syncs them, then wakes the
    KV cache, so the training side's gathered buckets and the KV cache are never resident at the
    same time (lower peak memory); False wakes everything, then syncs. Engines without sleep
    mode (HF; vLLM on CPU) make the wake-ups no-ops: the order is the same, the memory is not.
    """
    if not multi_stage:
        rollout.resume_memory()
        return sync()
    rollout.resume_memory(tags=["weights"])
    metrics = sync()
    rollout.resume_memory(tags=["kv_cache"])
    return metrics
