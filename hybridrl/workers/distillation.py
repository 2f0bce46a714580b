"""The student's side of on-policy distillation: the distillation term of one actor micro-batch.

`PPOActor` (workers/actor.py) calls `add_distillation_loss` once per micro-batch when it was built
with a `distillation.distillation_loss` config; the batch then carries `teacher_log_probs` (B, T),
the teacher's log-probs of the sampled tokens (hybridrl/trainer/ppo/teachers.py), and with
loss_mode=forward_kl_topk `teacher_topk_log_probs` / `teacher_topk_ids` (B, T, K); the student's
log-probs at those ids come from the engine (engine/topk.py). The losses are the pure functions
of hybridrl/algos/distillation.py.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algos import distillation as D
from hybridrl.algos.utils import masked_mean

TEACHER_LOG_PROBS = "teacher_log_probs"
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"  # (B, T, K) float32, forward_kl_topk only
TEACHER_TOPK_IDS = "teacher_topk_ids"  # (B, T, K) long (engine/topk.TOPK_IDS_KEY)


def needs_topk(cfg: Any) -> bool:
    """True when `distillation.distillation_loss` (or None) trains on the teacher's top-k."""
    return cfg is not None and D.uses_topk(cfg.loss_mode)


def token_losses_of(cfg: Any, out: Any, micro: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(b, T) per-token D_t of `cfg.loss_mode` (clamped), and token-mean extras (b, T).

    Args:
        cfg: `distillation.distillation_loss`.
        out: the engine's LogProbs of the micro-batch (with gradient); for forward_kl_topk its
            topk_log_probs (b, T, K) are the student's at the teacher's top-k ids.
        micro: holds teacher_log_probs (b, T), and teacher_topk_log_probs (b, T, K) for top-k.
    """
    if not needs_topk(cfg):
        losses = D.distillation_token_losses(
            out.log_probs, micro[TEACHER_LOG_PROBS], cfg.loss_mode, loss_max_clamp=cfg.loss_max_clamp
        )
        return losses, {}
    if out.topk_log_probs is None or TEACHER_TOPK_LOG_PROBS not in micro.keys():
        raise RuntimeError(
            "loss_mode=forward_kl_topk needs the teacher's top-k log-probs in the batch and the student's "
            "log-probs at their ids from the engine (a LogProbRequest with topk_ids=True)"
        )
    losses, extras = D.forward_kl_topk(
        out.topk_log_probs, micro[TEACHER_TOPK_LOG_PROBS].to(out.topk_log_probs),
        log_prob_min_clamp=cfg.log_prob_min_clamp,
    )  # fmt: skip
    extras = {f"distillation/{k}": v for k, v in extras.items()}
    return D.clamp_losses(losses, cfg.loss_max_clamp), extras


def add_distillation_loss(
    cfg: Any,
    task_loss: torch.Tensor,
    out: Any,
    micro: Any,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    loss_scale: Any,
    old_log_prob: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
    """L_total of the micro-batch with the distillation term (algos/distillation.py, module doc).

    Args:
        cfg: `distillation.distillation_loss` (DistillationLossConfig).
        task_loss: 0-d PPO loss of the micro-batch (policy loss, entropy bonus, KL loss).
        out: the engine's LogProbs of the micro-batch: log_probs (b, T) with gradient (and
            topk_log_probs (b, T, K) for forward_kl_topk).
        micro: the micro-batch (holds teacher_log_probs (b, T), teacher_topk_log_probs (b, T, K)).
        mask: (b, T) response mask.
        old_log_prob: (b, T) log pi_old (for use_policy_gradient).

    Returns:
        (total loss, summed metrics {distillation/loss}, token-mean metrics).
    """
    log_prob, teacher = out.log_probs, micro[TEACHER_LOG_PROBS]
    token_losses, extras = token_losses_of(cfg, out, micro)
    distill, metrics = D.distillation_loss(
        token_losses,
        mask,
        loss_agg_mode=loss_agg_mode,
        loss_scale=loss_scale,
        use_policy_gradient=cfg.use_policy_gradient,
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        policy_loss_mode=cfg.policy_loss_mode,
        clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
    )
    total = D.combine_with_task_loss(
        task_loss,
        distill,
        use_task_rewards=cfg.use_task_rewards,
        distillation_loss_coef=cfg.distillation_loss_coef,
    )
    means = {k: v for k, v in metrics.items() if k not in ("distillation/loss_min", "distillation/loss_max")}
    means.update({k: masked_mean(v, mask) for k, v in extras.items()})
    # k1 estimate of KL(student || teacher) per token at the update's own log-probs
    means["distillation/student_teacher_kl"] = masked_mean((log_prob.detach() - teacher), mask)
    return total, {"distillation/loss": float(distill.detach())}, means
