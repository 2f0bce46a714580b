"""Policy losses: the `actor.policy_loss.loss_mode` plug point.

Every registered loss is called the same way:

    pg_loss, metrics = get_policy_loss_fn(name)(
        old_log_prob,            # (B, T) log pi_old of the sampled tokens (before this update)
        log_prob,                # (B, T) log pi_theta, with gradient
        advantages,              # (B, T)
        response_mask,           # (B, T)
        loss_agg_mode="token-mean",
        loss_scale=None,         # LossScale with the mini-batch's global counts (agg.py)
        rollout_is_weights=None, # (B, T) detached rollout-vs-training importance weights
        **hparams,               # clip_ratio, clip_ratio_low, ..., each loss reads its own
    )

`metrics` always holds pg_clipfrac, ppo_kl and pg_clipfrac_lower (0-d detached tensors;
ppo_kl = mean(log pi_old - log pi), an estimate of KL(pi_old || pi)), plus extras per loss.
`rollout_is_weights`, when given, multiply the per-token loss before aggregation.

Shapes: B batch, T response length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrl.algos.agg import LossScale, agg_loss
from hybridrl.algos.registry import Registry
from hybridrl.algos.utils import masked_mean

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register

LOG_RATIO_BOUND = 20.0  # |log pi - log pi_old| is clamped here before exp() so ratios stay finite


def get_policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered under `name` (ValueError listing the known names otherwise)."""
    return POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    """Names accepted by `actor.policy_loss.loss_mode`, sorted."""
    return POLICY_LOSSES.names()


# ----------------------------------------------------------------------------- shared pieces


def _clip_range(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """(epsilon_low, epsilon_high); each falls back to clip_ratio."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if not (0 <= low < 1 and high >= 0):
        raise ValueError(
            f"clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got low={low}, "
            f"high={high}; the ratio is clipped to [1 - low, 1 + high]"
        )
    return low, high


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float, clip_ratio_c: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped loss with optional dual clip.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, with asymmetric
    bounds (DAPO "clip-higher", Yu et al. 2025, arXiv 2503.14476, §3.1):
        L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", dual-clip PPO):
    for A < 0 the loss is also capped at -A c, bounding the step on a very large ratio.

    Returns:
        pg_losses (B, T); clipped (B, T) bool; dual_clipped (B, T) bool.
    """
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - low, 1 + high)
    clip_pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipped = pg_losses2 > pg_losses1
    if clip_ratio_c is None:
        return clip_pg_losses, clipped, torch.zeros_like(clipped)
    if clip_ratio_c <= 1:
        raise ValueError(
            f"clip_ratio_c must be > 1, got {clip_ratio_c}: dual-clip caps the loss of negative-advantage "
            "tokens at -A * clip_ratio_c, above the 1 + clip_ratio band; use e.g. 3.0, or None to disable"
        )
    pg_losses3 = -advantages * clip_ratio_c
    negative = advantages < 0
    dual_clipped = negative & (clip_pg_losses > pg_losses3)
    pg_losses = torch.where(negative, torch.minimum(clip_pg_losses, pg_losses3), clip_pg_losses)
    return pg_losses, clipped, dual_clipped


def aggregate_policy_loss(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    loss_agg_mode: str,
    loss_scale: LossScale | None,
) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale=loss_scale)


def token_metrics(response_mask: torch.Tensor, **per_token: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked token means of per-token diagnostics, detached."""
    return {name: masked_mean(value.detach().float(), response_mask) for name, value in per_token.items()}


def _k_smallest(priority: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, T) bool marking the k entries of `priority` with the smallest values (k: 0-d tensor)."""
    rank = priority.flatten().argsort().argsort().view(priority.shape)
    return rank < k


def _token_covariance(
    advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token covariance term (A - mean A)(log pi - mean log pi), means over the mask (Cui et al. 2025)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob, response_mask)
    )


# ----------------------------------------------------------------------------- the losses


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
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
    """PPO clipped surrogate, asymmetric clip (clip-higher) and dual clip: see `_ppo_clip`.

    r = pi_theta / pi_old per token. Metrics: pg_clipfrac (tokens where the clip binds),
    pg_clipfrac_lower (negative-advantage tokens where the dual clip binds), ppo_kl.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    pg_losses, clipped, dual_clipped = _ppo_clip(log_ratio.exp(), advantages, low, high, clip_ratio_c)
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=clipped, ppo_kl=-log_ratio, pg_clipfrac_lower=dual_clipped
    )


@register_policy_loss("decoupled")
def compute_policy_loss_decoupled(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    behave_log_prob: torch.Tensor | None = None,
    behave_imp_weight_cap: float | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO for asynchronous (stale) rollouts.

    Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
    Language Reasoning" (arXiv 2505.24298), the decoupled PPO objective: the trust region is
    centred on the proximal policy pi_prox (here `old_log_prob`, recomputed by the trainer just
    before the update), and the behaviour policy pi_behav that generated the tokens (possibly
    several versions older) enters only through an importance weight:
        w = pi_prox / pi_behav,   u = pi_theta / pi_prox
        L = w * max(-A u, -A clip(u, 1 - eps_low, 1 + eps_high))   (+ dual clip as in vanilla)
    Tokens with w > behave_imp_weight_cap are dropped (weight 0); they still count in the
    token-mean denominator, as in AReaL.

    Extra args:
        behave_log_prob: (B, T) log pi_behav, the rollout engine's log-probs.
        behave_imp_weight_cap: drop tokens whose w exceeds it; None keeps all.

    Extra metrics: behave_imp_weight (mean w over kept tokens), behave_kl (mean of
    log pi_behav - log pi_prox over kept tokens), behave_mask_frac (fraction dropped).
    """
    if behave_log_prob is None:
        raise ValueError(
            "policy loss 'decoupled' needs behave_log_prob (B, T), the log-probs the rollout engine "
            "returned for the sampled tokens; enable rollout log-probs or use loss_mode 'vanilla'"
        )
    behave_log_ratio = (old_log_prob - behave_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).detach()
    behave_imp_weight = behave_log_ratio.exp()
    kept = response_mask.bool()
    if behave_imp_weight_cap is not None:
        kept = kept & (behave_imp_weight <= behave_imp_weight_cap)
    behave_imp_weight = torch.where(kept, behave_imp_weight, 0.0)

    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    pg_losses, clipped, dual_clipped = _ppo_clip(log_ratio.exp(), advantages, low, high, clip_ratio_c)
    pg_losses = pg_losses * behave_imp_weight
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)

    metrics = token_metrics(
        response_mask, pg_clipfrac=clipped, ppo_kl=-log_ratio, pg_clipfrac_lower=dual_clipped
    )
    metrics.update(token_metrics(kept, behave_imp_weight=behave_imp_weight, behave_kl=-behave_log_ratio))
    metrics.update(token_metrics(response_mask, behave_mask_frac=response_mask.bool() & ~kept))
    return pg_loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
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
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: clip a sequence-level ratio, the geometric mean of the token ratios.

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071), GSPO-token form:
        s_i     = exp(mean_t (log pi_theta - log pi_old))              sequence ratio
        s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]          value s_i, gradient of s_i
        L       = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high))
    The paper averages over tokens within a sequence, then over sequences: use
    loss_agg_mode="seq-mean-token-mean" (and clip ratios ~3e-4 / 4e-4) to match it.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, axis=-1)
    log_token_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = log_token_ratio.clamp(max=10.0).exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    return pg_loss, token_metrics(
        response_mask,
        pg_clipfrac=pg_losses2 > pg_losses1,
        ppo_kl=-log_ratio,
        pg_clipfrac_lower=torch.zeros_like(response_mask, dtype=torch.bool),
    )


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG: plain policy gradient, no ratio, no clip.

    Chu et al. 2025, "GPG" (arXiv 2504.02546): L = -A log pi_theta(y_t), i.e. the
    REINFORCE estimator (Williams 1992) with GPG's group advantages.
    """
    pg_losses = -advantages * log_prob
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    no_clip = torch.zeros_like(response_mask, dtype=torch.bool)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=no_clip, ppo_kl=old_log_prob - log_prob, pg_clipfrac_lower=no_clip
    )


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
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
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO clip, plus no gradient for a few random high-covariance tokens.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv 2505.22617), "Clip-Cov": entropy collapses through tokens whose
    Cov(log pi, A) is large. Among the tokens the PPO clip leaves alone whose covariance term
    lies in (clip_cov_lb, clip_cov_ub), floor(clip_cov_ratio * #tokens) (at least 1) are drawn
    at random and removed from the loss. `generator` (on any device) makes the draw reproducible.

    Metrics: pg_clipfrac is the fraction of tokens removed.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - low, 1 + high)
    clipped = pg_losses2 > pg_losses1

    with torch.no_grad():
        cov = _token_covariance(advantages, log_prob, response_mask)
        candidate = response_mask.bool() & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        num_removed = (clip_cov_ratio * response_mask.sum()).floor().clamp(min=1)
        draw_device = cov.device if generator is None else generator.device
        priority = torch.rand(cov.shape, generator=generator, device=draw_device).to(cov.device)
        removed = candidate & _k_smallest(torch.where(candidate, priority, 2.0), num_removed)

    pg_losses = torch.where(removed, 0.0, torch.maximum(pg_losses1, pg_losses2))
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=removed, ppo_kl=-log_ratio, pg_clipfrac_lower=torch.zeros_like(removed)
    )


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: unclipped surrogate, plus a KL penalty on the highest-covariance tokens.

    Cui et al. 2025 (arXiv 2505.22617), "KL-Cov": the floor(kl_cov_ratio * #tokens) (at
    least 1) tokens with the largest Cov(log pi, A) term get
        L = -A r + ppo_kl_coef * |log r|,   all other tokens L = -A r.

    Metrics: pg_clipfrac is the fraction of tokens penalised.
    """
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    pg_losses = -advantages * log_ratio.exp()

    with torch.no_grad():
        cov = _token_covariance(advantages, log_prob, response_mask)
        num_penalised = (kl_cov_ratio * response_mask.sum()).floor().clamp(min=1)
        valid = response_mask.bool()
        penalised = valid & _k_smallest(torch.where(valid, -cov, torch.inf), num_penalised)

    pg_losses = torch.where(penalised, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=penalised, ppo_kl=-log_ratio, pg_clipfrac_lower=torch.zeros_like(penalised)
    )


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
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
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clip the importance weight, not the update; every token keeps its gradient.

    MiniMax 2025, "MiniMax-M1" (arXiv 2506.13585), eq. 4 (objective) and eq. 5 (clipped weight):
        r_hat = clip(r, 1 - eps_low, 1 + eps_high)
        L     = -sg(r_hat) * A * log pi_theta(y_t)
    The paper sets eps_low large (no lower clip) and tunes only eps_high.

    Metrics: pg_clipfrac / pg_clipfrac_lower: tokens with r above / below the band.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - low, 1 + high).detach()
    pg_losses = -clipped_ratio * advantages * log_prob
    pg_loss = aggregate_policy_loss(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, loss_scale)
    return pg_loss, token_metrics(
        response_mask, pg_clipfrac=ratio > 1 + high, ppo_kl=-log_ratio, pg_clipfrac_lower=ratio < 1 - low
    )


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    clip_ratio: float = 0.4,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: maximise the geometric mean of the clipped token ratios of each sequence.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv 2507.20673), GMPO objective: with the
    token log ratios clipped in log space to [-eps_low, eps_high] (pessimistically, as PPO:
    the clip applies only where it lowers the objective, i.e. per sign(A)),
        L_i = -A_i * exp(mean_t clip(log r_t))
    and the loss is the mean over sequences, so `loss_agg_mode` does not apply (the global
    sequence count of `loss_scale` does). A_i is the mean of the token advantages (outcome
    advantages are constant per sequence). Rollout IS weights enter as their geometric mean
    per sequence.

    Metrics: pg_clipfrac / pg_clipfrac_lower: clipped tokens with A > 0 / A < 0.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    log_ratio_clamped = log_ratio.clamp(-low, high)
    sign = advantages.sign()
    log_ratio_pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)

    seq_ratio = masked_mean(log_ratio_pessimistic, response_mask, axis=-1).exp()
    seq_advantage = masked_mean(advantages, response_mask, axis=-1)
    seq_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        log_weights = rollout_is_weights.clamp(min=torch.finfo(rollout_is_weights.dtype).tiny).log()
        seq_losses = seq_losses * masked_mean(log_weights, response_mask, axis=-1).exp()

    has_tokens = (response_mask.sum(dim=-1) > 0).unsqueeze(-1)
    pg_loss = agg_loss(seq_losses.unsqueeze(-1), has_tokens, "seq-mean-token-sum", loss_scale=loss_scale)
    clipped = log_ratio != log_ratio_clamped
    return pg_loss, token_metrics(
        response_mask,
        pg_clipfrac=clipped & (advantages > 0),
        ppo_kl=-log_ratio,
        pg_clipfrac_lower=clipped & (advantages < 0),
    )
