"""Streaming weight sync from the training side into a rollout engine, in bounded buckets.

The training side produces `(hf_name, full_tensor)` pairs one at a time (the FSDP engine's
`iter_full_params` all-gathers a bucket of parameters per collective and yields them in order).
`sync_weights` pulls them into
buckets of at most `bucket_megabytes` (a tensor larger than that forms its own bucket), then
streams each bucket to `rollout.update_weights`. So at most one bucket of gathered tensors is
alive on the sender, and the engine consumes the stream without building a full state dict.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["iter_buckets", "per_rank_sync_metrics", "sync_weights", "tensor_nbytes"]


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into consecutive buckets of at most `bucket_bytes`.

    Order is preserved; a tensor bigger than `bucket_bytes` is a bucket of its own; no bucket
    is empty.

    Args:
        named_tensors: `(name, tensor)` pairs, pulled lazily.
        bucket_bytes: the byte budget of one bucket (> 0).

    Yields:
        lists of `(name, tensor)` pairs.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor_nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def sync_weights(
    rollout: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_megabytes: float | None = None,
) -> dict[str, float]:
    """Stream `named_tensors` into `rollout.update_weights` bucket by bucket.

    Args:
        rollout: a BaseRollout (anything with `update_weights(iterable)` works).
        named_tensors: `(hf_name, tensor)` pairs from the training side.
        bucket_megabytes: bucket size; defaults to `rollout.config.update_weights_bucket_megabytes`.

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
        for bucket in iter_buckets(named_tensors, bucket_bytes):
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
