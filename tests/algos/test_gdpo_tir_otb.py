"""GDPO and the multi-turn optimal token baseline: hand-derived values and edge cases."""

import math

import numpy as np
import pytest
import torch

from hybridrl.algos import (
    compute_gdpo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_tir_optimal_token_baseline_advantage,
    get_adv_estimator_fn,
)

EPS = 1e-6


def one_token_rows(n):
    return torch.zeros(n, 1), torch.ones(n, 1)


# ----------------------------------------------------------------------------- GDPO
def test_gdpo_normalises_each_component_then_whitens():
    # One group of 3: acc = [1, 0, 0], fmt = [1, 1, 0]. Per component (std unbiased):
    #   acc: mean 1/3, std 1/sqrt(3) -> A = sqrt(3) * [2/3, -1/3, -1/3]
    #   fmt: mean 2/3, std 1/sqrt(3) -> A = sqrt(3) * [1/3, 1/3, -2/3]
    # weights [1, 0.5]: A' = (1/sqrt(3)) * [2.5, -0.5, -2]; whitening (mean 0) divides by the
    # unbiased std sqrt((6.25 + 0.25 + 4) / 2) of [2.5, -0.5, -2].
    rewards, mask = one_token_rows(3)
    comps = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_gdpo_outcome_advantage(rewards, mask, np.zeros(3), comps, [1.0, 0.5])
    expected = torch.tensor([2.5, -0.5, -2.0]) / math.sqrt(5.25)
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-5, rtol=0)
    assert torch.equal(adv, ret)
    # equal weights: A' = sqrt(3) * [1, 0, -1], whitened to [1, 0, -1] (what GRPO on the sum gives here)
    adv, _ = compute_gdpo_outcome_advantage(rewards, mask, np.zeros(3), comps)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, 0.0, -1.0]), atol=1e-5, rtol=0)


def test_gdpo_keeps_apart_what_grpo_on_the_sum_collapses():
    # acc = [1, 0], fmt = [0, 1] in group 0 and acc = [1, 0], fmt = [0, 0] in group 1: the sums
    # are [1, 1] (no signal) and [1, 0]; GDPO gives group 0 advantage 0 as well (the components
    # cancel) but does not let fmt's all-equal group 1 change acc's signal there.
    rewards, mask = one_token_rows(4)
    comps = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    adv, _ = compute_gdpo_outcome_advantage(rewards, mask, np.array([0, 0, 1, 1]), comps)
    c = 0.5 / (math.sqrt(0.5) + EPS)  # acc in group 1: (1 - 0.5) / std
    values = torch.tensor([0.0, 0.0, c, -c])
    expected = (values - values.mean()) / values.std()
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-5, rtol=0)


def test_gdpo_all_equal_groups_give_zero():
    rewards, mask = torch.zeros(4, 3), torch.ones(4, 3)
    comps = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    adv, _ = compute_gdpo_outcome_advantage(rewards, mask, np.array([0, 0, 1, 1]), comps)
    assert torch.equal(adv, torch.zeros(4, 3))


def test_gdpo_one_sample_group_and_masked_tokens():
    # group 0 = rows 0, 1 (acc 1, 0) with lengths 2 and 1; row 2 is alone (acc 1: mean 0, std 1).
    # Whitening weighs tokens: the values are [c, c, -c, 1/(1 + eps)] over the 4 unmasked tokens.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    comps = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = compute_gdpo_outcome_advantage(torch.zeros(3, 2), mask, np.array([0, 0, 1]), comps)
    c = 0.5 / (math.sqrt(0.5) + EPS)
    tokens = torch.tensor([c, c, -c, 1 / (1 + EPS)])
    w = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    expected = torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_gdpo_one_component_without_std_is_reinforce_plus_plus_baseline():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(5) < torch.randint(1, 6, (8,), generator=gen)[:, None]).float()
    scores = torch.randint(0, 3, (8,), generator=gen).float()
    rewards = torch.zeros(8, 5).scatter(1, (mask.sum(-1).long() - 1)[:, None], scores[:, None])
    index = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    gdpo, _ = compute_gdpo_outcome_advantage(
        rewards, mask, index, scores[None], norm_adv_by_std_in_grpo=False
    )
    rpp, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(gdpo, rpp)
    no_components, _ = compute_gdpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(no_components, rpp)  # None: the one component is sum_t r_t


def test_gdpo_bad_components_and_weights_are_errors():
    rewards, mask = one_token_rows(2)
    with pytest.raises(ValueError, match="one weight per component"):
        compute_gdpo_outcome_advantage(rewards, mask, np.zeros(2), torch.ones(2, 2), [1.0])
    with pytest.raises(ValueError, match=r"shape \(K, B\)"):
        compute_gdpo_outcome_advantage(rewards, mask, np.zeros(2), torch.ones(3))


def test_gdpo_registry_entry_passes_components_and_weights():
    rewards, mask = one_token_rows(3)
    comps = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv, _ = get_adv_estimator_fn("gdpo")(
        rewards, mask, index=np.zeros(3), reward_components=comps, reward_weights=[1.0, 0.5], gamma=1.0
    )
    torch.testing.assert_close(
        adv[:, 0], torch.tensor([2.5, -0.5, -2.0]) / math.sqrt(5.25), atol=1e-5, rtol=0
    )


# ----------------------------------------------------------------------------- TIR OTB
def unit_weights(shape):
    """old_log_probs / sum_pi_squared with ||s_t||^2 = 1 - 2 pi + sum pi^2 = 1 at every step, so W_k = k."""
    return torch.full(shape, math.log(0.5)), torch.full(shape, 1.0)


def test_tir_otb_counts_steps_in_policy_tokens_and_zeroes_the_tail():
    # row 0: tokens at 0, 2, 3 (a tool output at 1), reward 1 at the end -> G = [1, 1, 1], W = [1, 2, 3]
    # row 1: tokens at 0, 1, reward 0                                 -> G = [0, 0],    W = [1, 2]
    # B_1 = (1*1 + 0*1) / 2 = 0.5, B_2 = (1*2 + 0*2) / 4 = 0.5; step 3 has row 0 alone: zero tail -> B_3 = 0.
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    old, spp = unit_weights((2, 4))
    adv, ret = compute_tir_optimal_token_baseline_advantage(rewards, mask, np.zeros(2), old, spp)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5, 1.0], [-0.5, -0.5, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    # without the zero tail, step 3's baseline is row 0's own return: advantage ~0 there
    adv, _ = compute_tir_optimal_token_baseline_advantage(
        rewards, mask, np.zeros(2), old, spp, handle_zero_tail=False
    )
    torch.testing.assert_close(adv[0], torch.tensor([0.5, 0.0, 0.5, 0.0]), atol=1e-6, rtol=0)
    # the position-aligned OTB compares row 0's 2nd token (position 2) with nothing: advantage ~0 there
    otb, _ = compute_optimal_token_baseline_advantage(rewards, mask, np.zeros(2), old, spp)
    assert abs(float(otb[0, 2])) < 1e-6 and float(adv[0, 2]) == pytest.approx(0.5)


def test_tir_otb_importance_weights_scale_the_path_weights():
    # rho^2 = 3 on row 1: W = [1, 2] for row 0 (G = 1) and [3, 6] for row 1 (G = 0): B = 1/4 at both steps
    mask, rewards = torch.ones(2, 2), torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old, spp = unit_weights((2, 2))
    rho = torch.tensor([[1.0, 1.0], [math.sqrt(3), math.sqrt(3)]])
    adv, _ = compute_tir_optimal_token_baseline_advantage(rewards, mask, np.zeros(2), old, spp, rho)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75], [-0.25, -0.25]]))


def test_tir_otb_one_sample_groups_and_empty_responses_have_no_baseline():
    # row 0 alone in group 0; row 1 shares group 1 with row 2, whose response is empty: row 2 is left
    # out of the group, so row 1 is alone as well (A = G), and row 2's advantage is 0.
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    old, spp = unit_weights((3, 3))
    for zero_tail in (True, False):
        adv, ret = compute_tir_optimal_token_baseline_advantage(
            rewards, mask, np.array([0, 1, 1]), old, spp, handle_zero_tail=zero_tail
        )
        torch.testing.assert_close(adv, ret)
        torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 0.0], [3.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))


def test_tir_otb_all_equal_groups_give_zero():
    mask = torch.ones(3, 3)
    rewards = torch.tensor([[0.0, 0.0, 1.0]] * 3)
    old, spp = unit_weights((3, 3))
    adv, _ = compute_tir_optimal_token_baseline_advantage(rewards, mask, np.zeros(3), old, spp)
    torch.testing.assert_close(adv, torch.zeros(3, 3), atol=1e-6, rtol=0)


def test_tir_otb_without_holes_equals_otb():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 5, 3, 4, 4, 2, 5, 5])  # no group has a unique longest response
    mask = (torch.arange(5) < lengths[:, None]).float()
    rewards = torch.randn(8, 5, generator=gen) * mask
    old = -torch.rand(8, 5, generator=gen) * 2
    spp = torch.rand(8, 5, generator=gen)
    index = np.array([0, 0, 1, 1, 1, 1, 2, 2])
    for zero_tail in (True, False):
        tir, tir_ret = compute_tir_optimal_token_baseline_advantage(
            rewards, mask, index, old, spp, handle_zero_tail=zero_tail
        )
        otb, otb_ret = compute_optimal_token_baseline_advantage(rewards, mask, index, old, spp)
        torch.testing.assert_close(tir, otb)
        torch.testing.assert_close(tir_ret, otb_ret)


def test_tir_otb_registry_entry_needs_sum_pi_squared():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=True"):
        get_adv_estimator_fn("tir_optimal_token_baseline")(mask, mask, index=np.zeros(2))
