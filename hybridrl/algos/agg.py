"""Loss aggregation: a (B, T) per-token loss -> the scalar to backpropagate.

One optimizer step consumes a mini-batch that is split over data-parallel ranks and, on each
rank, into micro-batches whose gradients are accumulated. For that to give the gradient of
the un-split mini-batch, every micro-batch must divide by the normaliser of the WHOLE
mini-batch, not its own. `LossScale` carries those global counts; `dp_size` undoes the mean
FSDP/DDP take over ranks. With no LossScale, the local counts of the given mask are used (for
one micro-batch on one rank the two agree).

Modes (N_tok / N_seq: tokens / non-empty sequences of the whole mini-batch, D: dp_size,
L: max_response_length):
    token-mean              sum_{i,t} l_it / N_tok * D
    seq-mean-token-sum      sum_i (sum_t l_it) / N_seq * D
    seq-mean-token-mean     sum_i (mean_t l_it) / N_seq * D
    seq-mean-token-sum-norm sum_{i,t} l_it / (L * N_seq) * D
The last is Dr. GRPO's aggregation (Liu et al. 2025, "Understanding R1-Zero-Like Training",
arXiv 2503.20783, §3.2): each sequence's token sum over a constant L instead of its own
length, removing the length bias; unlike veRL's variant it also averages over sequences.

Gradient-accumulation invariance: with a LossScale holding the global N_tok / N_seq, every
mode is exactly invariant to how the mini-batch is split, because each is a sum over sequences
of a term that depends only on that sequence (seq-mean-token-mean's per-sequence mean is local
to the sequence). seq-mean-token-sum-norm also needs the same L in every micro-batch: pass
`max_response_length`, else L is the padded width of each micro-batch. Without a LossScale,
only equal-sized micro-batches (equal token counts for token-mean) are invariant, after the
caller divides by the number of micro-batches.

Shapes: B batch, T response length.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl.algos.registry import Registry
from hybridrl.algos.utils import masked_mean, masked_sum


@dataclass(frozen=True)
class LossScale:
    """Normalisers of the whole mini-batch of one optimizer step.

    Attributes:
        num_tokens: loss tokens (mask = 1) of the mini-batch over all micro-batches and all
            data-parallel ranks; None = count the given mask.
        num_seqs: sequences with >= 1 loss token, over all micro-batches and ranks; None =
            count the given mask.
        dp_size: data-parallel ranks whose gradients are averaged.
        max_response_length: L of seq-mean-token-sum-norm; None = the mask's width T.
    """

    num_tokens: float | torch.Tensor | None = None
    num_seqs: float | torch.Tensor | None = None
    dp_size: int = 1
    max_response_length: int | None = None

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"LossScale.dp_size must be >= 1, got {self.dp_size}")
        for name in ("num_tokens", "num_seqs", "max_response_length"):
            value = getattr(self, name)
            if isinstance(value, numbers.Number) and value <= 0:
                raise ValueError(
                    f"LossScale.{name} must be > 0, got {value}: an empty mini-batch has no loss "
                    "to normalise; skip the step instead"
                )

    @classmethod
    def from_mask(
        cls, loss_mask: torch.Tensor, *, dp_size: int = 1, max_response_length: int | None = None
    ) -> LossScale:
        """Counts of `loss_mask` (B, T), the whole mini-batch on one rank.

        With several data-parallel ranks, sum `loss_counts(mask)` over ranks (all_reduce) and
        build the LossScale from the summed counts instead.
        """
        num_tokens, num_seqs = loss_counts(loss_mask)
        return cls(num_tokens, num_seqs, dp_size, max_response_length)


def loss_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """(2,) float tensor [loss tokens, sequences with >= 1 loss token] of a (B, T) mask."""
    num_tokens = loss_mask.sum()
    num_seqs = (loss_mask.sum(dim=-1) > 0).sum()
    return torch.stack([num_tokens, num_seqs]).float()


LossAggregator = Callable[[torch.Tensor, torch.Tensor, LossScale], torch.Tensor]
LOSS_AGG_MODES: Registry[LossAggregator] = Registry("loss_agg_mode")
register_loss_agg = LOSS_AGG_MODES.register


def list_loss_agg_modes() -> list[str]:
    """Names accepted by `actor.loss_agg_mode`, sorted."""
    return LOSS_AGG_MODES.names()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    loss_scale: LossScale | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar (see the module docstring for the modes).

    Args:
        loss_mat: (B, T) per-token loss.
        loss_mask: (B, T) 1 for tokens in the loss.
        loss_agg_mode: token-mean, seq-mean-token-sum, seq-mean-token-mean,
            seq-mean-token-sum-norm.
        loss_scale: global normalisers for gradient accumulation; None = local counts.

    Returns:
        () scalar loss.
    """
    return LOSS_AGG_MODES.get(loss_agg_mode)(loss_mat, loss_mask, loss_scale or LossScale())


def _num_tokens(loss_mask: torch.Tensor, scale: LossScale) -> torch.Tensor | float:
    return scale.num_tokens if scale.num_tokens is not None else loss_mask.sum().clamp(min=1)


def _num_seqs(loss_mask: torch.Tensor, scale: LossScale) -> torch.Tensor | float:
    if scale.num_seqs is not None:
        return scale.num_seqs
    return (loss_mask.sum(dim=-1) > 0).sum().clamp(min=1)


@register_loss_agg("token-mean")
def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    return masked_sum(loss_mat, loss_mask) / _num_tokens(loss_mask, scale) * scale.dp_size


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    return masked_sum(loss_mat, loss_mask) / _num_seqs(loss_mask, scale) * scale.dp_size


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    seq_means = masked_mean(loss_mat, loss_mask, axis=-1)  # 0 for sequences without loss tokens
    return seq_means.sum() / _num_seqs(loss_mask, scale) * scale.dp_size


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, scale: LossScale
) -> torch.Tensor:
    norm_length = scale.max_response_length or loss_mask.shape[-1]
    return masked_sum(loss_mat, loss_mask) / (norm_length * _num_seqs(loss_mask, scale)) * scale.dp_size
