"""Sampling for the HF rollout by inverse CDF: one uniform number per row instead of one per token.

`model.generate(do_sample=True)` draws each token with `torch.multinomial(probs, 1)`, which on
CPU draws an exponential random number for every entry of the (B, V) probabilities and takes
argmax(p / q): with a 32k vocabulary and 16 rows that is 0.5M draws per decode step, more work
than the attention of a 100M model (bench/rollout_generation.py measures generation). Inverse-CDF sampling draws from the same distribution with B uniforms:

    p = softmax(warp(logits)),  c_j = sum_{i <= j} p_i  (float64),  u ~ U[0, 1) * c_V,
    token = min { j : c_j > u }

(warp: temperature, top-k, top-p in transformers' order, by transformers' own warpers), so a
token with p_j = 0 is never drawn. `InverseCdfSampler` is a logits processor that draws the
token itself and returns scores that are 0 at it and -inf elsewhere, so `generate` runs with
`do_sample=False` and its argmax takes the drawn token; it records log p(token) of the warped
distribution (the rollout log-probs) per step.

The draws differ from torch.multinomial's for the same seed (same distribution, other random
numbers), so `rollout.hf_sampler: auto` uses it only for vocabularies of at least
`INVERSE_CDF_MIN_VOCAB` tokens, where it pays; `multinomial` / `inverse_cdf` force either.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = [
    "HF_SAMPLERS",
    "INVERSE_CDF_MIN_VOCAB",
    "InverseCdfSampler",
    "sample_inverse_cdf",
    "use_inverse_cdf",
]

HF_SAMPLERS = ("auto", "multinomial", "inverse_cdf")
INVERSE_CDF_MIN_VOCAB = 4096


def use_inverse_cdf(sampler: str, vocab_size: int) -> bool:
    """Whether `rollout.hf_sampler` = `sampler` samples by inverse CDF for this vocabulary."""
    if sampler not in HF_SAMPLERS:
        raise ValueError(f"actor_rollout_ref.rollout.hf_sampler={sampler!r} is not one of {HF_SAMPLERS}")
    return sampler == "inverse_cdf" or (sampler == "auto" and vocab_size >= INVERSE_CDF_MIN_VOCAB)


def sample_inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` (B, V) (rows need not be normalised): (B, 1) int64 ids."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)


class InverseCdfSampler(LogitsProcessor):
    """Draws each row's next token from softmax(warp(scores)); see the module docstring.

    Args:
        temperature: the sampling temperature (1.0: none).
        top_k: keep the k best tokens (0: all).
        top_p: keep the smallest set with mass >= top_p (1.0: all).
        want_log_probs: record log p(token) per step in `log_probs`.
    """

    def __init__(self, temperature: float, top_k: int, top_p: float, want_log_probs: bool) -> None:
        warpers = []
        if temperature is not None and temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p is not None and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        self.warpers = LogitsProcessorList(warpers)
        self.want_log_probs = want_log_probs
        self.log_probs: list[torch.Tensor] = []  # per step, (B,) float32

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(self.warpers(input_ids, scores.float()), dim=-1)  # (B, V)
        token = sample_inverse_cdf(logp.exp())
        if self.want_log_probs:
            self.log_probs.append(logp.gather(1, token)[:, 0])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, token, 0.0)
