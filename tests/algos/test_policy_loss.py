"""Policy losses: hand-derived values, gradients and metrics."""

import math

import pytest
import torch

from hybridrl.algos import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_decoupled,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_vanilla,
)


def log_probs_with_ratios(ratios, log_prob=None):
    """(old_log_prob, log_prob requiring grad) such that exp(log_prob - old) = ratios."""
    ratios = torch.tensor(ratios)
    log_prob = torch.zeros_like(ratios) if log_prob is None else torch.log(torch.tensor(log_prob))
    return log_prob - torch.log(ratios), log_prob.clone().requires_grad_(True)


# ---------------------------------------------------------------- vanilla PPO

# clip 0.2, dual clip c = 3:
# t0: r=1.5, A=+1: max(-1.5, -1.2)  = -1.2   clipped
# t1: r=0.5, A=+1: max(-0.5, -0.8)  = -0.5
# t2: r=1.1, A=-2: max(2.2, 2.2)    =  2.2   (below the dual cap 6)
# t3: r=5.0, A=-1: max(5.0, 1.2)    =  5.0 -> min(5, 3) = 3   dual-clipped
RATIOS = [[1.5, 0.5, 1.1, 5.0]]
ADV = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
MASK4 = torch.ones(1, 4)


def test_vanilla_hand_derived():
    old, new = log_probs_with_ratios(RATIOS)
    loss, metrics = compute_policy_loss_vanilla(old, new, ADV, MASK4, clip_ratio=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2 + 3.0) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 4)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    ppo_kl = -(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(5.0)) / 4
    assert metrics["ppo_kl"].item() == pytest.approx(ppo_kl)
    (grad,) = torch.autograd.grad(loss, new)
    # d(-A r)/d log pi = -A r on unclipped tokens, 0 on clipped ones; / 4 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5 / 4, 2.2 / 4, 0.0]]))


def test_vanilla_clip_higher():
    old, new = log_probs_with_ratios(RATIOS)
    loss, _ = compute_policy_loss_vanilla(old, new, ADV, MASK4, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 2.2 + 3.0) / 4)  # t0 now clipped at 1.28


def test_vanilla_without_dual_clip_and_with_is_weights():
    old, new = log_probs_with_ratios(RATIOS)
    loss, metrics = compute_policy_loss_vanilla(old, new, ADV, MASK4, clip_ratio_c=None)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2 + 5.0) / 4)
    assert metrics["pg_clipfrac_lower"].item() == 0
    weights = torch.tensor([[1.0, 2.0, 0.0, 1.0]])
    loss, _ = compute_policy_loss_vanilla(old, new, ADV, MASK4, rollout_is_weights=weights)
    assert loss.item() == pytest.approx((-1.2 - 1.0 + 0.0 + 3.0) / 4)


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_dual_clip_constant_must_exceed_one(bad):
    old, new = log_probs_with_ratios(RATIOS)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss_vanilla(old, new, ADV, MASK4, clip_ratio_c=bad)


def test_bad_clip_ratio():
    old, new = log_probs_with_ratios(RATIOS)
    with pytest.raises(ValueError, match="clip_ratio_low < 1"):
        compute_policy_loss_vanilla(old, new, ADV, MASK4, clip_ratio_low=1.5)


# ---------------------------------------------------------------- decoupled (AReaL)


def test_decoupled_hand_derived():
    # proximal = old_log_prob = 0; behave weights w = pi_prox / pi_behav = [1.5, 0.5, 3.0], cap 2
    behave = -torch.log(torch.tensor([[1.5, 0.5, 3.0]]))
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.0, 1.5, 1.0]])).requires_grad_(True)  # u = pi / pi_prox
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    loss, m = compute_policy_loss_decoupled(
        old, new, adv, mask, behave_log_prob=behave, behave_imp_weight_cap=2.0, clip_ratio=0.2
    )
    # t0: -1 * 1.0 * w 1.5 = -1.5; t1: max(-1.5, -1.2) * 0.5 = -0.6; t2: w 3 > cap -> dropped
    # token-mean over all 3 response tokens (dropped ones still count, as in AReaL)
    assert loss.item() == pytest.approx((-1.5 - 0.6 + 0.0) / 3)
    assert m["behave_imp_weight"].item() == pytest.approx((1.5 + 0.5) / 2)
    assert m["behave_mask_frac"].item() == pytest.approx(1 / 3)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, torch.tensor([[-1.5 / 3, 0.0, 0.0]]))


def test_decoupled_equals_vanilla_when_on_policy():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=gen) * 0.1
    new = old + torch.randn(3, 5, generator=gen) * 0.3
    adv, mask = torch.randn(3, 5, generator=gen), torch.ones(3, 5)
    vanilla, _ = compute_policy_loss_vanilla(old, new, adv, mask)
    decoupled, m = compute_policy_loss_decoupled(
        old, new, adv, mask, behave_log_prob=old, behave_imp_weight_cap=5.0
    )
    torch.testing.assert_close(decoupled, vanilla)
    assert m["behave_imp_weight"].item() == pytest.approx(1.0)


def test_decoupled_needs_behave_log_prob():
    old, new = log_probs_with_ratios([[1.0]])
    with pytest.raises(ValueError, match="needs behave_log_prob"):
        compute_policy_loss_decoupled(old, new, torch.ones(1, 1), torch.ones(1, 1))


# ---------------------------------------------------------------- GSPO


def test_gspo_hand_derived():
    # seq 0: log ratios [0.1, 0.3] -> s = e^0.2 = 1.2214 > 1.2, A = +1 -> clipped to -1.2 per token
    # seq 1: log ratios [-0.1, (masked)] -> s = e^-0.1 = 0.9048, A = -1 -> 0.9048, inside the band
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.1, 0.3], [-0.1, 5.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    s1 = math.exp(-0.1)
    loss, m = compute_policy_loss_gspo(
        old, new, adv, mask, loss_agg_mode="seq-mean-token-mean", clip_ratio=0.2
    )
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)
    (grad,) = torch.autograd.grad(loss, new)
    # d s_{i,t} / d log pi_t = s_i; seq 1 has one token; / 2 sequences
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [s1 / 2, 0.0]]))
    token_mean, _ = compute_policy_loss_gspo(old, new, adv, mask, clip_ratio=0.2)
    assert token_mean.item() == pytest.approx((-1.2 - 1.2 + s1) / 3)


# ---------------------------------------------------------------- GPG / CISPO


def test_gpg_hand_derived():
    log_prob = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]])
    loss, m = compute_policy_loss_gpg(log_prob.detach(), log_prob, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx((-math.log(0.5) + math.log(0.25)) / 2)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]]))
    assert m["pg_clipfrac"].item() == 0 and m["ppo_kl"].item() == 0


def test_cispo_hand_derived():
    # ratios [1.5, 0.5, 1.0] -> clipped weights [1.2, 0.8, 1.0]; L = -sg(w) A log pi
    pi = [[0.3, 0.2, 0.5]]
    old, new = log_probs_with_ratios([[1.5, 0.5, 1.0]], log_prob=pi)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = compute_policy_loss_cispo(old, new, adv, torch.ones(1, 3), clip_ratio=0.2)
    expected = (-1.2 * math.log(0.3) - 0.8 * math.log(0.2) + 1.0 * math.log(0.5)) / 3
    assert loss.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(loss, new)
    # every token keeps a gradient, scaled by its clipped weight
    torch.testing.assert_close(grad, torch.tensor([[-1.2 / 3, -0.8 / 3, 1.0 / 3]]))
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3) and m["pg_clipfrac_lower"].item() == pytest.approx(
        1 / 3
    )


# ---------------------------------------------------------------- GMPO


def test_geo_mean_hand_derived():
    # clip 0.4 in log space, applied only where it lowers the objective:
    # seq 0, A = +1, log r = [0.6, -0.6] -> [0.4, -0.6] -> mean -0.1 -> L = -e^-0.1
    # seq 1, A = -1, log r = [-0.6, 0.6] -> [-0.4, 0.6] -> mean  0.1 -> L = +e^0.1
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.6, -0.6], [-0.6, 0.6]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = compute_policy_loss_geo_mean(old, new, adv, torch.ones(2, 2), clip_ratio=0.4)
    assert loss.item() == pytest.approx((-math.exp(-0.1) + math.exp(0.1)) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5) and m["pg_clipfrac_lower"].item() == pytest.approx(
        0.5
    )
    (grad,) = torch.autograd.grad(loss, new)
    # only unclipped tokens carry gradient: d/dlog r_t of -A e^{mean} = -A e^{mean} / |y|, / 2 sequences
    expected = torch.tensor([[0.0, -math.exp(-0.1) / 2 / 2], [0.0, math.exp(0.1) / 2 / 2]])
    torch.testing.assert_close(grad, expected)


# ---------------------------------------------------------------- covariance-based losses

# A = [4, 0, 0, 0] (mean 1), log pi = [0, -1, -1, -1] (mean -0.75)
# Cov terms: (A - 1)(log pi + 0.75) = [3 * 0.75, 0.25, 0.25, 0.25] = [2.25, 0.25, 0.25, 0.25]
COV_ADV = torch.tensor([[4.0, 0.0, 0.0, 0.0]])
COV_LOGP = torch.tensor([[0.0, -1.0, -1.0, -1.0]])


def test_clip_cov_removes_the_high_covariance_token():
    new = COV_LOGP.clone().requires_grad_(True)
    loss, m = compute_policy_loss_clip_cov(COV_LOGP, new, COV_ADV, MASK4, clip_cov_lb=1.0, clip_cov_ub=5.0)
    # ratio 1 everywhere; token 0 (Cov 2.25 in (1, 5)) is the only candidate and is removed
    assert loss.item() == 0.0
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 4)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.all(grad == 0)
    kept, m = compute_policy_loss_clip_cov(COV_LOGP, new, COV_ADV, MASK4, clip_cov_lb=3.0, clip_cov_ub=5.0)
    assert kept.item() == pytest.approx(-4 / 4) and m["pg_clipfrac"].item() == 0


def test_clip_cov_random_draw_is_reproducible():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(8, 16, generator=gen)
    logp = torch.randn(8, 16, generator=gen)
    mask = torch.ones(8, 16)
    kwargs = dict(clip_cov_ratio=0.02, clip_cov_lb=-100.0, clip_cov_ub=100.0)  # every token a candidate
    _, m1 = compute_policy_loss_clip_cov(
        logp, logp, adv, mask, generator=torch.Generator().manual_seed(1), **kwargs
    )
    # floor(0.02 * 128) = 2 tokens removed
    assert m1["pg_clipfrac"].item() == pytest.approx(2 / 128)
    l1, _ = compute_policy_loss_clip_cov(
        logp, logp, adv, mask, generator=torch.Generator().manual_seed(1), **kwargs
    )
    l2, _ = compute_policy_loss_clip_cov(
        logp, logp, adv, mask, generator=torch.Generator().manual_seed(1), **kwargs
    )
    assert l1.item() == l2.item()


def test_kl_cov_penalises_the_top_covariance_token():
    old = COV_LOGP.clone()
    old[0, 0] = -0.5  # log r = 0.5 on token 0
    new = COV_LOGP.clone().requires_grad_(True)
    loss, m = compute_policy_loss_kl_cov(old, new, COV_ADV, MASK4, kl_cov_ratio=0.01, ppo_kl_coef=1.0)
    # k = max(1, floor(0.01 * 4)) = 1 -> token 0: -4 e^0.5 + |0.5|; others -0 * 1 = 0
    assert loss.item() == pytest.approx((-4 * math.exp(0.5) + 0.5) / 4)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 4)
    (grad,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(grad, torch.tensor([[(-4 * math.exp(0.5) + 1.0) / 4, 0.0, 0.0, 0.0]]))
