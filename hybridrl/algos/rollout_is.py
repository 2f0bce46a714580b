"""Importance weights correcting the rollout engine / training engine mismatch.

The rollout engine (vLLM, SGLang) and the training engine compute slightly different
probabilities for the same tokens (kernels, precision), so the tokens are sampled from
pi_rollout while the loss assumes pi_old. Weighting the loss by w = pi_old / pi_rollout
corrects this; bounding w trades the bias for variance.
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(truncated importance sampling, TIS: w <- min(w, C)); the sequence-level weight is the
ordinary importance weight of the whole response (Precup et al. 2000), the geometric one its
per-token geometric mean (length-normalised, as GSPO's ratio).

Shapes: B batch, T response length.
"""

from __future__ import annotations

import math

import torch

from hybridrl.algos.utils import masked_mean

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
LOG_WEIGHT_BOUND = 20.0  # log w is clamped here before exp() so weights stay finite


def _check_args(level: str, mode: str, upper: float, lower: float) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown rollout_is_level {level!r}; known: {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"unknown rollout_is_mode {mode!r}; known: {', '.join(MODES)}")
    if not 0 <= lower < upper:
        raise ValueError(
            f"need 0 <= rollout_is_threshold_lower < rollout_is_threshold, got lower={lower}, upper={upper}"
        )


def compute_rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is_level: str = "token",
    rollout_is_mode: str = "truncate",
    rollout_is_threshold: float | None = 2.0,
    rollout_is_threshold_lower: float | None = None,
    rollout_is_veto_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bounded importance weights w = pi_old / pi_rollout.

    Levels:
        token      w_t = pi_old(y_t) / pi_rollout(y_t)
        sequence   w_t = prod_s w_s for every token of the response
        geometric  w_t = (prod_s w_s)^(1/|y|)
    Modes (upper U = rollout_is_threshold, lower = rollout_is_threshold_lower or 1/U):
        truncate   w <- min(w, U)                 (TIS)
        mask       w <- 0 where w < lower or w > U
    Veto: a response containing any token with per-token ratio below
    rollout_is_veto_threshold gets weight 0 everywhere (a catastrophic mismatch).

    Args:
        old_log_prob: (B, T) log pi_old from the training engine.
        rollout_log_prob: (B, T) log pi_rollout returned by the rollout engine.
        response_mask: (B, T).
        rollout_is_level: token, sequence or geometric.
        rollout_is_mode: truncate or mask.
        rollout_is_threshold: U; None = no upper bound.
        rollout_is_threshold_lower: lower bound of the mask mode; None = 1 / U.
        rollout_is_veto_threshold: per-token ratio below which a response is vetoed; None = off.

    Returns:
        weights: (B, T) detached, 0 under the mask; multiply the per-token policy loss by them.
        metrics: rollout_is_mean / _max / _min (raw weights, before bounding),
            rollout_is_clipped_frac (tokens truncated or masked), rollout_is_veto_frac
            (responses vetoed), rollout_is_eff_sample_size ((sum w)^2 / (n sum w^2) of the final
            weights, 1 = no loss of samples), rollout_kl (mean log pi_rollout - log pi_old).
    """
    upper = math.inf if rollout_is_threshold is None else float(rollout_is_threshold)
    lower = rollout_is_threshold_lower if rollout_is_threshold_lower is not None else 1.0 / upper
    _check_args(rollout_is_level, rollout_is_mode, upper, lower)

    with torch.no_grad():
        is_token = response_mask.bool()
        log_ratio = torch.where(is_token, old_log_prob - rollout_log_prob, 0.0)
        if rollout_is_level == "token":
            log_weights = log_ratio
        elif rollout_is_level == "sequence":
            log_weights = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
        else:
            log_weights = masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1).expand_as(log_ratio)
        raw_weights = log_weights.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND).exp()

        if rollout_is_mode == "truncate":
            out_of_range = raw_weights > upper
            weights = raw_weights.clamp(max=upper)
        else:
            out_of_range = (raw_weights < lower) | (raw_weights > upper)
            weights = torch.where(out_of_range, 0.0, raw_weights)

        vetoed = torch.zeros_like(is_token[:, :1])
        if rollout_is_veto_threshold is not None:
            catastrophic = is_token & (log_ratio < math.log(rollout_is_veto_threshold))
            vetoed = catastrophic.any(dim=-1, keepdim=True)
            weights = torch.where(vetoed, 0.0, weights)
        weights = weights * response_mask

        metrics = {
            "rollout_is_mean": masked_mean(raw_weights, response_mask),
            "rollout_is_max": torch.where(is_token, raw_weights, -torch.inf).max(),
            "rollout_is_min": torch.where(is_token, raw_weights, torch.inf).min(),
            "rollout_is_clipped_frac": masked_mean(out_of_range.float(), response_mask),
            "rollout_is_veto_frac": vetoed.float().mean(),
            "rollout_is_eff_sample_size": weights.sum().square()
            / (is_token.sum() * weights.square().sum()).clamp(min=torch.finfo(weights.dtype).tiny),
            "rollout_kl": masked_mean(-log_ratio, response_mask),
        }
    return weights, metrics


def parse_rs_threshold(threshold, default) -> tuple[float, float]:
    """veRL's `rollout_rs_threshold`: 'lower_upper' ('0.5_2.0'), one number U (-> 1/U, U) or None
    (then `default`, the rollout_is_threshold, read the same way)."""
    if threshold is None:
        threshold = default
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (float(x) for x in threshold.split("_", 1))
        return lower, upper
    upper = float(threshold)
    return 1.0 / upper, upper


def parse_is_threshold(threshold) -> tuple[float | None, float]:
    """veRL's `rollout_is_threshold`: a number U (TIS: truncate at U) or 'lower_upper' (IcePop:
    weights outside [lower, upper] become 0). Returns (lower or None, upper).

    Raises:
        ValueError: a spec that is not one of those, a bound <= 0, or lower > upper.
    """
    if isinstance(threshold, bool):
        raise ValueError(f"rollout_is_threshold={threshold!r}: give a number or 'lower_upper'")
    lower = None
    if isinstance(threshold, str) and "_" in threshold:
        lo, hi = threshold.split("_", 1)
        lower, upper = float(lo), float(hi)
    else:
        upper = float(threshold)
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={threshold!r}: bounds must be positive with lower <= upper")
    return lower, upper


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None,
    rollout_is_threshold: float | str,
    rollout_is_batch_normalize: bool,
    rollout_rs: str | None,
    rollout_rs_lower: float,
    rollout_rs_upper: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """veRL's rollout correction: truncated IS weights times a rejection-sampling mask.

    w = min(pi_old / pi_rollout, U) at level `rollout_is` (1 when None; TIS), or with a
    'lower_upper' threshold w = r for r in [lower, upper] and 0 outside (IcePop, veRL's string
    form), optionally divided by its token mean over the batch (self-normalised); a token, or with
    rollout_rs=sequence/geometric a whole response, whose ratio at level `rollout_rs` lies outside
    [lower, upper] gets w = 0.

    Args:
        old_log_prob, rollout_log_prob, response_mask: (B, T).
        rollout_is: None, 'token' or 'sequence'.
        rollout_is_threshold: U, or 'lower_upper' (see `parse_is_threshold`).
        rollout_rs: None, 'token', 'sequence' or 'geometric'.

    Returns:
        weights: (B, T) detached; metrics: is_* of the IS part, rs_reject_frac (tokens rejected).
    """
    metrics: dict[str, torch.Tensor] = {}
    weights = response_mask.to(old_log_prob.dtype)
    if rollout_is is not None:
        is_lower, is_upper = parse_is_threshold(rollout_is_threshold)
        weights, is_metrics = compute_rollout_importance_weights(
            old_log_prob,
            rollout_log_prob,
            response_mask,
            rollout_is_level=rollout_is,
            rollout_is_mode="truncate" if is_lower is None else "mask",
            rollout_is_threshold=is_upper,
            rollout_is_threshold_lower=is_lower,
        )
        metrics.update(is_metrics)
        if rollout_is_batch_normalize:
            weights = weights / masked_mean(weights, response_mask).clamp(min=torch.finfo(weights.dtype).tiny)
    if rollout_rs is not None:
        kept, _ = compute_rollout_importance_weights(
            old_log_prob,
            rollout_log_prob,
            response_mask,
            rollout_is_level=rollout_rs,
            rollout_is_mode="mask",
            rollout_is_threshold=rollout_rs_upper,
            rollout_is_threshold_lower=rollout_rs_lower,
        )
        accept = kept > 0
        metrics["rs_reject_frac"] = masked_mean((~accept).float(), response_mask)
        weights = torch.where(accept, weights, 0.0)
    return weights * response_mask, metrics
