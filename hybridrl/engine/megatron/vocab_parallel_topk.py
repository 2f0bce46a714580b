"""Top-k log-probs, and log-probs at given ids, from vocabulary-parallel logits (`forward_kl_topk`).

The Megatron side of on-policy distillation's top-k forward KL (the FSDP side is
engine/topk.py). Each tensor-parallel rank holds the logits l (..., V / tp) of its slice
[start, start + V / tp) of the (padded) vocabulary; the full vocabulary is never gathered.

Normaliser (as Megatron's vocab-parallel cross entropy): m = max_v l_v (all-reduce MAX), then
Z = sum_v exp(l_v - m) (all-reduce SUM), log p_v = l_v - m - log Z.

* Teacher (`vocab_parallel_topk`): each rank takes its local top-k of l (k' = min(k, V / tp)),
  the tp * k' candidates (values and global ids) are all-gathered, and the global top-k of the
  candidates is the top-k of the whole vocabulary (every global top-k token is in its owner's
  local top-k). No gradient.
* Student (`vocab_parallel_gather`): log p at the global ids (..., K); the rank that owns an id
  contributes l_id - m, the others 0, summed by one all-reduce. Backward, local to the slice:
  d log p_{id_k} / d l_v = 1[v = id_k] - p_v, so grad_v = sum_k g_k 1[v = id_k] - p_v sum_k g_k.

Columns beyond the real vocabulary (padding to a multiple of tp) are masked to the dtype's lowest
finite value: they get no probability, no gradient and are never in a top-k.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrl.engine.base import LogProbs
from hybridrl.engine.topk import TOPK_IDS_KEY

__all__ = ["topk_log_probs", "vocab_parallel_gather", "vocab_parallel_topk"]


def _masked(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> tuple[torch.Tensor, int]:
    """(`logits` with padded columns masked, this slice's first global id)."""
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    if start + v_local > vocab_size:
        cols = torch.arange(start, start + v_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, torch.finfo(logits.dtype).min)
    return logits, start


def _shift_and_sum_exp(logits: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(l - m, local sum of exp(l - m)) with m the global max of each position."""
    m = logits.max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    return shifted, shifted.exp().sum(-1)


@torch.no_grad()
def vocab_parallel_topk(
    logits: torch.Tensor, k: int, *, vocab_size: int, tp_rank: int = 0, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs of softmax(logits) over the real vocabulary, and their global ids.

    Args:
        logits: (..., V_local) float32, this rank's slice of the padded vocabulary.
        k: how many (1 <= k <= vocab_size).
        vocab_size: the real vocabulary size V.
        tp_rank / group: this rank's TP index and the TP process group (None: no TP).

    Returns:
        (values (..., k) float32 log-probs in descending order, ids (..., k) int64 global ids),
        the same on every TP rank.
    """
    if not 1 <= k <= vocab_size:
        raise ValueError(f"distillation_loss.topk={k} exceeds the vocabulary ({vocab_size})")
    logits, start = _masked(logits.float(), vocab_size, tp_rank)
    shifted, sum_exp = _shift_and_sum_exp(logits, group)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
    values, idx = shifted.topk(min(k, shifted.shape[-1]), dim=-1)
    idx = idx + start
    if group is not None:
        world = dist.get_world_size(group)
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_ids = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, idx.contiguous(), group=group)
        values, idx = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
    top, pos = values.topk(k, dim=-1)
    return top - sum_exp.log().unsqueeze(-1), idx.gather(-1, pos)


class _VocabParallelGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, vocab_start, group):
        v_local = logits.shape[-1]
        shifted, sum_exp = _shift_and_sum_exp(logits, group)
        in_slice = (ids >= vocab_start) & (ids < vocab_start + v_local)
        local = (ids - vocab_start).clamp(0, v_local - 1)
        picked = shifted.gather(-1, local) * in_slice
        packed = torch.cat([sum_exp.unsqueeze(-1), picked], dim=-1)  # one all-reduce for both
        if group is not None:
            dist.all_reduce(packed, group=group)
        sum_exp, picked = packed[..., 0], packed[..., 1:]
        ctx.save_for_backward(shifted.exp() / sum_exp.unsqueeze(-1), local, in_slice)
        return picked - sum_exp.log().unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        probs, local, in_slice = ctx.saved_tensors
        out = -probs * grad.sum(-1, keepdim=True)
        out.scatter_add_(-1, local, grad * in_slice.to(grad.dtype))
        return out, None, None, None


def vocab_parallel_gather(
    logits: torch.Tensor, ids: torch.Tensor, *, vocab_size: int, tp_rank: int = 0, group=None
) -> torch.Tensor:
    """log softmax(logits) at global `ids`, over the real vocabulary; differentiable w.r.t. logits.

    Args:
        logits: (..., V_local) float32, this rank's slice of the padded vocabulary.
        ids: (..., K) int64 global token ids (each < vocab_size).
        vocab_size: the real vocabulary size V.
        tp_rank / group: this rank's TP index and the TP process group (None: no TP).

    Returns:
        (..., K) float32 log-probs, the same on every TP rank.
    """
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(
            f"ids {tuple(ids.shape)} and logits {tuple(logits.shape)} differ before the last dim"
        )
    logits, start = _masked(logits, vocab_size, tp_rank)
    return _VocabParallelGather.apply(logits, ids.long(), start, group)


def topk_log_probs(
    logits: torch.Tensor,
    micro,
    request,
    base: LogProbs,
    *,
    vocab_size: int,
    tp_rank: int = 0,
    group=None,
) -> LogProbs:
    """`base` (sampled-token log-probs, entropy) with the top-k part of a LogProbRequest added.

    Args:
        logits: (b, T, V_local) float32 response-predicting logits / temperature, with gradient
            when training.
        micro: the micro-batch; holds `teacher_topk_ids` (b, T, K) for `request.topk_ids`.
        request: LogProbRequest with topk > 0 (a teacher) or topk_ids=True (the student).
        base: LogProbs with log_probs (b, T) and entropy of the same logits.

    Returns:
        LogProbs with topk_log_probs (b, T, K) and topk_ids (b, T, K) set.
    """
    if (request.topk > 0) == bool(request.topk_ids):
        raise ValueError("a top-k LogProbRequest gives exactly one of topk > 0 and topk_ids=True")
    if request.topk > 0:
        values, ids = vocab_parallel_topk(
            logits.detach(), request.topk, vocab_size=vocab_size, tp_rank=tp_rank, group=group
        )
    else:
        ids = micro[TOPK_IDS_KEY].long()
        if ids.shape[:2] != base.log_probs.shape:
            raise ValueError(
                f"{TOPK_IDS_KEY} has shape {tuple(ids.shape)}, expected (B, T, K) = "
                f"{tuple(base.log_probs.shape)} x K"
            )
        values = vocab_parallel_gather(logits, ids, vocab_size=vocab_size, tp_rank=tp_rank, group=group)
    return LogProbs(base.log_probs, base.entropy, topk_log_probs=values, topk_ids=ids)
