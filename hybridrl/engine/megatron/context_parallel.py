"""Context parallelism (`megatron.context_parallel_size`) for Megatron's local layer spec.

megatron-core's local `DotProductAttention` (the only attention on CPU: no Transformer Engine)
refuses context_parallel_size > 1. This module gives the local spec a core attention that does it,
and the data side around the model:

Load balance (as megatron-core): a fed row of length L (a multiple of 2 * CP) is cut into 2 * CP
chunks of c = L / (2 CP) positions; CP rank r holds chunks r and 2CP - 1 - r, so each rank has the
same amount of causal attention work. megatron-core's RotaryEmbedding already picks the positions
of those chunks for this rank (`get_pos_emb_on_this_cp_rank`), so only the tokens and the mask
are sliced here.

Attention: each rank's queries (L / CP of them) attend to all L keys. K and V are all-gathered
over the CP group (autograd: the backward reduce-scatters the key/value gradients, each rank's
keys being used by every rank's queries), put back into sequence order, and the rows of the full
(b, 1, L, L) mask that belong to this rank's query positions are applied. The mask is whatever
the engine built (causal + key padding, or the packed block-diagonal one), so padded and packed
micro-batches both work. Only the gather differs from CP=1: the softmax and the matmuls are
`DotProductAttention`'s own (an instance built with context_parallel_size=1).

Outputs: each rank computes the per-position results of its positions (log-prob and entropy over
its vocabulary slice, or the critic's value), then `gather_positions` all-gathers those small
(b, L / CP, k) tensors over CP into (b, L, k). Every CP rank then holds every row's full result,
so the PPO loss and its token counts are the CP=1 ones; the backward of the gather keeps this
rank's positions' gradient only. Each CP rank's parameter gradient is then the part of dL/dθ from
its positions; Megatron's DDP reduces over DP x CP with the factor 1 / (DP * CP), and Megatron's
schedule multiplies each micro-batch loss by CP (schedules.forward_step), so the sum is exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ContextParallelAttention",
    "cp_group_info",
    "cp_positions",
    "gather_positions",
]


def cp_group_info() -> tuple[int, int, Any]:
    """(cp size, cp rank, cp group or None) of this process's Megatron groups."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return 1, 0, None
    return cp, ps.get_context_parallel_rank(), ps.get_context_parallel_group()


def cp_positions(length: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The positions of a row of `length` that CP rank `rank` holds: chunks rank and 2cp-1-rank.

    Returns (length / cp,) int64, increasing within each chunk. `length` must be a multiple of 2cp.
    """
    if length % (2 * cp):
        raise ValueError(f"a context-parallel row must be a multiple of 2 * CP = {2 * cp} long, got {length}")
    c = length // (2 * cp)
    idx = torch.arange(length, device=device).view(2 * cp, c)
    return torch.cat([idx[rank], idx[2 * cp - 1 - rank]])


def _rank_order(length: int, cp: int, device: Any = None) -> torch.Tensor:
    """(length,) the positions in the order an all-gather over CP ranks concatenates them."""
    return torch.cat([cp_positions(length, cp, r, device) for r in range(cp)])


def _to_sequence_order(gathered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Rank-ordered positions along `dim` (what an all-gather gives) -> sequence order 0..L-1."""
    length = gathered.shape[dim]
    inverse = torch.argsort(_rank_order(length, cp, gathered.device))
    return gathered.index_select(dim, inverse)


class _GatherPositions(torch.autograd.Function):
    """All-gather along dim 1 over CP; the backward keeps this rank's slice of the gradient.

    Every CP rank computes the same loss from the gathered tensor, so the gradient of this rank's
    own positions is already complete on this rank: no reduction in the backward."""

    @staticmethod
    def forward(ctx, local, group, rank):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank, ctx.n = rank, local.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n].contiguous(), None, None


def gather_positions(local: torch.Tensor) -> torch.Tensor:
    """(b, L / CP, ...) results of this rank's positions -> (b, L, ...) in sequence order, on every CP rank."""
    cp, rank, group = cp_group_info()
    if cp == 1:
        return local
    return _to_sequence_order(_GatherPositions.apply(local, group, rank), 1, cp)


class ContextParallelAttention(nn.Module):
    """Core attention of the local layer spec with context parallelism (see the module docstring).

    Takes DotProductAttention's arguments and inputs: query (Sq, b, n_heads / TP, d), key and value
    (Sq, b, n_groups / TP, d) with Sq = L / CP this rank's positions, attention_mask
    (b or 1, 1, Sq, L) bool (True = masked) over all L keys in sequence order. Returns (Sq, b, n d / TP).
    """

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **kwargs: Any
    ):
        super().__init__()
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        self.config = config
        # the math of CP=1 (its config has no other use in DotProductAttention)
        inner_cfg = dataclasses.replace(config, context_parallel_size=1)
        self.inner = DotProductAttention(inner_cfg, layer_number, attn_mask_type, attention_type, **kwargs)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        from megatron.core import tensor_parallel

        cp, _, group = cp_group_info()
        if cp > 1:
            key, value = (
                _to_sequence_order(
                    tensor_parallel.gather_from_sequence_parallel_region(
                        t, tensor_parallel_output_grad=True, group=group
                    ),
                    0,
                    cp,
                )
                for t in (key, value)
            )
        return self.inner(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
