"""Critic loss.

Shapes: B batch, T response length.
"""

from __future__ import annotations

import torch

from hybridrl.algos.agg import LossScale, agg_loss
from hybridrl.algos.utils import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    loss_scale: LossScale | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss.

    The value-clipping of the PPO reference implementation (openai/baselines ppo2; discussed in
    Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients", as "value function
    clipping"):
        V_clip = V_old + clip(V_pred - V_old, -c, c)
        L      = 1/2 * max((V_pred - R)^2, (V_clip - R)^2)

    Args:
        vpreds: (B, T) values predicted by the critic being trained.
        returns: (B, T) regression targets R (e.g. GAE returns).
        values: (B, T) V_old, the values at rollout time.
        response_mask: (B, T).
        cliprange_value: c; None disables clipping.
        loss_agg_mode: see `agg_loss`.
        loss_scale: global normalisers for gradient accumulation, see `agg_loss`.

    Returns:
        vf_loss: () scalar.
        vf_clipfrac: () fraction of tokens where the clipped term is the larger one (detached).
    """
    vf_losses1 = (vpreds - returns).square()
    if cliprange_value is None:
        vf_losses2 = vf_losses1
    else:
        vpredclipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
        vf_losses2 = (vpredclipped - returns).square()
    vf_loss = 0.5 * agg_loss(
        torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, loss_scale=loss_scale
    )
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), response_mask).detach()
    return vf_loss, vf_clipfrac
