"""The student's side of on-policy distillation: the distillation term of one actor micro-batch.

`PPOActor` (workers/actor.py) calls `add_distillation_loss` once per micro-batch when it was built
with a `distillation.distillation_loss` config; the batch then carries `teacher_log_probs` (B, T),
the teacher's log-probs of the sampled tokens (hybridrl/trainer/ppo/teachers.py). The losses are
the pure functions of hybridrl/algos/distillation.py.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algos import distillation as D
from hybridrl.algos.utils import masked_mean

TEACHER_LOG_PROBS = "teacher_log_probs"


def add_distillation_loss(
    cfg: Any,
    task_loss: torch.Tensor,
    log_prob: torch.Tensor,
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
        log_prob: (b, T) the student's log-probs, with gradient.
        micro: the micro-batch (holds teacher_log_probs (b, T)).
        mask: (b, T) response mask.
        old_log_prob: (b, T) log pi_old (for use_policy_gradient).

    Returns:
        (total loss, summed metrics {distillation/loss}, token-mean metrics).
    """
    if D.uses_topk(cfg.loss_mode):
        raise NotImplementedError(
            f"distillation.distillation_loss.loss_mode={cfg.loss_mode}: the training engines return the "
            "sampled token's log-prob only, not the top-k of the vocabulary; use k3 (supervised) or k1 with "
            "use_policy_gradient=true"
        )
    teacher = micro[TEACHER_LOG_PROBS]
    token_losses = D.distillation_token_losses(
        log_prob, teacher, cfg.loss_mode, loss_max_clamp=cfg.loss_max_clamp
    )
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
    # k1 estimate of KL(student || teacher) per token at the update's own log-probs
    means["distillation/student_teacher_kl"] = masked_mean((log_prob.detach() - teacher), mask)
    return total, {"distillation/loss": float(distill.detach())}, means
