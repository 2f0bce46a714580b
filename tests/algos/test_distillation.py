"""On-policy distillation losses (hybridrl/algos/distillation.py), hand-derived values."""

import math

import pytest
import torch

from hybridrl.algos.distillation import (
    combine_with_task_loss,
    distillation_loss,
    distillation_token_losses,
    forward_kl_topk,
    list_distillation_loss_modes,
    uses_topk,
)

# two tokens: (pi_student, nu_teacher) = (0.5, 0.25) -> log r = log(nu/pi) = -ln 2
#                                        (0.2, 0.6)  -> log r = ln 3
STUDENT = torch.log(torch.tensor([[0.5, 0.2]]))
TEACHER = torch.log(torch.tensor([[0.25, 0.6]]))
LN2, LN3 = math.log(2), math.log(3)

EXPECTED = {
    "kl": [LN2, -LN3],  # log pi - log nu
    "k1": [LN2, -LN3],
    "abs": [LN2, LN3],
    "mse": [0.5 * LN2**2, 0.5 * LN3**2],
    "k2": [0.5 * LN2**2, 0.5 * LN3**2],
    "low_var_kl": [0.5 - 1 + LN2, 3 - 1 - LN3],  # r - 1 - log r
    "k3": [0.5 - 1 + LN2, 3 - 1 - LN3],
}


def test_modes_are_veRLs():
    assert list_distillation_loss_modes() == sorted([*EXPECTED, "forward_kl_topk"])
    assert uses_topk("forward_kl_topk") and not uses_topk("k3")


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_sampled_token_estimators(mode):
    got = distillation_token_losses(STUDENT, TEACHER, mode)
    torch.testing.assert_close(got, torch.tensor([EXPECTED[mode]]))


def test_k3_clamps_like_verl():
    # log r = -30 -> -20: e^-20 - 1 + 20 = 19 -> clamped to 10; log r = 5: e^5 - 6 -> 10 (clamp)
    # log r = 1: e - 2 (no clamp)
    student, teacher = torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[-30.0, 5.0, 1.0]])
    got = distillation_token_losses(student, teacher, "k3")
    torch.testing.assert_close(got, torch.tensor([[10.0, 10.0, math.e - 2]]))


def test_loss_max_clamp_bounds_both_sides():
    # k1 = [ln 2, -ln 3] = [0.693, -1.099] -> clamp 0.5 -> [0.5, -0.5]
    got = distillation_token_losses(STUDENT, TEACHER, "k1", loss_max_clamp=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.5, -0.5]]))


def test_unknown_mode_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown distillation loss_mode 'k9'.*k3"):
        distillation_token_losses(STUDENT, TEACHER, "k9")
    with pytest.raises(ValueError, match="forward_kl_topk"):
        distillation_token_losses(STUDENT, TEACHER, "forward_kl_topk")


def test_forward_kl_topk_hand_value():
    # teacher top-2 = (0.5, 0.25); student at those ids = (0.25, 0.5)
    # D = 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) = 0.5 ln2 - 0.25 ln2 = 0.25 ln 2
    teacher = torch.log(torch.tensor([[[0.5, 0.25]]]))
    student = torch.log(torch.tensor([[[0.25, 0.5]]]))
    loss, extras = forward_kl_topk(student, teacher)
    torch.testing.assert_close(loss, torch.tensor([[0.25 * LN2]]))
    torch.testing.assert_close(extras["student_mass"], torch.tensor([[0.75]]))
    torch.testing.assert_close(extras["teacher_mass"], torch.tensor([[0.75]]))


def test_forward_kl_topk_clamps():
    # negative raw sum: teacher (0.1, 0.1) vs student (0.4, 0.4): 0.2 ln(1/4) < 0 -> 0
    loss, _ = forward_kl_topk(
        torch.log(torch.tensor([[[0.4, 0.4]]])), torch.log(torch.tensor([[[0.1, 0.1]]]))
    )
    assert loss.item() == 0.0
    # log_prob_min_clamp=-2: student log-prob -5 -> -2: D = e^-1 (-1 - (-2)) = e^-1
    loss, _ = forward_kl_topk(torch.tensor([[[-5.0]]]), torch.tensor([[[-1.0]]]), log_prob_min_clamp=-2.0)
    torch.testing.assert_close(loss, torch.tensor([[math.exp(-1)]]))


def test_forward_kl_topk_gradient_is_minus_teacher_prob():
    student = torch.log(torch.tensor([[[0.25, 0.5]]])).requires_grad_()
    teacher = torch.log(torch.tensor([[[0.5, 0.25]]]))
    forward_kl_topk(student, teacher)[0].sum().backward()
    torch.testing.assert_close(student.grad, -teacher.exp())  # d/dlog pi of -nu log pi


def test_supervised_loss_is_masked_token_mean_with_gradient():
    student = STUDENT.clone().requires_grad_()
    losses = distillation_token_losses(student, TEACHER, "k3")
    mask = torch.tensor([[1.0, 0.0]])
    loss, metrics = distillation_loss(losses, mask)
    torch.testing.assert_close(loss, torch.tensor(0.5 - 1 + LN2))  # only the first token
    loss.backward()
    # d k3 / d log pi = -(r - 1) = 1 - r = 0.5 at r = 0.5; the masked token gets 0
    torch.testing.assert_close(student.grad, torch.tensor([[0.5, 0.0]]))
    torch.testing.assert_close(metrics["distillation/loss_max"], torch.tensor(0.5 - 1 + LN2))


def test_policy_gradient_uses_minus_loss_as_advantage():
    # on-policy (old = log pi): ratio 1, no clipping, L = -mean(A * ratio) with A = -k1
    # value: mean(k1) = (ln2 - ln3) / 2; gradient wrt log pi = -A / 2 = k1 / 2
    log_prob = STUDENT.clone().requires_grad_()
    losses = distillation_token_losses(log_prob, TEACHER, "k1")
    mask = torch.ones(1, 2)
    loss, metrics = distillation_loss(
        losses, mask, use_policy_gradient=True, log_prob=log_prob, old_log_prob=STUDENT
    )
    torch.testing.assert_close(loss, torch.tensor((LN2 - LN3) / 2))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[LN2 / 2, -LN3 / 2]]))
    assert metrics["distillation/pg_clipfrac"].item() == 0.0


def test_policy_gradient_clips_with_its_own_ratios():
    # ratio = 2 on a positive-advantage token (A = -k1 = ln 3 > 0 on token 2): clipped to 1 + 0.2
    log_prob = torch.log(torch.tensor([[0.2]]))
    old = torch.log(torch.tensor([[0.1]]))
    losses = distillation_token_losses(log_prob, torch.log(torch.tensor([[0.6]])), "k1")
    loss, metrics = distillation_loss(
        losses, torch.ones(1, 1), use_policy_gradient=True, log_prob=log_prob, old_log_prob=old
    )
    torch.testing.assert_close(loss, torch.tensor(-LN3 * 1.2))
    assert metrics["distillation/pg_clipfrac"].item() == 1.0
    loss_wide, _ = distillation_loss(
        losses, torch.ones(1, 1), use_policy_gradient=True, log_prob=log_prob, old_log_prob=old,
        clip_ratio_high=2.0,
    )  # fmt: skip
    torch.testing.assert_close(loss_wide, torch.tensor(-LN3 * 2.0))


def test_policy_gradient_needs_log_probs():
    with pytest.raises(ValueError, match="old_log_prob"):
        distillation_loss(torch.zeros(1, 1), torch.ones(1, 1), use_policy_gradient=True)


def test_combine_with_task_loss():
    task, distill = torch.tensor(2.0), torch.tensor(3.0)
    assert combine_with_task_loss(task, distill, use_task_rewards=True, distillation_loss_coef=0.5) == 3.5
    # without task rewards the task loss is dropped and the coefficient is not used (veRL)
    assert combine_with_task_loss(task, distill, use_task_rewards=False, distillation_loss_coef=0.5) == 3.0
