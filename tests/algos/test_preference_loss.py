"""Preference losses (algos/preference.py): hand-derived values, gradients, and the loss forms."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algos.preference import bradley_terry_loss, dpo_loss, sequence_log_probs


def test_bradley_terry_hand_values():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    loss, m = bradley_terry_loss(c, r)
    expected = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["accuracy"].item() == 0.5 and m["margin"].item() == pytest.approx(0.5)


def test_bradley_terry_margin_and_centering():
    c, r = torch.tensor([1.0]), torch.tensor([0.0])
    loss, _ = bradley_terry_loss(c, r, margin=torch.tensor([1.0]))
    assert loss.item() == pytest.approx(math.log(2.0), rel=1e-6)  # delta - m = 0
    loss_c, _ = bradley_terry_loss(c, r, center_rewards_coefficient=0.5)
    assert loss_c.item() == pytest.approx(math.log1p(math.exp(-1.0)) + 0.5 * 1.0, rel=1e-6)


def test_bradley_terry_is_shift_invariant():
    """A constant added to every score (the head's bias) changes neither loss nor gradient."""
    c = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
    r = torch.tensor([0.1, 0.4, -0.5])
    a, _ = bradley_terry_loss(c, r)
    b, _ = bradley_terry_loss(c + 5.0, r + 5.0)
    assert a.item() == pytest.approx(b.item(), abs=1e-6)


def test_sequence_log_probs():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    s, n = sequence_log_probs(lp, mask)
    assert s.tolist() == [-5.0, -1.0] and n.tolist() == [2.0, 2.0]


def test_dpo_sigmoid_hand_value_and_label_smoothing():
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.0))
    h = (pc - pr) - (rc - rr)  # 2
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(0.5) and m["rewards/rejected"].item() == pytest.approx(
        -0.5
    )
    assert m["rewards/accuracies"].item() == 1.0 and m["rewards/margins"].item() == pytest.approx(1.0)
    ls, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.2)
    x = 0.5 * float(h)
    assert ls.item() == pytest.approx(
        0.8 * math.log1p(math.exp(-x)) + 0.2 * math.log1p(math.exp(x)), rel=1e-6
    )


def test_ipo_averages_over_tokens():
    pc, pr, rc, rr = (torch.tensor([x]) for x in (-2.0, -6.0, -4.0, -4.0))
    lc, lr = torch.tensor([2.0]), torch.tensor([4.0])
    loss, _ = dpo_loss(pc, pr, rc, rr, chosen_lengths=lc, rejected_lengths=lr, loss_type="ipo", beta=0.25)
    h = (-1.0 - -1.5) - (-2.0 - -1.0)  # 1.5
    assert loss.item() == pytest.approx((h - 2.0) ** 2, rel=1e-6)
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(pc, pr, rc, rr, loss_type="ipo")


def test_simpo_is_reference_free():
    pc, pr = torch.tensor([-2.0]), torch.tensor([-8.0])
    lc, lr = torch.tensor([2.0]), torch.tensor([4.0])
    loss, m = dpo_loss(
        pc,
        pr,
        None,
        None,
        chosen_lengths=lc,
        rejected_lengths=lr,
        loss_type="simpo",
        beta=2.0,
        simpo_gamma=1.0,
    )
    x = 2.0 * ((-1.0 - -2.0) - 0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-x)), rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="reference"):
        dpo_loss(pc, pr, None, None, loss_type="sigmoid")
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(pc, pr, pc, pr, loss_type="hinge")


def test_dpo_gradient_matches_closed_form():
    """d L / d log pi(y_c) = -beta sigmoid(-beta h) for the sigmoid loss (one pair)."""
    pc = torch.tensor([-1.0], requires_grad=True)
    pr, rc, rr = torch.tensor([-1.5]), torch.tensor([-1.2]), torch.tensor([-1.1])
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.3)
    loss.backward()
    h = (-1.0 + 1.5) - (-1.2 + 1.1)
    assert pc.grad.item() == pytest.approx(-0.3 / (1 + math.exp(0.3 * h)), rel=1e-6)
