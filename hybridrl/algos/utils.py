"""Masked statistics and per-token quantities from logits.

Masks are 0/1 (bool or float): 1 marks a token that counts (a response token the policy
generated), 0 marks padding or, in multi-turn rollouts, tool/environment output. Values under a
0 must be finite; they never change a result.

Shapes: B batch, T response length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1.

    Args:
        values: any shape, e.g. (B, T).
        mask: same shape as `values`.
        axis: dimension to reduce; None reduces all.
    """
    masked = values * mask
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the entries where `mask` is 1 (0 where the mask is empty).

    Args:
        values: any shape, e.g. (B, T).
        mask: same shape as `values`.
        axis: dimension to reduce; None reduces all.
    """
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the entries where `mask` is 1.

    var = sum(mask * (x - mean)^2) / (n - 1) with Bessel's correction (`unbiased`), else / n.

    Args:
        values: any shape, e.g. (B, T).
        mask: same shape as `values`.

    Raises:
        ValueError: if the mask selects fewer than 2 entries with `unbiased` (variance undefined).
    """
    mean = masked_mean(values, mask)
    centered = values - mean
    count = mask.sum()
    if unbiased:
        if count < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 unmasked entries, got {int(count)}; "
                "check that response_mask is not (almost) all zeros"
            )
        return masked_sum(centered**2, mask) / (count - 1)
    return masked_sum(centered**2, mask) / count.clamp(min=1)


def masked_row_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sums for a whitening whose rows live in different processes: (B, T) -> (B, 3)
    float64 columns sum(m x), sum(m x^2), sum(m); `mean_var_from_moments` reduces them."""
    x, m = values.double(), mask.double()
    return torch.stack([(x * m).sum(-1), (x * x * m).sum(-1), m.sum(-1)], dim=-1)


def mean_var_from_moments(moments: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance of the masked entries from `masked_row_moments` rows (B, 3).

    Equals `masked_mean` / `masked_var` up to float rounding (the sums are float64)."""
    s, ss, n = moments.sum(0).tolist()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 unmasked entries, got {n:.0f}")
    mean = s / n
    return mean, max(ss - n * mean * mean, 0.0) / (n - 1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, epsilon: float = 1e-8
) -> torch.Tensor:
    """Standardise `values` with the mean and unbiased variance of the unmasked entries.

    whiten(x) = (x - mean) / sqrt(var + epsilon); with `shift_mean=False` the mean is added back,
    so only the scale changes. Entries under mask 0 are transformed too (callers mask them).

    Args:
        values: any shape, e.g. (B, T).
        mask: same shape as `values`.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    return whitened if shift_mean else whitened + mean


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log pi(label) = logits[label] - logsumexp(logits), through the fused cross-entropy kernel.

    Computed in the dtype of `logits`: pass float32 logits when the log-probs feed an importance
    ratio (bfloat16 log-probs are off by ~1e-2).

    Args:
        logits: (..., V), e.g. (B, T, V).
        labels: (...) integer token ids, e.g. (B, T).

    Returns:
        (...) log-probabilities of `labels`.
    """
    vocab = logits.shape[-1]
    nll = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    return -nll.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits): H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v.

    Args:
        logits: (..., V).

    Returns:
        (...) entropy in nats.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """`entropy_from_logits` over `chunk_size` positions at a time, to bound peak memory.

    The softmax of a chunk ((chunk_size, V) floats) is the largest temporary. With autograd on,
    each chunk is recomputed in the backward pass (activation checkpointing) instead of being
    kept, so the backward memory is bounded by one chunk too. Same result as the unchunked
    function up to float rounding.

    Args:
        logits: (..., V).
        chunk_size: positions per chunk.

    Returns:
        (...) entropy in nats.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    keep_graph = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for chunk in flat.split(chunk_size, dim=0):
        if keep_graph:
            pieces.append(checkpoint(entropy_from_logits, chunk, use_reentrant=False))
        else:
            pieces.append(entropy_from_logits(chunk))
    return torch.cat(pieces).view(logits.shape[:-1])
