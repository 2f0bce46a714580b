"""DPPO (binary TV / KL), SAPO and DRO policy losses: hand-derived values and edge cases."""

import math

import pytest
import torch

from hybridrl.algos import get_policy_loss_fn
from hybridrl.algos.dppo import binary_kl
from hybridrl.algos.soft_pg import sapo_gate


def lp(*probs):
    return torch.tensor([list(probs)]).log()


def loss_and_grad(name, old, new, adv, mask=None, **kw):
    log_prob = new.clone().requires_grad_(True)
    mask = torch.ones_like(adv) if mask is None else mask
    loss, metrics = get_policy_loss_fn(name)(old, log_prob, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


# ----------------------------------------------------------------------------- DPPO
def test_dppo_tv_masks_tokens_past_the_tv_bound_in_the_advantage_direction():
    # q = 0.5 everywhere; p - q = [0.1, 0.3, -0.15, -0.05]; A = [+, +, -, -]; bound 0.2:
    # token 1 moved up by 0.3 > 0.2 with A > 0 -> masked; the others stay.
    old, new, adv = lp(0.5, 0.5, 0.5, 0.5), lp(0.6, 0.8, 0.35, 0.45), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, grad, m = loss_and_grad("dppo_tv", old, new, adv, clip_ratio=0.2, clip_ratio_c=3.0)
    ratio = torch.tensor([1.2, 1.6, 0.7, 0.9])
    per_token = -adv[0] * ratio * new[0] * torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert float(loss) == pytest.approx(float(per_token.mean()), abs=1e-6)
    torch.testing.assert_close(grad[0], torch.tensor([-0.3, 0.0, 0.175, 0.225]))  # -A r keep / 4 tokens
    assert float(m["pg_clipfrac"]) == pytest.approx(0.25)
    assert float(m["pg_clipfrac_lower"]) == 0.0
    assert float(m["ppo_kl"]) == pytest.approx(float(-(new - old).mean()), abs=1e-6)


def test_dppo_tv_asymmetric_bounds_and_truncation():
    old, new, adv = lp(0.5, 0.5), lp(0.6, 0.35), torch.tensor([[1.0, -1.0]])
    # clip_ratio_high 0.05 masks the +0.1 step; clip_ratio_low 0.2 keeps the -0.15 step
    _, grad, m = loss_and_grad("dppo_tv", old, new, adv, clip_ratio=0.2, clip_ratio_high=0.05)
    assert float(grad[0, 0]) == 0.0 and float(grad[0, 1]) == pytest.approx(0.7 / 2)
    # truncation c = 1.1: the kept token with ratio 1.2 gets weight 1.1 and counts in pg_clipfrac_lower
    _, grad, m = loss_and_grad("dppo_tv", old, new, adv, clip_ratio=0.3, clip_ratio_c=1.1)
    assert float(grad[0, 0]) == pytest.approx(-1.1 / 2)
    assert float(m["pg_clipfrac_lower"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        loss_and_grad("dppo_tv", old, new, adv, clip_ratio=0.2, clip_ratio_low=-0.1)


def test_binary_kl_value():
    # q = 0.5, p = 0.8: 0.5 log(0.5 / 0.8) + 0.5 log(0.5 / 0.2)
    expected = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert float(binary_kl(lp(0.8), lp(0.5))) == pytest.approx(expected, abs=1e-6)
    assert float(binary_kl(lp(0.3), lp(0.3))) == pytest.approx(0.0, abs=1e-7)


def test_dppo_kl_masks_only_steps_in_the_advantage_direction():
    # q = 0.5; KL_bin(0.6) = 0.020 (inside 0.1), KL_bin(0.8) = KL_bin(0.2) = 0.223 (outside).
    # A > 0: p = 0.6 kept, p = 0.8 masked, p = 0.2 (moved against A) kept;
    # A < 0: p = 0.2 masked, p = 0.8 (moved against A) kept.
    old = lp(0.5, 0.5, 0.5, 0.5, 0.5)
    new = lp(0.6, 0.8, 0.2, 0.2, 0.8)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]])
    loss, grad, m = loss_and_grad("dppo_kl", old, new, adv, clip_ratio=0.1, clip_ratio_c=3.0)
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    ratio = new[0].exp() / 0.5
    torch.testing.assert_close(grad[0], -adv[0] * ratio * keep / 5)
    assert float(loss) == pytest.approx(float((-adv[0] * ratio * new[0] * keep).mean()), abs=1e-6)
    assert float(m["pg_clipfrac"]) == pytest.approx(0.4)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masked_tokens_do_not_count(name):
    old, new = lp(0.5, 0.5, 0.5), lp(0.6, 0.99, 0.4)
    adv, mask = torch.tensor([[1.0, 1.0, -1.0]]), torch.tensor([[1.0, 0.0, 1.0]])
    _, grad, m = loss_and_grad(name, old, new, adv, mask, clip_ratio=0.2)
    assert float(m["pg_clipfrac"]) == 0.0  # the far-moved token 1 is padding
    assert float(grad[0, 1]) == 0.0


# ----------------------------------------------------------------------------- SAPO
def test_sapo_gate_values():
    assert float(sapo_gate(torch.tensor(1.0), 2.0)) == pytest.approx(1.0)  # 2 / tau at r = 1
    assert float(sapo_gate(torch.tensor(2.0), 1.0)) == pytest.approx(4 / (1 + math.exp(-1)))


def test_sapo_on_policy_is_the_policy_gradient():
    # r = 1: the gate is 2 / tau and its slope 1, so the gradient is -A / (tokens of the sequence)
    old = new = lp(0.5, 0.5)
    adv = torch.tensor([[1.0, -1.0]])
    loss, grad, m = loss_and_grad("sapo", old, new, adv, tau_pos=1.0, tau_neg=2.0)
    assert float(loss) == pytest.approx((-2.0 + 1.0) / 2)  # -2/1 * 1 and -2/2 * (-1), token-mean
    torch.testing.assert_close(grad[0], torch.tensor([-0.5, 0.5]))
    assert float(m["pg_clipfrac"]) == 0.0 and float(m["ppo_kl"]) == 0.0


def test_sapo_off_policy_gate_and_sequence_mean():
    # one token with r = 2, A = 1, tau_pos = 1: loss -4 sigmoid(1); gradient -A f'(r) r = -8 s (1 - s)
    s = 1 / (1 + math.exp(-1))
    loss, grad, _ = loss_and_grad("sapo", lp(0.25), lp(0.5), torch.tensor([[1.0]]), tau_pos=1.0)
    assert float(loss) == pytest.approx(-4 * s, abs=1e-6)
    assert float(grad[0, 0]) == pytest.approx(-8 * s * (1 - s), abs=1e-6)
    # always seq-mean-token-mean: sequences of 1 and 3 tokens weigh the same whatever loss_agg_mode says
    old = new = torch.full((2, 3), math.log(0.5))
    adv, mask = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]]), torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    for mode in ("token-mean", "seq-mean-token-sum"):
        loss, _, _ = loss_and_grad("sapo", old, new, adv, mask, loss_agg_mode=mode, tau_pos=1.0)
        assert float(loss) == pytest.approx((-2.0 + -6.0) / 2)


def test_sapo_bad_tau_is_an_error():
    with pytest.raises(ValueError, match="tau_neg > 0"):
        loss_and_grad("sapo", lp(0.5), lp(0.5), torch.tensor([[1.0]]), tau_neg=0.0)


# ----------------------------------------------------------------------------- DRO
def test_dro_value_and_gradient():
    # log pi = -1, log pi_old = -1.5, A = 2, beta = 0.4: L = -(-2 - 0.2 * 0.25) = 2.05,
    # dL/dlog pi = -(A - beta (log pi - log pi_old)) = -1.8
    old, new, adv = torch.tensor([[-1.5]]), torch.tensor([[-1.0]]), torch.tensor([[2.0]])
    loss, grad, m = loss_and_grad("dro", old, new, adv, dro_beta=0.4)
    assert float(loss) == pytest.approx(2.05)
    assert float(grad[0, 0]) == pytest.approx(-1.8)
    assert float(m["ppo_kl"]) == pytest.approx(-0.5)


def test_dro_masked_tokens_and_missing_beta():
    old, new = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-1.0, 5.0]])
    adv, mask = torch.tensor([[1.0, 9.0]]), torch.tensor([[1.0, 0.0]])
    loss, grad, _ = loss_and_grad("dro", old, new, adv, mask, dro_beta=0.4)
    assert float(loss) == pytest.approx(1.0) and float(grad[0, 1]) == 0.0
    for beta in (None, 0.0):
        with pytest.raises(ValueError, match="policy_loss.dro_beta"):
            loss_and_grad("dro", old, new, adv, dro_beta=beta)
