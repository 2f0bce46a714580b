"""Log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits (..., V / tp) for its slice of the (padded) vocabulary.
Three all-reduces over the TP group (max, sum of exp, and one packed sum) give, per position,
the log-sum-exp, the target's logit and sum_v p_v * l_v, hence

    log_prob = l_target - lse,    entropy = lse - sum_v p_v l_v.

The backward needs no communication: d log_prob / d l_v = onehot_v - p_v and
d entropy / d l_v = p_v (sum_u p_u l_u - l_v), both local to the slice. Vocabulary rows added to
make V divisible by tp are masked to the lowest finite value (they never receive probability or gradient), so the
results equal a softmax over the real vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs_entropy"]


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        v_local = logits.shape[-1]
        local_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        in_slice = (target >= vocab_start) & (target < vocab_start + v_local)
        local_idx = (target - vocab_start).clamp(0, v_local - 1)
        target_shifted = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_slice
        sums = torch.stack([exp.sum(-1), target_shifted, (exp * shifted).sum(-1)])
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, tgt, sum_exp_l = sums[0], sums[1], sums[2]
        log_z = sum_exp.log()
        probs = exp / sum_exp.unsqueeze(-1)
        mean_l = sum_exp_l / sum_exp  # sum_v p_v * shifted_v
        log_prob = tgt - log_z
        entropy = log_z - mean_l
        ctx.save_for_backward(probs, shifted, mean_l, local_idx, in_slice)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        probs, shifted, mean_l, local_idx, in_slice = ctx.saved_tensors
        grad = -probs * grad_lp.unsqueeze(-1)
        onehot = torch.zeros_like(probs).scatter_(
            -1, local_idx.unsqueeze(-1), in_slice.unsqueeze(-1).to(probs.dtype)
        )
        grad = grad + onehot * grad_lp.unsqueeze(-1)
        grad = grad + probs * (mean_l.unsqueeze(-1) - shifted) * grad_ent.unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, vocab_size: int, tp_rank: int = 0, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `target` and entropy under softmax(logits) over the real vocabulary.

    Args:
        logits: (..., V_local) float32, this rank's slice of the padded vocabulary.
        target: (...) int64 token ids (global ids).
        vocab_size: the real vocabulary size (padded columns beyond it are masked).
        tp_rank / group: this rank's TP index and the TP process group (None: no TP).

    Returns:
        (log_prob, entropy), each (...) float32; both differentiable w.r.t. `logits`.
    """
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    if start + v_local > vocab_size:
        cols = torch.arange(start, start + v_local, device=logits.device)
        # the dtype's lowest finite value, not -inf: exp gives 0 and 0 * value stays finite
        logits = logits.masked_fill(cols >= vocab_size, torch.finfo(logits.dtype).min)
    return _VocabParallelLogProbEntropy.apply(logits, target, start, group)
