"""On-policy distillation (OPD) losses: veRL's `distillation.distillation_loss.*`.

The student pi_theta samples a response y ~ pi_theta(. | x); at every state s_t = (x, y_<t) the
teacher nu gives its log-probabilities, and the student is trained towards the teacher at the
states it visits itself (Agarwal et al. 2023, "On-Policy Distillation of Language Models" (GKD),
arXiv 2306.13649; Lu & Thinking Machines 2025, "On-Policy Distillation"). Per token:

Sampled-token estimators of the reverse KL(pi_theta || nu) (`loss_mode` kl/k1, abs, mse/k2,
low_var_kl/k3), with log r = log nu(y_t) - log pi_theta(y_t) (Schulman 2020,
"Approximating KL Divergence"):
    k1 = -log r      abs = |log r|      k2 = 1/2 (log r)^2      k3 = e^{log r} - 1 - log r
k3 clamps log r to [-20, 20] and k3 itself to [-10, 10], as veRL's `kl_penalty` does.

Top-k forward KL (`forward_kl_topk`), over the teacher's k most likely tokens K_t:
    D_t = sum_{v in K_t} nu(v) (log nu(v) - log pi_theta(v))      (clamped at >= 0)
with both log-probs clamped from below at `log_prob_min_clamp` first.

The per-token D_t (clamped to [-loss_max_clamp, loss_max_clamp] when set) becomes a loss in one
of two ways:
    supervised (use_policy_gradient=False, GKD):   L = agg(D)
    policy gradient (use_policy_gradient=True):    L = PPO-clip(ratio, A = -sg(D)),
        ratio = pi_theta / pi_old, the clip ratios of `distillation_loss.clip_ratio*`.
and is combined with the task (PPO) loss:
    use_task_rewards=True:   L_total = L_task + distillation_loss_coef * L
    use_task_rewards=False:  L_total = L                      (the task loss is dropped)

Shapes: B batch, T response length, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridrl.algos.agg import LossScale, agg_loss
from hybridrl.algos.policy_loss import get_policy_loss_fn
from hybridrl.algos.registry import Registry
from hybridrl.algos.utils import masked_mean

K3_LOG_RATIO_BOUND = 20.0  # veRL's kl_penalty clamps log r here before exp()
K3_MAX = 10.0  # ... and k3 to [-K3_MAX, K3_MAX]

TokenEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DISTILLATION_ESTIMATORS: Registry[TokenEstimator] = Registry("distillation loss_mode")
TOPK_LOSS_MODES = ("forward_kl_topk",)


def list_distillation_loss_modes() -> list[str]:
    """Every `distillation.distillation_loss.loss_mode` name (sampled-token estimators + top-k)."""
    return sorted([*DISTILLATION_ESTIMATORS.names(), *TOPK_LOSS_MODES])


def uses_topk(loss_mode: str) -> bool:
    """True when `loss_mode` needs the teacher's top-k log-probs (and the student's at those ids)."""
    return loss_mode in TOPK_LOSS_MODES


def _register(*names: str) -> Callable[[TokenEstimator], TokenEstimator]:
    def decorator(fn: TokenEstimator) -> TokenEstimator:
        for name in names:
            DISTILLATION_ESTIMATORS.register(name)(fn)
        return fn

    return decorator


@_register("kl", "k1")
def distill_k1(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta(y_t) - log nu(y_t). Args/returns: (B, T)."""
    return student_log_prob - teacher_log_prob


@_register("abs")
def distill_abs(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """|log pi_theta(y_t) - log nu(y_t)|. Args/returns: (B, T)."""
    return (student_log_prob - teacher_log_prob).abs()


@_register("mse", "k2")
def distill_k2(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = 1/2 (log pi_theta(y_t) - log nu(y_t))^2. Args/returns: (B, T)."""
    return 0.5 * (student_log_prob - teacher_log_prob).square()


@_register("low_var_kl", "k3")
def distill_k3(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r, r = nu(y_t) / pi_theta(y_t) (log r in [-20, 20], k3 in [-10, 10]).

    Args/returns: (B, T).
    """
    log_r = (teacher_log_prob - student_log_prob).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (log_r.exp() - 1 - log_r).clamp(-K3_MAX, K3_MAX)


def forward_kl_topk(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    *,
    log_prob_min_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward KL over the teacher's top-k tokens: D_t = sum_k nu_k (log nu_k - log pi_k), >= 0.

    Both distributions are truncated to the same k tokens, so neither sums to 1 and the raw
    sum can be negative; it is clamped at 0 (as veRL does).

    Args:
        student_topk_log_probs: (B, T, K) log pi_theta at the teacher's top-k token ids (with
            gradient).
        teacher_topk_log_probs: (B, T, K) log nu of its top-k tokens.
        log_prob_min_clamp: lower bound for both log-probs before the sum (None: no clamp).

    Returns:
        losses: (B, T) per-token D_t.
        extras: student_mass / teacher_mass (B, T): the probability mass of the k tokens.
    """
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float()
    extras = {"student_mass": student.detach().exp().sum(-1), "teacher_mass": teacher.exp().sum(-1)}
    if log_prob_min_clamp is not None:
        student = student.clamp_min(log_prob_min_clamp)
        teacher = teacher.clamp_min(log_prob_min_clamp)
    losses = (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)
    return losses, extras


def distillation_token_losses(
    student_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    loss_mode: str,
    *,
    loss_max_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token D_t of a sampled-token `loss_mode`, clamped to [-loss_max_clamp, loss_max_clamp].

    Args:
        student_log_prob: (B, T) log pi_theta(y_t), with gradient.
        teacher_log_prob: (B, T) log nu(y_t).
        loss_mode: kl/k1, abs, mse/k2, low_var_kl/k3 (forward_kl_topk: use `forward_kl_topk`).
        loss_max_clamp: the clamp bound (None: none).

    Returns:
        (B, T) per-token loss.
    """
    if uses_topk(loss_mode):
        raise ValueError(f"loss_mode {loss_mode!r} needs top-k log-probs: call forward_kl_topk")
    losses = DISTILLATION_ESTIMATORS.get(loss_mode)(student_log_prob, teacher_log_prob.to(student_log_prob))
    return clamp_losses(losses, loss_max_clamp)


def clamp_losses(losses: torch.Tensor, loss_max_clamp: float | None) -> torch.Tensor:
    """losses clamped to [-c, c] (the lower bound matters for k1, which can be negative)."""
    return losses if loss_max_clamp is None else losses.clamp(-loss_max_clamp, loss_max_clamp)


def distillation_loss(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
    use_policy_gradient: bool = False,
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
    policy_loss_mode: str = "vanilla",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = 0.2,
    clip_ratio_high: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The scalar distillation loss L from per-token D_t (module docstring).

    Args:
        token_losses: (B, T) D_t (already clamped).
        response_mask: (B, T).
        loss_agg_mode / loss_scale: the actor's aggregation (algos/agg.py).
        use_policy_gradient: False: L = agg(D); True: PPO-clip surrogate with A_t = -sg(D_t).
        log_prob: (B, T) log pi_theta (with gradient); needed with use_policy_gradient.
        old_log_prob: (B, T) log pi_old; needed with use_policy_gradient.
        policy_loss_mode / clip_ratio*: the surrogate with use_policy_gradient.

    Returns:
        loss: 0-d; metrics: distillation/abs_loss, loss_min, loss_max (and pg_clipfrac, ppo_kl
        with use_policy_gradient), 0-d detached.
    """
    mask = response_mask.bool()
    valid = token_losses.detach()[mask]
    metrics = {
        "distillation/abs_loss": masked_mean(token_losses.detach().abs(), response_mask),
        "distillation/loss_min": valid.min() if valid.numel() else torch.tensor(0.0),
        "distillation/loss_max": valid.max() if valid.numel() else torch.tensor(0.0),
    }
    if not use_policy_gradient:
        return agg_loss(token_losses, response_mask, loss_agg_mode, loss_scale=loss_scale), metrics
    if log_prob is None or old_log_prob is None:
        raise ValueError("use_policy_gradient=True needs log_prob and old_log_prob")
    loss, pg_metrics = get_policy_loss_fn(policy_loss_mode)(
        old_log_prob,
        log_prob,
        -token_losses.detach(),
        response_mask,
        loss_agg_mode=loss_agg_mode,
        loss_scale=loss_scale,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
    )
    metrics.update({f"distillation/{k}": v for k, v in pg_metrics.items()})
    return loss, metrics


def combine_with_task_loss(
    task_loss: torch.Tensor,
    distill_loss: torch.Tensor,
    *,
    use_task_rewards: bool,
    distillation_loss_coef: float = 1.0,
) -> torch.Tensor:
    """L_total = L_task + coef * L (use_task_rewards), else L alone (coef unused, as in veRL).

    Args:
        task_loss: 0-d PPO loss (policy loss, entropy bonus, KL loss).
        distill_loss: 0-d distillation loss.

    Returns:
        0-d total loss.
    """
    if use_task_rewards:
        return task_loss + distillation_loss_coef * distill_loss
    return distill_loss
