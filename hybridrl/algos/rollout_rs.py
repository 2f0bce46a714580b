"""Rollout rejection sampling by divergence estimators, and veRL's bypass-mode policy loss.

Rejection (a hard trust region between the training policy pi and the rollout policy mu): with
log_ratio_t = log pi(y_t) - log mu(y_t) (clamped to +-20), the per-token estimators of
KL(mu || pi) of Schulman 2020 ("Approximating KL Divergence", joschu.net/blog/kl-approx.html)
    k1_t = -log_ratio_t,   k2_t = log_ratio_t^2 / 2,   k3_t = exp(log_ratio_t) - 1 - log_ratio_t
are thresholded per option of a comma-joined `rollout_rs` (every option must pass):
    token_k1            keep token t if log(lower) <= k1_t <= log(upper)
    token_k2, token_k3  keep token t if k_t <= upper
    seq_sum_kX          keep the response if sum_t kX_t is within the bounds (k1: log bounds)
    seq_mean_kX         the same with the mean over the response's tokens
    seq_max_k2/k3       keep the response if max_t kX_t <= upper
`rollout_rs_threshold` gives one spec per option (or one for all), comma-joined: k1 options take
'lower_upper' (or U, meaning 1/U_U), the others one upper bound. These are veRL's options and
numbers (rollout_corr_helper.compute_rollout_rejection_mask); Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training" motivates the correction.

Bypass mode (veRL `rollout_correction.bypass_mode`): the rollout log-probs are the old
log-probs; inside the loss the truncated IS weight w = min(pi / mu, C) (token, or the product
over the response) and the rejection mask are computed from the current, detached log-probs.
    loss_type=ppo_clip   the PPO clipped loss on the kept tokens (its ratio is pi / mu already)
    loss_type=reinforce  L = -w * A * log pi on the kept tokens (REINFORCE with explicit IS)

Shapes: B batch, T response length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hybridrl.algos.agg import LossScale, agg_loss
from hybridrl.algos.policy_loss import compute_policy_loss_vanilla, register_policy_loss
from hybridrl.algos.utils import masked_mean, masked_sum

KL_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
LOG_RATIO_BOUND = 20.0
LOSS_TYPES = ("ppo_clip", "reinforce")


def is_kl_rs(rollout_rs: str | None) -> bool:
    """Whether `rollout_rs` names estimator options (token_k1, ...), comma-joined."""
    return bool(rollout_rs) and all(
        o.strip() in KL_RS_OPTIONS for o in str(rollout_rs).split(",") if o.strip()
    )


def parse_kl_rs(rollout_rs: str, threshold) -> list[tuple[str, float | None, float]]:
    """[(option, lower or None, upper), ...] from veRL's comma-joined option and threshold specs."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    bad = [o for o in options if o not in KL_RS_OPTIONS]
    if not options or bad:
        raise ValueError(f"rollout_rs options {bad or rollout_rs!r} are not among {', '.join(KL_RS_OPTIONS)}")
    if threshold is None:
        raise ValueError(
            "rollout_rs_threshold is required with the estimator options (e.g. '0.5_2.0' for *_k1)"
        )
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} specs for {len(options)} options; give 1 or {len(options)}"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    out = []
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            lower, upper = (
                (float(x) for x in spec.split("_", 1)) if "_" in spec else (1 / float(spec), float(spec))
            )
        elif "_" in spec:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: one upper bound, no '_'")
        else:
            lower, upper = None, float(spec)
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: bounds must be > 0")
        out.append((option, lower, upper))
    return out


def _per_token_estimators(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    lr = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr**2, "k3": lr.exp() - 1 - lr}


def _keep(stat: torch.Tensor, lower: float | None, upper: float, k1: bool) -> torch.Tensor:
    if k1:
        return (stat >= math.log(lower)) & (stat <= math.log(upper))
    return stat <= upper


@torch.no_grad()
def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str, rollout_rs_threshold
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep mask of the estimator options (module docstring); every option must pass.

    Args:
        log_ratio: (B, T) log pi - log mu of the sampled tokens.
        response_mask: (B, T).
        rollout_rs, rollout_rs_threshold: veRL's comma-joined options and threshold specs.

    Returns:
        keep: (B, T) float, 1 = kept (0 under the mask); metrics: rollout_rs_<option>_mean (the
        option's statistic), rollout_rs_<option>_masked_fraction and rollout_rs_masked_fraction
        (rejected share of the valid tokens).
    """
    mask = response_mask.to(log_ratio.dtype)
    est = _per_token_estimators(log_ratio)
    keep = torch.ones_like(mask, dtype=torch.bool)
    metrics: dict[str, torch.Tensor] = {}
    for option, lower, upper in parse_kl_rs(rollout_rs, rollout_rs_threshold):
        k = option[-2:]
        tok = est[k]
        if option.startswith("token"):
            stat = tok
        elif option.startswith("seq_sum"):
            stat = masked_sum(tok, mask, axis=-1)[:, None].expand_as(tok)
        elif option.startswith("seq_mean"):
            stat = masked_mean(tok, mask, axis=-1)[:, None].expand_as(tok)
        else:
            seq_max = torch.where(mask.bool(), tok, -torch.inf).max(-1).values
            stat = torch.where(torch.isinf(seq_max), 0.0, seq_max)[:, None].expand_as(tok)
        ok = _keep(stat, lower, upper, k == "k1")
        keep = keep & ok
        metrics[f"rollout_rs_{option}_mean"] = masked_mean(stat, mask)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean((~ok).to(mask.dtype), mask)
    keep = keep.to(mask.dtype) * mask
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep, mask)
    return keep, metrics


def bypass_is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    batch_normalize: bool = False,
    mean_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_mean,
) -> torch.Tensor:
    """w = min(exp(clamp(l)), C): l = log_ratio (token) or its sum over the response (sequence).

    batch_normalize divides by the mean weight over the valid tokens (token) or responses
    (sequence), computed by `mean_fn(values, mask)` (the caller may make it a mean over ranks).
    Returns (B, T) detached, 0 under the mask.
    """
    mask = response_mask.to(log_ratio.dtype)
    with torch.no_grad():
        if rollout_is == "token":
            lw = log_ratio
        elif rollout_is == "sequence":
            lw = masked_sum(log_ratio, mask, axis=-1)[:, None].expand_as(log_ratio)
        else:
            raise ValueError(f"rollout_is={rollout_is!r} is not one of token, sequence")
        w = lw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp().clamp(max=rollout_is_threshold) * mask
        if batch_normalize:
            if rollout_is == "token":
                mean = mean_fn(w, mask)
            else:
                seq_w = masked_mean(w, mask, axis=-1)
                mean = mean_fn(seq_w, (mask.sum(-1) > 0).to(w.dtype))
            w = w / mean.clamp(min=1e-8)
    return w


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    bypass_loss_type: str = "ppo_clip",
    bypass_rollout_is: str | None = None,
    bypass_rollout_is_threshold: float = 2.0,
    bypass_rollout_is_batch_normalize: bool = False,
    bypass_rollout_rs: str | None = None,
    bypass_rollout_rs_threshold=None,
    bypass_mean_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_mean,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """veRL's bypass-mode loss (module docstring); old_log_prob is the rollout's log mu.

    Rejected tokens leave the loss (their weight is 0) but stay in the normaliser `loss_scale`
    (the mini-batch's token/sequence counts), as veRL's global-batch aggregation does.
    Metrics: those of the underlying loss, rollout_rs_* of the rejection, bypass_is_mean.
    """
    kwargs.pop("rollout_is_weights", None)  # the weights are computed here (veRL: never applied twice)
    log_ratio = (log_prob.detach() - old_log_prob) * response_mask
    keep, metrics = (
        compute_rollout_rejection_mask(
            log_ratio, response_mask, bypass_rollout_rs, bypass_rollout_rs_threshold
        )
        if bypass_rollout_rs
        else (response_mask.to(log_prob.dtype), {})
    )
    mask = response_mask * keep
    if bypass_loss_type == "ppo_clip":  # the ratio pi / mu is the IS correction; no extra weight
        loss, pg_metrics = compute_policy_loss_vanilla(
            old_log_prob,
            log_prob,
            advantages,
            mask,
            loss_agg_mode=loss_agg_mode,
            loss_scale=loss_scale,
            **kwargs,
        )
    elif bypass_loss_type == "reinforce":
        w = None
        if bypass_rollout_is is not None:
            w = bypass_is_weights(
                log_ratio, response_mask, bypass_rollout_is, bypass_rollout_is_threshold,
                bypass_rollout_is_batch_normalize, bypass_mean_fn,
            )  # fmt: skip
            metrics["bypass_is_mean"] = masked_mean(w, response_mask)
        pg_losses = -advantages * log_prob * (w if w is not None else 1.0)
        loss = agg_loss(pg_losses, mask, loss_agg_mode, loss_scale=loss_scale)
        pg_metrics = {"ppo_kl": masked_mean(-(log_prob.detach() - old_log_prob), mask)}
    else:
        raise ValueError(f"bypass loss_type={bypass_loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    return loss, {**pg_metrics, **metrics}
