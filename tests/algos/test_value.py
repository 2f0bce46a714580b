"""Clipped value loss: hand-derived values."""

import pytest
import torch

from hybridrl.algos import LossScale, compute_value_loss

VPREDS = torch.tensor([[1.0, 2.0, 3.0]])
VALUES = torch.full((1, 3), 1.5)
RETURNS = torch.full((1, 3), 2.0)
MASK = torch.ones(1, 3)


def test_value_loss_clipped():
    # c = 0.2: clipped predictions 1.5 + clip(V - 1.5, -0.2, 0.2) = [1.3, 1.7, 1.7]
    # (V - R)^2 = [1, 0, 1]; (V_clip - R)^2 = [0.49, 0.09, 0.09]; max = [1, 0.09, 1]
    vf_loss, vf_clipfrac = compute_value_loss(VPREDS, RETURNS, VALUES, MASK, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (1 + 0.09 + 1) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)  # only the middle token


def test_value_loss_unclipped_and_masked():
    vf_loss, vf_clipfrac = compute_value_loss(VPREDS, RETURNS, VALUES, MASK, cliprange_value=None)
    assert vf_loss.item() == pytest.approx(0.5 * (1 + 0 + 1) / 3)
    assert vf_clipfrac.item() == 0
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    vf_loss, _ = compute_value_loss(VPREDS, RETURNS, VALUES, mask, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * (1 + 0.09) / 2)


def test_value_loss_gradient_and_scale():
    vpreds = VPREDS.clone().requires_grad_(True)
    vf_loss, _ = compute_value_loss(vpreds, RETURNS, VALUES, MASK, 0.2, loss_scale=LossScale(num_tokens=6))
    (grad,) = torch.autograd.grad(vf_loss, vpreds)
    # 0.5 * sum / 6: token 0 and 2 unclipped -> (V - R) / 6; token 1 clipped -> no gradient
    torch.testing.assert_close(grad, torch.tensor([[-1 / 6, 0.0, 1 / 6]]))
