"""Policy losses without a hard clip: SAPO's soft gate and DRO's quadratic log-ratio penalty.

Both are registered policy losses (policy_loss.py has the shared call); shapes: B batch,
T response length.
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


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """f(r) = sigmoid(tau (r - 1)) * 4 / tau: f(1) = 2 / tau and f'(1) = 1 for every tau."""
    return torch.sigmoid(tau * (ratio - 1)) * (4 / tau)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth, temperature-controlled gate on the token ratio instead of PPO's clip.

    Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv 2511.20347), the SAPO objective:
        r_t   = pi_theta(y_t) / pi_old(y_t)
        tau_t = tau_pos if A_t > 0 else tau_neg
        L_t   = -f(r_t; tau_t) A_t,     f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau
    The gradient -A sigmoid'(...) * 4 r grad log pi equals PPO's -A r grad log pi at r = 1 and
    fades smoothly as r leaves 1 (faster for larger tau); the paper's defaults are tau_pos = 1.0,
    tau_neg = 1.05 (negative-advantage updates decay faster). The loss is averaged over each
    sequence's tokens, then over the sequences (the paper's normalisation): like veRL's
    `compute_policy_loss_sapo` (core_algos.py, `sapo`), this loss always aggregates with
    "seq-mean-token-mean" and ignores `loss_agg_mode`. Metrics: pg_clipfrac and
    pg_clipfrac_lower are 0 (nothing is clipped), ppo_kl.

    Extra args:
        tau_pos, tau_neg: the gate temperatures (> 0); actor_rollout_ref.actor.tau_pos / tau_neg
            (or policy_loss.tau_pos / tau_neg).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(
            f"policy loss 'sapo' needs tau_pos > 0 and tau_neg > 0 (the gate divides by them), got "
            f"tau_pos={tau_pos}, tau_neg={tau_neg}; the paper uses 1.0 and 1.05"
        )
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_prob.dtype)
    pg_losses = -sapo_gate(log_ratio.exp(), tau) * advantages
    pg_loss = aggregate_policy_loss(
        pg_losses, response_mask, rollout_is_weights, "seq-mean-token-mean", loss_scale
    )
    no_clip = torch.zeros_like(response_mask, dtype=torch.bool)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=no_clip, ppo_kl=-log_ratio, pg_clipfrac_lower=no_clip
    )


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    dro_beta: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: the policy gradient with a quadratic penalty on the log-ratio to the old policy.

    Direct Reward Optimization as defined by veRL (docs/algo/dro.md, `compute_policy_loss_dro`
    in core_algos.py, loss mode `dro`):
        L_t = -( log pi_theta(y_t) A_t - beta / 2 * (log pi_theta(y_t) - log pi_old(y_t))^2 )
    The penalty is the squared-log-ratio regulariser of offline regularised policy optimisation
    (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language Models
    Alignment", arXiv 2405.19107, the DRO objective, with pi_old as the anchor); its gradient
    pulls pi back towards pi_old in proportion to how far it moved. The log-ratio is not clamped,
    as in veRL. Metrics: pg_clipfrac and pg_clipfrac_lower are 0, ppo_kl.

    Extra args:
        dro_beta: the penalty coefficient beta > 0 (actor_rollout_ref.actor.policy_loss.dro_beta,
            required: veRL's default null is refused too).
    """
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(
            f"policy loss 'dro' needs dro_beta > 0, got {dro_beta}: set "
            "actor_rollout_ref.actor.policy_loss.dro_beta (e.g. 0.1)"
        )
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    no_clip = torch.zeros_like(response_mask, dtype=torch.bool)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=no_clip, ppo_kl=-log_ratio, pg_clipfrac_lower=no_clip
    )
