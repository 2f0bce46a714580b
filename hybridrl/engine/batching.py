"""Mini-batch / micro-batch plumbing shared by the actor and the critic.

One optimizer step consumes a mini-batch, split over data-parallel ranks and, on each rank, into
micro-batches whose gradients accumulate. `global_loss_scale` sums the loss-token and sequence
counts of the mini-batch over all ranks so that every micro-batch loss is normalised by the
WHOLE mini-batch (see hybridrl.algos.agg): the accumulated, rank-averaged gradient then equals
the gradient of the un-split mini-batch, whatever the micro-batching.

`TokenWeightedMeans` turns per-micro-batch means into the mini-batch mean the same way: each
rank's share is sum_micro(mean_micro * tokens_micro) / global_tokens * dp_size, and
`mean_over_ranks` (one all-reduce per mini-batch) makes every rank report the exact token mean
of the whole mini-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.algos.agg import LossScale, loss_counts
from hybridrl.utils.seqlen_balancing import rearrange_micro_batches, restore_order


def default_dp_group(dp_size: int, dp_group: Any = None) -> Any:
    """The group to all-reduce over: the given one, WORLD when distributed with dp_size > 1, else None."""
    if dp_group is not None:
        return dp_group
    if dp_size > 1 and dist.is_initialized():
        return dist.group.WORLD
    return None


def response_mask_of(batch: Any) -> torch.Tensor:
    """`response_mask` (B, T) if present, else the response part of `attention_mask`."""
    if "response_mask" in batch.keys():
        return batch["response_mask"]
    t = batch["responses"].shape[-1]
    return batch["attention_mask"][:, -t:]


def global_loss_scale(
    response_mask: torch.Tensor, *, dp_size: int, dp_group: Any, max_response_length: int | None = None
) -> LossScale:
    """LossScale with the loss-token / sequence counts of the mini-batch summed over ranks.

    Args:
        response_mask: (B, T) this rank's part of the mini-batch.
    """
    counts = loss_counts(response_mask.float())
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    counts = counts.clamp(min=1.0)  # an all-padding mini-batch gives loss 0, not 0/0
    return LossScale(counts[0], counts[1], dp_size, max_response_length)


def split_micro_batches(
    batch: Any,
    *,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int | None,
    dp_group: Any,
    key: str,
) -> tuple[list[Any], list[list[int]] | None]:
    """Fixed-size micro-batches, or token-budget ones balanced by Karmarkar-Karp.

    Returns:
        (micro_batches, indices): indices is None for fixed-size splits (order kept), else the
        batch rows of each micro-batch (undo with `restore_order`).
    """
    if use_dynamic_bsz:
        if not max_token_len:
            raise ValueError(f"use_dynamic_bsz=True needs {key} (tokens per micro-batch)")
        return rearrange_micro_batches(batch, max_token_len, dp_group=dp_group, key=key)
    if not micro_batch_size or micro_batch_size < 1:
        raise ValueError(f"micro-batch size {key} must be set (>= 1) when use_dynamic_bsz=False")
    return list(batch.split(micro_batch_size)), None


def merge_outputs(outputs: list[torch.Tensor], indices: list[list[int]] | None) -> torch.Tensor:
    """Concatenate per-micro-batch results in batch order."""
    return torch.cat(outputs, dim=0) if indices is None else restore_order(outputs, indices)


def clip_grad_norm(module: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to `max_norm` (<= 0: only measure) and return the norm.

    Works on sharded (DTensor) gradients; the norm is the one of the full, un-sharded gradient.
    A non-finite norm is returned as is and the gradients are left unscaled (the caller skips
    the optimizer step).
    """
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
    value = float((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
    if max_norm and max_norm > 0 and math.isfinite(value):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return value


def optimizer_step(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> tuple[float, bool]:
    """Clip, then step unless the gradient norm is not finite; always zero the gradients.

    Returns:
        (grad_norm, stepped).
    """
    grad_norm = clip_grad_norm(module, max_norm)
    stepped = math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    else:
        print(f"[hybridrl] warning: gradient norm is {grad_norm}; skipping this optimizer step")
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


class TokenWeightedMeans:
    """Accumulates per-micro-batch token means into this rank's share of the mini-batch mean."""

    def __init__(self, loss_scale: LossScale) -> None:
        self._factor = float(loss_scale.dp_size) / float(loss_scale.num_tokens)
        self._sums: dict[str, float] = defaultdict(float)

    def add(self, values: dict[str, torch.Tensor | float], num_tokens: torch.Tensor | float) -> None:
        n = float(num_tokens)
        for name, value in values.items():
            self._sums[name] += float(value) * n * self._factor

    def result(self) -> dict[str, float]:
        return dict(self._sums)


def mean_over_ranks(
    values: dict[str, float], dp_group: Any, dp_size: int, device: Any = None
) -> dict[str, float]:
    """Average metric values over the data-parallel ranks (every rank must pass the same keys)."""
    if dp_group is None or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dp_group)
    return {k: float(v) / dp_size for k, v in zip(keys, t.tolist())}


def append_metrics(store: dict[str, list], values: dict[str, Any]) -> None:
    """Append each value (tensor or number) to the list under its name."""
    for name, value in values.items():
        store.setdefault(name, []).append(float(value))


def shuffle_seed(seed: int | None, shuffle: bool, meta_info: dict) -> int | None:
    """Seed of this update's mini-batch order: data_loader_seed + the trainer's global step."""
    if not shuffle:
        return None
    return int(seed or 0) + int(meta_info.get("global_steps", 0))
