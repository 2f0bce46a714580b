"""Advantages from per-token returns: GAE, REINFORCE++, ReMax.

Multi-turn convention shared by every function here: a token with response_mask 0 (padding, or
tool/environment output spliced into a multi-turn response) is not an action. The recursions
carry their running quantities across such tokens unchanged, its reward and value are ignored,
and its advantage and return are 0.

Shapes: B batch, T response length.
"""

from __future__ import annotations

import torch

from hybridrl.algos.utils import masked_whiten


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", eq. 16 (GAE(gamma, lam) as a sum of TD residuals), computed backwards:
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t        (the critic's regression target)
    V_{t+1} and A_{t+1} are those of the next unmasked token (0 after the last one). The
    advantages are then whitened over the mask; the returns are not.

    Args:
        token_level_rewards: (B, T) reward of each token (outcome reward on the last one, minus
            any per-token KL penalty).
        values: (B, T) critic values V(s_t).
        response_mask: (B, T) 1 for tokens the policy generated.
        gamma: discount factor.
        lam: GAE lambda (bias/variance trade-off).

    Returns:
        advantages: (B, T) whitened A_t, 0 under the mask.
        returns: (B, T) R_t, 0 under the mask.
    """
    advantages, returns = gae_before_whitening(token_level_rewards, values, response_mask, gamma, lam)
    advantages = masked_whiten(advantages, response_mask)
    return advantages * response_mask, returns * response_mask


@torch.no_grad()
def gae_before_whitening(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-response part of `compute_gae_advantage_return`: A_t and R_t = A_t + V_t of eq. 16,
    before whitening and masking. Each row needs only its own tensors (no view of the batch).

    Args:
        token_level_rewards: (B, T).
        values: (B, T).
        response_mask: (B, T).
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        advantages, returns: (B, T) each.
    """
    is_action = response_mask.bool()
    nextvalues = values.new_zeros(values.shape[0])
    lastgaelam = values.new_zeros(values.shape[0])
    advantages_reversed = []
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        gae_t = delta + gamma * lam * lastgaelam
        nextvalues = torch.where(is_action[:, t], values[:, t], nextvalues)
        lastgaelam = torch.where(is_action[:, t], gae_t, lastgaelam)
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


@torch.no_grad()
def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Return-to-go G_t = sum_{k >= t, mask_k = 1} gamma^(#actions between t and k) * r_k.

    Sutton & Barto 2018, eq. 3.8, over the unmasked tokens only.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        gamma: discount factor.

    Returns:
        (B, T) G_t, 0 under the mask.
    """
    is_action = response_mask.bool()
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    returns_reversed = []
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(is_action[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns_reversed.append(running)
    return torch.stack(returns_reversed[::-1], dim=1) * response_mask


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go, normalised over the whole batch.

    Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262), §3 (advantage = return-to-go with the KL
    penalty folded into the token rewards; global-batch advantage normalisation):
        G_t = r_t + gamma * G_{t+1}
        A_t = (G_t - mean(G)) / std(G)      mean/std over every unmasked token of the batch

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        gamma: discount factor.

    Returns:
        advantages: (B, T) whitened G_t, 0 under the mask.
        returns: (B, T) G_t, 0 under the mask.
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: REINFORCE with the greedy response's reward as baseline.

    Li et al. 2023, "ReMax" (arXiv 2310.10505), Algorithm 1 (baseline = greedy reward):
        G_t = sum_{k >= t} r_k            (undiscounted return-to-go)
        A_t = G_t - r(x, greedy response)

    Args:
        token_level_rewards: (B, T).
        reward_baselines: (B,) score of the greedy (argmax-decoded) response to each prompt.
        response_mask: (B, T).

    Returns:
        advantages: (B, T), 0 under the mask.
        returns: (B, T) G_t, 0 under the mask.
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma=1.0)
    advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns
