"""DPPO: a trust region on the policy divergence instead of on the probability ratio.

Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv 2602.04879).
PPO's ratio clip r = pi / pi_old over-restrains rare tokens (a small change of a small probability
is a large ratio) and under-restrains likely ones. DPPO keeps the policy-gradient term of a token
only while an estimate of the divergence between pi_old and pi at that step stays inside the
trust region, in the direction the advantage pushes; outside it the token gets no gradient (a
mask, not a clip). The "Binary" estimates compare the two-outcome distributions {y_t, not y_t}
(the sampled token against all the others), so they need only the sampled token's probabilities
p = pi(y_t) and q = pi_old(y_t):
    TV:  p - q                                   (signed; |p - q| is the binary total variation)
    KL:  q log(q / p) + (1 - q) log((1 - q) / (1 - p))
and the per-token loss is the truncated-IS policy gradient
    L_t = -A_t * sg(min(r_t, c)) * log pi(y_t) * M_t
whose gradient is PPO's unclipped -A r grad log pi where the mask M_t is 1 and r_t <= c.
`clip_ratio_low` / `clip_ratio_high` (default `clip_ratio`) are the divergence bounds for the
A <= 0 and A > 0 tokens; `clip_ratio_c` is the truncation c (veRL's DPPO scripts set it very
large, 10000, to avoid the truncation bias; None: no truncation).

Same numbers as veRL's `compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl`
(core_algos.py, loss modes `dppo_tv` / `dppo_kl`). Metrics: pg_clipfrac (tokens masked out),
pg_clipfrac_lower (kept tokens whose ratio exceeds c), ppo_kl.

Shapes: B batch, T response length.
"""

from __future__ import annotations

import torch

from hybridrl.algos.agg import LossScale
from hybridrl.algos.policy_loss import (
    aggregate_policy_loss,
    clamped_log_ratio,
    register_policy_loss,
    token_metrics,
)

BINARY_KL_EPS = 1e-8  # keeps log((1 - q) / (1 - p)) finite when a probability reaches 1


def _bounds(name: str, clip_ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    if low < 0 or high < 0:
        raise ValueError(
            f"policy loss {name!r}: clip_ratio_low={low} and clip_ratio_high={high} are divergence bounds "
            "of the trust region and must be >= 0 (actor_rollout_ref.actor.clip_ratio_low / clip_ratio_high)"
        )
    return low, high


def binary_tv(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """Signed binary total variation pi(y_t) - pi_old(y_t): (B, T) -> (B, T)."""
    return log_prob.exp() - old_log_prob.exp()


def binary_kl(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """KL(pi_old || pi) of the two-outcome distributions {y_t, not y_t}: (B, T) -> (B, T)."""
    p, q = log_prob.exp(), old_log_prob.exp()
    rest = torch.log((1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))
    return q * (old_log_prob - log_prob) + (1 - q) * rest


def _masked_pg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    keep: torch.Tensor,
    clip_ratio_c: float | None,
    rollout_is_weights: torch.Tensor | None,
    loss_agg_mode: str,
    loss_scale: LossScale | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-A sg(min(r, c)) log pi on the kept tokens, aggregated; the shared half of both losses."""
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    truncated = ratio if clip_ratio_c is None else ratio.clamp(max=clip_ratio_c)
    keep = keep.detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated.detach() * log_prob * keep
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    over_c = torch.zeros_like(keep, dtype=torch.bool) if clip_ratio_c is None else ratio > clip_ratio_c
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=1 - keep, ppo_kl=-log_ratio, pg_clipfrac_lower=over_c & keep.bool()
    )


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (module docstring): a token is kept while
        A > 0:  pi(y_t) - pi_old(y_t) <= clip_ratio_high
        A <= 0: pi(y_t) - pi_old(y_t) >= -clip_ratio_low
    i.e. the step has not yet moved the sampled token's probability past the TV bound in the
    direction the advantage asks for.
    """
    low, high = _bounds("dppo_tv", clip_ratio, clip_ratio_low, clip_ratio_high)
    tv = binary_tv(log_prob, old_log_prob)
    keep = torch.where(advantages > 0, tv <= high, tv >= -low)
    return _masked_pg(
        old_log_prob, log_prob, advantages, response_mask, keep, clip_ratio_c,
        rollout_is_weights, loss_agg_mode, loss_scale,
    )  # fmt: skip


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (module docstring): a token is kept while
        A > 0:  KL_bin <= clip_ratio_high or pi(y_t) <= pi_old(y_t)
        A <= 0: KL_bin <= clip_ratio_low  or pi(y_t) >= pi_old(y_t)
    (the KL is unsigned, so the direction comes from comparing the probabilities: a token the
    step moved against the advantage is never masked).
    """
    low, high = _bounds("dppo_kl", clip_ratio, clip_ratio_low, clip_ratio_high)
    kl = binary_kl(log_prob, old_log_prob)
    p_up, p_down = log_prob >= old_log_prob, log_prob <= old_log_prob
    keep = torch.where(advantages > 0, (kl <= high) | p_down, (kl <= low) | p_up)
    return _masked_pg(
        old_log_prob, log_prob, advantages, response_mask, keep, clip_ratio_c,
        rollout_is_weights, loss_agg_mode, loss_scale,
    )  # fmt: skip
