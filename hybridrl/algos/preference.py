"""Preference losses: the Bradley-Terry reward-model loss and the DPO family (DPO, IPO, SimPO).

Pure functions of per-pair tensors (B pairs). A reward model gives one score per sequence; a
policy gives the summed log-probability of each completion's tokens given its prompt (and, for
the length-normalised losses, the number of those tokens). Every function returns
``(loss, metrics)`` with the loss a scalar mean over the pairs and the metrics detached tensors.

References:
    Bradley & Terry (1952); Ouyang et al. (2022), eq. 1 (reward model), with the per-pair margin of
    Touvron et al. (2023), eq. 2.
    Rafailov et al. (2023), "Direct Preference Optimization", eq. 7 (sigmoid loss), with the
    conservative label smoothing of Mitchell (2023), "A note on DPO with noisy preferences".
    Azar et al. (2023), "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17 (IPO).
    Meng et al. (2024), "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "DPO_LOSS_TYPES",
    "bradley_terry_loss",
    "dpo_loss",
    "sequence_log_probs",
]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo")


def sequence_log_probs(
    token_log_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each completion and its token count.

    Args:
        token_log_probs: (B, T) log pi(y_t | x, y_<t).
        mask: (B, T) 1 on completion tokens, 0 on prompt and padding.

    Returns:
        ((B,) sum_t log pi, (B,) number of completion tokens), float32.
    """
    m = mask.to(token_log_probs.dtype)
    return (token_log_probs * m).sum(-1).float(), m.sum(-1).float()


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model loss: L = -mean log sigmoid(r_c - r_r - m) (+ c * mean((r_c + r_r)^2)).

    Args:
        chosen_scores: (B,) r_c, the reward model's score of the preferred completion.
        rejected_scores: (B,) r_r, the score of the other completion of the same prompt.
        margin: (B,) m, how much better the chosen completion is (None: 0).
        center_rewards_coefficient: c, the weight of the term that pulls the rewards' mean to 0
            (Eisenstein et al., 2023); 0 disables it.

    Returns:
        (loss, metrics): loss scalar; metrics `accuracy` (share of pairs with r_c > r_r), `margin`
        (mean r_c - r_r), `chosen_reward`, `rejected_reward` (means).
    """
    delta = chosen_scores - rejected_scores
    logits = delta if margin is None else delta - margin
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen_scores + rejected_scores) ** 2).mean()
    metrics = {
        "accuracy": (delta > 0).float().mean().detach(),
        "margin": delta.mean().detach(),
        "chosen_reward": chosen_scores.mean().detach(),
        "rejected_reward": rejected_scores.mean().detach(),
    }
    return loss, metrics


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A DPO-family loss of B preference pairs.

    With h = (log pi(y_c) - log pi(y_r)) - (log pi_ref(y_c) - log pi_ref(y_r)):

    * ``sigmoid`` (DPO, eq. 7, label smoothing e):
      L = -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)
    * ``ipo`` (eq. 17), on log-probs averaged over each completion's tokens:
      L = (h - 1 / (2 beta))^2
    * ``simpo`` (reference-free, eq. 6), on the averaged log-probs, gamma = simpo_gamma / beta:
      L = -(1 - e) log sigmoid(beta (avg_c - avg_r - gamma)) - e log sigmoid(-beta (...))

    Args:
        chosen_logps / rejected_logps: (B,) summed log-probs of the chosen / rejected completion
            under the policy.
        ref_chosen_logps / ref_rejected_logps: (B,) the same under the reference policy (None only
            for ``simpo``).
        chosen_lengths / rejected_lengths: (B,) completion token counts (``ipo`` and ``simpo``).
        loss_type: one of DPO_LOSS_TYPES.
        beta: the inverse temperature (the KL weight of DPO, the regularisation of IPO).
        label_smoothing: e in [0, 0.5), the assumed share of flipped labels (sigmoid, simpo).
        simpo_gamma: SimPO's target reward margin (``simpo`` only).

    Returns:
        (loss, metrics): loss scalar; metrics (detached means) `rewards/chosen`, `rewards/rejected`
        (beta times the policy-minus-reference log-ratio; beta times the averaged log-prob for
        simpo), `rewards/accuracies` (share of pairs with the chosen reward higher),
        `rewards/margins`, `logps/chosen`, `logps/rejected`.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not one of {list(DPO_LOSS_TYPES)}")
    normalised = loss_type in ("ipo", "simpo")
    if normalised and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(
            f"loss_type={loss_type!r} averages log-probs over tokens: pass chosen/rejected_lengths"
        )
    pc, pr = chosen_logps, rejected_logps
    if normalised:
        pc, pr = pc / chosen_lengths.clamp(min=1), pr / rejected_lengths.clamp(min=1)
    if loss_type == "simpo":
        chosen_rewards, rejected_rewards = beta * pc, beta * pr
        logits = (pc - pr) - simpo_gamma / beta
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"loss_type={loss_type!r} needs the reference log-probs")
        rc, rr = ref_chosen_logps, ref_rejected_logps
        if normalised:
            rc, rr = rc / chosen_lengths.clamp(min=1), rr / rejected_lengths.clamp(min=1)
        logits = (pc - pr) - (rc - rr)
        chosen_rewards, rejected_rewards = beta * (pc - rc), beta * (pr - rr)
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    metrics = {
        "rewards/chosen": chosen_rewards.mean().detach(),
        "rewards/rejected": rejected_rewards.mean().detach(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().detach(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().detach(),
        "logps/chosen": chosen_logps.mean().detach(),
        "logps/rejected": rejected_logps.mean().detach(),
    }
    return losses.mean(), metrics
