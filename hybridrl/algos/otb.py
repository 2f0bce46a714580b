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

`compute_tir_optimal_token_baseline_advantage` is the multi-turn form (veRL's
`tir_optimal_token_baseline`): the step index t counts the policy's own tokens, skipping the masked
tool outputs.

`sum_pi_squared` comes from the old-log-prob pass (`actor.calculate_sum_pi_squared=True`),
computed chunk-wise next to the log-probs (engine/lm_head.py), never from full logits.

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
    w_cum = _path_weights(mask, old_log_probs, sum_pi_squared, rollout_is_weights) * mask  # 0 once ended
    groups = Groups.from_index(index, returns.device)
    t = returns.shape[1]
    num = returns.new_zeros(groups.num_groups, t).index_add(0, groups.ids, returns * w_cum)
    den = returns.new_zeros(groups.num_groups, t).index_add(0, groups.ids, w_cum) + epsilon
    baseline = (num / den)[groups.ids]
    baseline = torch.where((groups.size_of_each() > 1)[:, None], baseline, 0.0)
    return (returns - baseline) * mask, returns * mask


def _path_weights(
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> torch.Tensor:
    """W_t = sum_{j <= t} rho_j^2 ||s_j||^2 over the unmasked tokens: (B, T) -> (B, T)."""
    w = 1 - 2 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    return (w * response_mask).cumsum(-1)


def _compact(x: torch.Tensor, slot: torch.Tensor, width: int) -> torch.Tensor:
    """Move each row's unmasked entries to the front: x (B, T), slot (B, T) (k for the k-th unmasked
    token, `width` for masked ones) -> (B, width), zeros after a row's length."""
    out = x.new_zeros(x.shape[0], width + 1).scatter(1, slot, x)
    return out[:, :width]


def _zero_tail(lengths: torch.Tensor, groups: Groups, n_live: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool: positions past the group's second-longest response, on its unique longest one.

    Only that response still runs there, so its baseline would be its own return (advantage ~0);
    veRL's handle_zero_tail sets that baseline to 0 instead.
    """
    lf = lengths.to(torch.float32)
    longest = groups.max(lf)[groups.ids]
    n_longest = groups.sum((lf == longest).to(torch.float32))[groups.ids]
    second = groups.max(torch.where(lf < longest, lf, 0.0))[groups.ids]
    unique = (lf == longest) & (n_longest == 1) & (n_live > 1)
    pos = torch.arange(width, device=lengths.device)
    return unique[:, None] & (pos[None, :] >= second[:, None])


@torch.no_grad()
def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB for tool-integrated (multi-turn) responses: steps count the policy's own tokens.

    In a multi-turn response the tool outputs are masked out, so the t-th position of two
    responses is not the t-th decision of both. This variant takes the module docstring's
    baseline with t = the index of the policy token (the k-th unmasked token of each response):
        B_k = sum_i G_{i,k} W_{i,k} / (sum_i W_{i,k} + eps),     A_{i,k} = G_{i,k} - B_k
    where G_{i,k}, W_{i,k} are the return-to-go and accumulated weight at response i's k-th
    unmasked token, summed over the group's responses that have a k-th token. Responses with no
    unmasked token are left out of their group; a group of one gets no baseline (A = G).
    handle_zero_tail: past the second-longest response of a group its unique longest response is
    alone, so B_k would be its own return; the baseline there is set to 0 (A = G) instead.
    Same numbers as veRL's `compute_multi_turn_optimal_token_baseline_advantage` (core_algos.py,
    `tir_optimal_token_baseline`), whose handle_zero_tail default is also True; on responses
    without holes and with handle_zero_tail=False it equals `compute_optimal_token_baseline_advantage`.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T); 0 on padding and on tool-output tokens.
        index: (B,) prompt uid of each response.
        old_log_probs: (B, T) log pi_old(y_t) of the sampled tokens.
        sum_pi_squared: (B, T) sum_v pi_old(v)^2 at each position.
        rollout_is_weights: (B, T) truncated rollout IS weights rho_t, or None.
        handle_zero_tail: see above.
        epsilon: added to the denominator.

    Returns:
        advantages (B, T), returns (B, T) = G_t; both 0 under the mask (veRL leaves G_t on the
        masked tool tokens of its returns; nothing reads them).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = reward_to_go(token_level_rewards, mask)
    w_cum = _path_weights(mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    lengths = mask.sum(-1).long()
    width = int(lengths.max()) if lengths.numel() else 0
    valid = mask.bool()
    slot = torch.where(valid, mask.cumsum(-1).long() - 1, width)
    g_c = _compact(torch.where(valid, returns, 0.0), slot, width)
    w_c = _compact(torch.where(valid, w_cum, 0.0), slot, width)

    groups = Groups.from_index(index, returns.device)
    n_live = groups.sum((lengths > 0).to(torch.float32))[groups.ids]
    num = g_c.new_zeros(groups.num_groups, width).index_add(0, groups.ids, g_c * w_c)
    den = g_c.new_zeros(groups.num_groups, width).index_add(0, groups.ids, w_c) + epsilon
    baseline = torch.where((n_live > 1)[:, None], (num / den)[groups.ids], 0.0)
    if handle_zero_tail:
        baseline = torch.where(_zero_tail(lengths, groups, n_live, width), 0.0, baseline)
    adv_c = torch.cat([g_c - baseline, g_c.new_zeros(g_c.shape[0], 1)], dim=1)
    advantages = adv_c.gather(1, slot) * mask
    return advantages, returns * mask
