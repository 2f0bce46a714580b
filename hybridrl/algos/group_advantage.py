"""Outcome advantages relative to the other responses to the same prompt.

Every estimator here scores a response by its total reward s_i = sum_t r_{i,t} (the outcome
reward sits on the last token), compares it with the other responses sharing its uid, and
gives every token of the response the same advantage. Advantages and returns are equal and 0
under the mask. Groups of one response have no peers: their baseline is 0 (and their std 1).

The GRPO and RLOO loop versions (`*_loop`) are the obvious per-group Python code and are kept as
the reference the vectorised versions are tested against; the registry uses the vectorised ones.

Shapes: B batch, T response length, G group size.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from hybridrl.algos.groups import Groups
from hybridrl.algos.utils import masked_sum, masked_whiten


def outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """s_i = sum of the rewards of response i's unmasked tokens: (B, T) -> (B,)."""
    return masked_sum(token_level_rewards, response_mask, axis=-1)


def _per_token(per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Give every unmasked token its response's value: (B,) -> (B, T)."""
    return per_response.unsqueeze(-1) * response_mask


def _group_mean_or_zero(scores: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(B,) mean of each response's group, 0 for groups of one."""
    mean = groups.mean(scores)[groups.ids]
    return torch.where(groups.size_of_each() > 1, mean, 0.0)


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-normalised outcome advantage (vectorised).

    Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), §4.1.2 "Outcome supervision":
        A_i = (s_i - mean_G(s)) / (std_G(s) + epsilon)     std unbiased (n - 1)
    With norm_adv_by_std_in_grpo=False: A_i = s_i - mean_G(s), Dr. GRPO (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", arXiv 2503.20783, §3.2, which drops the std term).

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response.
        epsilon: added to the std (all-equal groups have std 0).
        norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr. GRPO).

    Returns:
        advantages, returns: (B, T) each, equal.
    """
    scores = outcome_scores(token_level_rewards, response_mask)
    per_response = grpo_response_advantages(scores, index, epsilon, norm_adv_by_std_in_grpo)
    advantages = _per_token(per_response, response_mask)
    return advantages, advantages


def grpo_response_advantages(
    scores: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True
) -> torch.Tensor:
    """The per-response half of `compute_grpo_outcome_advantage`: A_i from the outcome scores.

    Needs only the (B,) scores and uids, so a controller that keeps the (B, T) tensors on its
    workers computes it and sends A_i back for `broadcast_to_tokens` there.

    Args:
        scores: (B,) s_i (`outcome_scores`).
        index: (B,) prompt uid of each response.

    Returns:
        (B,) A_i.
    """
    groups = Groups.from_index(index, scores.device)
    return _grpo_of_scores(scores, groups, epsilon, norm_adv_by_std_in_grpo)


def broadcast_to_tokens(per_response: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Every unmasked token gets its response's value: (B,) -> (B, T)."""
    return _per_token(per_response, response_mask)


def _grpo_of_scores(scores: torch.Tensor, groups: Groups, epsilon: float, norm_by_std: bool) -> torch.Tensor:
    """(s_i - mean_G(s)) [/ (std_G(s) + epsilon)] per response: (B,) -> (B,); groups of one: mean 0, std 1."""
    n = groups.size_of_each()
    mean = _group_mean_or_zero(scores, groups)
    var = groups.sum((scores - mean) ** 2)[groups.ids] / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), 1.0)
    advantages = scores - mean
    return advantages / (std + epsilon) if norm_by_std else advantages


@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    reward_components: torch.Tensor | None = None,
    reward_weights: list[float] | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: normalise each reward component within its group, sum them, whiten over the batch.

    Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization" (arXiv 2601.05242), the GDPO advantage (§3): with K reward
    components s^k_i of response i (e.g. accuracy, format),
        A^k_i = (s^k_i - mean_G(s^k)) / (std_G(s^k) + epsilon)     GRPO on each component alone
        A'_i  = sum_k w_k A^k_i                                      w_k = 1 by default
        A_i   = (A'_i - mean_batch(A')) / std_batch(A')              over every unmasked token
    so a large, easy component cannot drown the others (GRPO on sum_k s^k collapses distinct
    component combinations onto one advantage). Same numbers as veRL's
    `compute_gdpo_outcome_advantage` (core_algos.py, `gdpo`): there each component's score is put
    on the response's last token and summed back; here it is given per response. A response with
    no unmasked token still counts in its group's mean and std (as in veRL) and gets advantage 0.
    Without components (None) the one component is the total reward sum_t r_t over the unmasked
    tokens, i.e. whitened GRPO.

    Args:
        token_level_rewards: (B, T); only used when reward_components is None.
        response_mask: (B, T).
        index: (B,) prompt uid of each response.
        reward_components: (K, B) the K component scores of each response (veRL:
            algorithm.gdpo_reward_keys, read from the reward function's extra outputs), or None.
        reward_weights: K weights w_k (algorithm.gdpo_reward_weights); None: all 1.
        epsilon: added to each group std.
        norm_adv_by_std_in_grpo: divide by the group std (False: centre only, as Dr. GRPO).

    Returns:
        advantages, returns: (B, T) each, equal, 0 under the mask.
    """
    if reward_components is None:
        components = outcome_scores(token_level_rewards, response_mask).unsqueeze(0)
    else:
        components = reward_components.to(token_level_rewards.dtype)
    if components.dim() != 2 or components.shape[1] != response_mask.shape[0]:
        raise ValueError(
            f"reward_components must have shape (K, B) = (K, {response_mask.shape[0]}), got {tuple(components.shape)}"
        )
    num = components.shape[0]
    weights = [1.0] * num if reward_weights is None else list(reward_weights)
    if len(weights) != num:
        raise ValueError(
            f"got {len(weights)} reward weights for {num} reward components; give one weight per component "
            "(algorithm.gdpo_reward_weights and algorithm.gdpo_reward_keys must have the same length)"
        )
    groups = Groups.from_index(index, components.device)
    summed = sum(
        w * _grpo_of_scores(c, groups, epsilon, norm_adv_by_std_in_grpo) for w, c in zip(weights, components)
    )
    advantages = masked_whiten(_per_token(summed, response_mask), response_mask) * response_mask
    return advantages, advantages


def _members_by_uid(index: np.ndarray) -> dict[object, list[int]]:
    members: dict[object, list[int]] = defaultdict(list)
    for row, uid in enumerate(index):
        members[uid].append(row)
    return members


@torch.no_grad()
def compute_grpo_outcome_advantage_loop(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference loop version of `compute_grpo_outcome_advantage` (same equation, same result)."""
    scores = outcome_scores(token_level_rewards, response_mask)
    advantages = torch.empty_like(scores)
    for rows in _members_by_uid(index).values():
        group = scores[rows]
        if len(rows) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = group.mean(), group.std()
        advantages[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
    advantages = _per_token(advantages, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: REINFORCE with the mean of the other responses as baseline (vectorised).

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics" (arXiv 2402.14740), §3.3 (the RLOO estimator):
        A_i = s_i - 1/(G-1) * sum_{j != i} s_j

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response.

    Returns:
        advantages, returns: (B, T) each, equal.
    """
    scores = outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.device)
    n = groups.size_of_each()
    others_sum = groups.sum(scores)[groups.ids] - scores
    baseline = torch.where(n > 1, others_sum / (n - 1).clamp(min=1), 0.0)
    advantages = _per_token(scores - baseline, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage_loop(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference loop version of `compute_rloo_outcome_advantage` (same equation, same result)."""
    scores = outcome_scores(token_level_rewards, response_mask)
    advantages = torch.empty_like(scores)
    for rows in _members_by_uid(index).values():
        for i in rows:
            others = [j for j in rows if j != i]
            baseline = scores[others].mean() if others else 0.0
            advantages[i] = scores[i] - baseline
    advantages = _per_token(advantages, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean, then normalise over the whole batch.

    Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262), §3 "REINFORCE++ w/ baseline":
        A'_i = s_i - mean_G(s)
        A_i  = (A'_i - mean_batch(A')) / std_batch(A')     over every unmasked token

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response.

    Returns:
        advantages, returns: (B, T) each, equal.
    """
    scores = outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.device)
    centered = _per_token(scores - _group_mean_or_zero(scores, groups), response_mask)
    advantages = masked_whiten(centered, response_mask) * response_mask
    return advantages, advantages


@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: length-weighted group mean as the optimal baseline.

    Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline" (arXiv 2505.23585), the
    optimal baseline for sequence-level rewards:
        b = sum_j |o_j| s_j / sum_j |o_j|,   A_i = s_i - b

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response.

    Returns:
        advantages, returns: (B, T) each, equal.
    """
    scores = outcome_scores(token_level_rewards, response_mask)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    groups = Groups.from_index(index, scores.device)
    weighted = groups.sum(lengths * scores) / groups.sum(lengths).clamp(min=1)
    baseline = torch.where(groups.size_of_each() > 1, weighted[groups.ids], 0.0)
    advantages = _per_token(scores - baseline, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: group-centred reward, rescaled for the responses that carry no gradient.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv 2504.02546), "accurate gradient estimation" (AGE):
        A_i   = alpha * (s_i - mean_G(s)) / F_norm
        alpha = B / (B - M)
    M counts the responses in groups (of >= 2) whose rewards are all equal: their advantage is
    0, so without alpha they would dilute the batch-mean gradient. (veRL instead takes M from
    the number of zero scores.)

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response.
        f_norm: the constant F_norm.

    Returns:
        advantages, returns: (B, T) each, equal.
    """
    scores = outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.device)
    group_max, group_min = groups.max(scores), -groups.max(-scores)
    no_signal = (group_max == group_min)[groups.ids] & (groups.size_of_each() > 1)
    batch_size = scores.shape[0]
    alpha = batch_size / (batch_size - no_signal.sum()).clamp(min=1)
    advantages = alpha * (scores - _group_mean_or_zero(scores, groups)) / f_norm
    advantages = _per_token(advantages, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage: how much the group's best score drops without response i.

    Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using
    Reinforcement Learning" (arXiv 2503.19595), leave-one-out estimator of the pass@k objective
    max_j s_j:
        A_i = max_j s_j - max_{j != i} s_j
    Only a strictly best response gets a non-zero advantage (best minus second best); ties give
    0. Optionally divided by (group std + epsilon) as in GRPO.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) prompt uid of each response; every group needs >= 2 responses.
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        advantages, returns: (B, T) each, equal.
    """
    _, counts = np.unique(np.asarray(index), return_counts=True)
    if counts.min() < 2:
        raise ValueError(
            "grpo_passk compares each response with the rest of its group and needs >= 2 "
            f"responses per prompt, got a group of {counts.min()}; set the rollout n >= 2"
        )
    scores = outcome_scores(token_level_rewards, response_mask)
    groups = Groups.from_index(index, scores.device)
    best = groups.max(scores)[groups.ids]
    is_best = scores == best
    unique_best = is_best & (groups.sum(is_best.to(scores.dtype))[groups.ids] == 1)
    second_best = groups.max(torch.where(is_best, -torch.inf, scores))[groups.ids]
    advantages = torch.where(unique_best, best - second_best, 0.0)
    if norm_adv_by_std_in_grpo:
        mean = groups.mean(scores)[groups.ids]
        std = (groups.sum((scores - mean) ** 2)[groups.ids] / (groups.size_of_each() - 1)).sqrt()
        advantages = advantages / (std + epsilon)
    advantages = _per_token(advantages, response_mask)
    return advantages, advantages
