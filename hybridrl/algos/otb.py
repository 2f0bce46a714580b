"""Optimal token baseline (OTB): a per-timestep baseline weighted by the path's score-function norm.

For a response sampled from pi, the score function of token t has squared norm (over the
vocabulary, for a softmax policy's logits)
    ||s_t||^2 = 1 - 2 pi(y_t) + sum_v pi(v)^2,
and the variance-minimising baseline for the return-to-go G_t at step t weights each trajectory
of the prompt group by its accumulated norm W_t = sum_{j <= t} ||s_j||^2:
    B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps),     A_{i,t} = G_{i,t} - B_t
(sums over the responses i of one prompt that are still running at t). With truncated rollout
importance weights rho_t, W_t accumulates rho_t^2 ||s_t||^2 instead (the MSE-optimal weight
under truncated IS). A group of one response has no baseline (A = G).
Li 2025, "Optimal Token Baseline" (blog, richardli.xyz/optimal-token-baseline; veRL
docs/algo/otb.md: B*_t and the "logit-gradient proxy" ||s_t||^2 above), an instance of the
gradient-norm-weighted optimal baseline of Greensmith et al. 2004 (JMLR 5, "Variance Reduction
Techniques for Gradient Estimates in Reinforcement Learning"). Same numbers as veRL's
`optimal_token_baseline` estimator (handle_zero_tail=False, its default).

`sum_pi_squared` comes from the old-log-prob pass (`actor.calculate_sum_pi_squared=True`),
computed chunk-wise next to the log-probs (workers/engine/lm_head.py), never from full logits.

Shapes: B batch, T response length, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrl.algos.groups import Groups


def sum_pi_squared_from_logits(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """sum_v softmax(logits)_v^2, `chunk_size` positions at a time, without a graph.

    Args:
        logits: (..., V).
        chunk_size: positions per chunk (bounds the (chunk, V) temporary).

    Returns:
        (...) float32.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    with torch.no_grad():
        pieces = [torch.exp(2 * torch.log_softmax(c.float(), dim=-1)).sum(-1) for c in flat.split(chunk_size)]
    return torch.cat(pieces).view(logits.shape[:-1])


def reward_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{s >= t} r_s over the unmasked tokens: (B, T) -> (B, T)."""
    return (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)


@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB advantages (the equations of the module docstring), vectorised over the groups.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response.
        old_log_probs: (B, T) log pi_old(y_t) of the sampled tokens.
        sum_pi_squared: (B, T) sum_v pi_old(v)^2 at each position.
        rollout_is_weights: (B, T) truncated rollout IS weights rho_t, or None.
        epsilon: added to the denominator.

    Returns:
        advantages (B, T), returns (B, T) = G_t; both 0 under the mask.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = reward_to_go(token_level_rewards, mask)
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    w_cum = (w * mask).cumsum(-1) * mask  # W_t, 0 once a response has ended
    groups = Groups.from_index(index, returns.device)
    t = returns.shape[1]
    num = returns.new_zeros(groups.num_groups, t).index_add(0, groups.ids, returns * w_cum)
    den = returns.new_zeros(groups.num_groups, t).index_add(0, groups.ids, w_cum) + epsilon
    baseline = (num / den)[groups.ids]
    baseline = torch.where((groups.size_of_each() > 1)[:, None], baseline, 0.0)
    return (returns - baseline) * mask, returns * mask
