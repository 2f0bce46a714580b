"""Supervised fine-tuning loss: masked next-token negative log-likelihood, token mean of the global batch.

A sample is one row of token ids x[0..S-1] with a loss mask m[0..S-1] (1 on the tokens the model
must learn to produce: the response and its EOS, or every assistant turn). Token t is predicted
from the tokens before it, so only t >= 1 can carry loss, and the model's next-token log-probs are
those of the "response" x[1..S-1] (T = S - 1 positions): lp[b, t] = log p(x[b, t+1] | x[b, <=t]).
Any training engine computes them as a log-prob request on `responses = input_ids[:, 1:]`.

One optimizer step sees a global batch split over D data-parallel ranks and, on each rank, into
micro-batches. With N the loss tokens of the whole global batch,

    L = (1 / N) * sum_{b, t >= 1} m[b, t] * -log p(x[b, t] | x[b, <t])

and each micro-batch contributes its own sum divided by the global N (`LossScale.num_tokens`),
so the accumulated gradient is that of L whatever the micro-batching; the engine averages
gradients over the D ranks, so the loss backpropagated is that share times D.

Shapes: B rows, S sequence length, T = S - 1 predicted positions, V vocabulary.
"""

from __future__ import annotations

import torch

from hybridrl.algos.agg import LossScale
from hybridrl.algos.utils import logprobs_from_logits

__all__ = ["next_token_targets", "sft_loss", "sft_nll_sum", "sft_token_loss"]


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """The tokens a causal LM predicts: (B, S) ids -> (B, S-1) ids x[:, 1:] (the engines' `responses`)."""
    return input_ids[:, 1:]


def sft_nll_sum(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the loss tokens.

    Args:
        log_probs: (B, S-1) log p(x[b, t+1] | x[b, <=t]), float32: the log-probs of
            `next_token_targets(input_ids)`.
        loss_mask: (B, S) the dataset's mask over the tokens (its column 0 is never a target).

    Returns:
        () float32: sum_{b, t} -log_probs[b, t] * loss_mask[b, t+1].
    """
    mask = loss_mask[:, 1:].to(torch.float32)
    if log_probs.shape != mask.shape:
        raise ValueError(
            f"log_probs must be (B, S-1) = {tuple(mask.shape)} for a (B, S) loss_mask, got {tuple(log_probs.shape)}"
        )
    return (-log_probs * mask).sum()


def sft_loss(
    log_probs: torch.Tensor, loss_mask: torch.Tensor, loss_scale: LossScale
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's part of the global token-mean NLL, and the loss to backpropagate.

    nll = sft_nll_sum(log_probs, loss_mask) / N, loss = nll * D (N = `loss_scale.num_tokens`, the loss
    tokens of the whole global batch over all ranks and micro-batches; D = `loss_scale.dp_size`, the
    data-parallel ranks the engine averages gradients over). Summing `nll` over the micro-batches and
    ranks of a step gives exactly the step's loss L (see the module docstring).

    Args:
        log_probs: (B, S-1) float32 log-probs of `next_token_targets(input_ids)`.
        loss_mask: (B, S) the dataset's loss mask.
        loss_scale: the global batch's normalisers; its num_tokens must be set (> 0).

    Returns:
        (loss, nll): () tensors; `loss` carries the gradient, `nll` is for the metric.
    """
    if loss_scale.num_tokens is None:
        raise ValueError("sft_loss needs loss_scale.num_tokens: the loss tokens of the whole global batch")
    nll = sft_nll_sum(log_probs, loss_mask) / loss_scale.num_tokens
    return nll * loss_scale.dp_size, nll


def sft_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """`sft_nll_sum` from a model's full logits (B, S, V): logits[:, :-1] scored against input_ids[:, 1:].

    Args:
        logits: (B, S, V) next-token logits.
        input_ids: (B, S) token ids.
        loss_mask: (B, S) 1 on tokens the model must learn to produce.

    Returns:
        () float32: sum over (b, t >= 1) of -log p(input_ids[b, t]) * loss_mask[b, t]; divide by the
        number of loss tokens of the whole (global) batch for the token mean.
    """
    log_probs = logprobs_from_logits(logits[:, :-1].float(), next_token_targets(input_ids))
    return sft_nll_sum(log_probs, loss_mask)
