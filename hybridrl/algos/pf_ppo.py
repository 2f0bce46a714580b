"""Policy-filtered PPO (PF-PPO): resample the batch towards responses with reliable rewards.

Zhang et al. 2025, "Policy Filtration for RLHF to Mitigate Noise in Reward Models"
(arXiv 2409.06957), §4: responses whose reward is extreme (high or low) are the ones the reward
model scores reliably, so the batch used for the update is redrawn, with replacement, with
probabilities given by a weight of each response's score s_i = sum_t score_{i,t}:
    pow         w_i = |s_i| ^ weight_pow
    max_min     w_i = 1 if s_i is the batch's max or min score, else 0
    max_random  w_i = 0.4 if s_i is the batch's max score, else 0.1
    p_i = max(w_i + 1e-8, 1e-8) / sum_j max(w_j + 1e-8, 1e-8)
The same numbers as veRL's `compute_pf_ppo_reweight_data` (B draws from torch.multinomial).

Shapes: B batch, T response length.
"""

from __future__ import annotations

import torch

PF_PPO_WEIGHT_FLOOR = 1e-8


def pf_ppo_weights(
    scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0
) -> torch.Tensor:
    """Unnormalised resampling weights of the B responses (the formulas of the module docstring).

    Args:
        scores: (B,) outcome score of each response.
        reweight_method: pow, max_min or max_random.
        weight_pow: the exponent of `pow`.

    Returns:
        (B,) weights >= 1e-8.
    """
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        extreme = (scores == scores.max()) | (scores == scores.min())
        weights = torch.where(extreme, 1.0, 0.0).to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(
            f"unknown pf_ppo.reweight_method {reweight_method!r}; use pow, max_min or max_random"
        )
    return (weights + PF_PPO_WEIGHT_FLOOR).clamp(min=PF_PPO_WEIGHT_FLOOR)


@torch.no_grad()
def pf_ppo_resample_indices(
    token_level_scores: torch.Tensor,
    *,
    reweight_method: str = "pow",
    weight_pow: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Rows of the resampled batch: B draws with replacement, P(row i) proportional to w_i.

    Args:
        token_level_scores: (B, T) reward of each token (the outcome reward on the last one).
        reweight_method, weight_pow: see `pf_ppo_weights`.
        generator: the random source (None: torch's global generator, as veRL).

    Returns:
        (B,) long row indices into the batch.
    """
    scores = token_level_scores.sum(dim=-1)
    weights = pf_ppo_weights(scores, reweight_method, weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
