"""Advantage estimators: hand-derived values, multi-turn masking, loop == vectorised."""

import math

import numpy as np
import pytest
import torch

from hybridrl.algos import (
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_outcome_advantage_loop,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_outcome_advantage_loop,
    estimator_needs_critic,
    get_adv_estimator_fn,
    masked_mean,
)


def whiten(x: torch.Tensor) -> torch.Tensor:
    """Reference whitening of a flat tensor: (x - mean) / unbiased std."""
    return (x - x.mean()) / x.std()


# ---------------------------------------------------------------- GAE


def test_gae_hand_derived():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    mask = torch.ones(1, 3)
    # gamma = lam = 0.5, backwards:
    # t=2: delta = 1 + 0.5*0 - 0.75 = 0.25                   A2 = 0.25
    # t=1: delta = 0 + 0.5*0.75 - 0.25 = 0.125                A1 = 0.125 + 0.25*0.25 = 0.1875
    # t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375                A0 = -0.375 + 0.25*0.1875 = -0.328125
    raw = torch.tensor([-0.328125, 0.1875, 0.25])
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(returns, (raw + values[0]).unsqueeze(0))  # [0.171875, 0.4375, 1.0]
    torch.testing.assert_close(advantages, whiten(raw).unsqueeze(0))


def test_gae_passes_through_masked_tool_tokens():
    # Token 1 is tool output (mask 0): its reward/value are garbage and must be skipped.
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.75]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    # t=2: A2 = 0.25; t=1 skipped (V_next stays 0.75, A_next stays 0.25)
    # t=0: delta = 0 + 0.5*0.75 - 0.5 = -0.125, A0 = -0.125 + 0.25*0.25 = -0.0625
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.4375, 0.0, 1.0]]))
    # two values whiten to -+1/sqrt(2)
    torch.testing.assert_close(advantages, torch.tensor([[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]]))
    # identical to the same response with the tool token removed
    adv_short, ret_short = compute_gae_advantage_return(
        torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.75]]), torch.ones(1, 2), gamma=0.5, lam=0.5
    )
    torch.testing.assert_close(advantages[:, [0, 2]], adv_short)
    torch.testing.assert_close(returns[:, [0, 2]], ret_short)


def test_gae_trailing_padding_is_ignored():
    rewards = torch.tensor([[0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.75, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    adv_short, ret_short = compute_gae_advantage_return(rewards[:, :2], values[:, :2], mask[:, :2], 0.9, 0.8)
    torch.testing.assert_close(adv[:, :2], adv_short)
    torch.testing.assert_close(ret[:, :2], ret_short)
    assert adv[0, 2] == 0 and ret[0, 2] == 0


# ---------------------------------------------------------------- REINFORCE++ / ReMax

REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])  # the 7.0 sits under the mask
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_reinforce_plus_plus():
    # gamma = 0.5: seq 0 G = [0.25, 0.5, 1]; seq 1 G = [0 + 0.5*2, 2, masked] = [1, 2, 0]
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(REWARDS, MASK, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    valid = whiten(torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0]))  # whitened over the 5 valid tokens
    torch.testing.assert_close(
        advantages, torch.tensor([[valid[0], valid[1], valid[2]], [valid[3], valid[4], 0.0]])
    )


def test_remax():
    # undiscounted return-to-go: seq 0 [1, 1, 1], seq 1 [2, 2, 0]; baselines 0.5 and 1.0
    advantages, returns = compute_remax_outcome_advantage(REWARDS, torch.tensor([0.5, 1.0]), MASK)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))


# ---------------------------------------------------------------- group-relative estimators


def outcome_batch(scores, lengths, width=4):
    """Rewards with each score on the last valid token, and the mask; garbage under the mask."""
    rewards = torch.full((len(scores), width), 100.0)
    mask = torch.zeros(len(scores), width)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        mask[i, :length] = 1
        rewards[i, :length] = 0
        rewards[i, length - 1] = score
    return rewards, mask


INDEX = np.array(["a", "a", "a", "b", "b", "c"])
SCORES = [1.0, 0.0, 0.0, 2.0, 4.0, 3.0]
LENGTHS = [3, 1, 2, 2, 3, 4]


def per_response(advantages, mask):
    """The advantage of each response (constant over its tokens, 0 under the mask)."""
    first = advantages[:, 0]
    torch.testing.assert_close(advantages, first.unsqueeze(-1) * mask)
    return first


@pytest.mark.parametrize("fn", [compute_grpo_outcome_advantage, compute_grpo_outcome_advantage_loop])
def test_grpo(fn):
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, returns = fn(rewards, mask, INDEX, epsilon=1e-6)
    # a = [1, 0, 0]: mean 1/3, unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3, std 1/sqrt(3)
    # b = [2, 4]: mean 3, std sqrt(2); c = [3] alone: mean 0, std 1
    s3, s2 = 1 / math.sqrt(3), math.sqrt(2)
    expected = [
        (2 / 3) / (s3 + 1e-6),
        (-1 / 3) / (s3 + 1e-6),
        (-1 / 3) / (s3 + 1e-6),
        -1 / (s2 + 1e-6),
        1 / (s2 + 1e-6),
        3 / (1 + 1e-6),
    ]
    torch.testing.assert_close(per_response(advantages, mask), torch.tensor(expected))
    torch.testing.assert_close(returns, advantages)


@pytest.mark.parametrize("fn", [compute_grpo_outcome_advantage, compute_grpo_outcome_advantage_loop])
def test_dr_grpo_without_std(fn):
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = fn(rewards, mask, INDEX, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        per_response(advantages, mask), torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 3.0])
    )


@pytest.mark.parametrize("fn", [compute_rloo_outcome_advantage, compute_rloo_outcome_advantage_loop])
def test_rloo(fn):
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = fn(rewards, mask, INDEX)
    # a: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); b: 2 - 4, 4 - 2; c alone: 3 - 0
    torch.testing.assert_close(
        per_response(advantages, mask), torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0, 3.0])
    )


def test_reinforce_plus_plus_baseline():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, INDEX)
    centered = [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 3.0]  # minus the group mean (0 for c)
    tokens = torch.tensor([c for c, n in zip(centered, LENGTHS) for _ in range(n)])  # one entry per token
    mean, std = tokens.mean(), tokens.std()
    torch.testing.assert_close(per_response(advantages, mask), (torch.tensor(centered) - mean) / std)


def test_opo():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    advantages, _ = compute_opo_outcome_advantage(rewards, mask, INDEX)
    # a: lengths [3, 1, 2] -> b = (3*1 + 1*0 + 2*0) / 6 = 0.5; b: lengths [2, 3] -> (2*2 + 3*4) / 5 = 3.2
    torch.testing.assert_close(
        per_response(advantages, mask), torch.tensor([0.5, -0.5, -0.5, -1.2, 0.8, 3.0])
    )


def test_gpg():
    index = np.array(["a", "a", "b", "b", "c"])
    rewards, mask = outcome_batch([1.0, 1.0, 0.0, 2.0, 3.0], [2, 3, 1, 4, 2])
    advantages, _ = compute_gpg_outcome_advantage(rewards, mask, index, f_norm=1.0)
    # group a is all-equal (M = 2 responses without signal), B = 5 -> alpha = 5 / 3
    # b: [0, 2] - 1 = [-1, 1]; c alone: 3 - 0
    alpha = 5 / 3
    expected = torch.tensor([0.0, 0.0, -alpha, alpha, 3 * alpha])
    torch.testing.assert_close(per_response(advantages, mask), expected)
    halved, _ = compute_gpg_outcome_advantage(rewards, mask, index, f_norm=2.0)
    torch.testing.assert_close(halved, advantages / 2)


def test_grpo_passk():
    index = np.array(["a", "a", "a", "b", "b"])
    rewards, mask = outcome_batch([1.0, 0.0, 0.5, 1.0, 1.0], [2, 3, 1, 4, 2])
    advantages, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # a: only the unique best gets best - second best = 1 - 0.5; b: a tie, nobody is indispensable
    torch.testing.assert_close(per_response(advantages, mask), torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0]))
    normed, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, epsilon=1e-6)
    # std of a = [1, 0, 0.5] is 0.5; b has std 0 but advantage 0 -> 0, not nan
    torch.testing.assert_close(per_response(normed, mask), torch.tensor([0.5 / (0.5 + 1e-6), 0, 0, 0, 0]))


def test_grpo_passk_rejects_singleton_groups():
    rewards, mask = outcome_batch([1.0, 0.0, 0.5], [2, 3, 1])
    with pytest.raises(ValueError, match=">= 2 responses per prompt"):
        compute_grpo_passk_outcome_advantage(rewards, mask, np.array(["a", "a", "b"]))


# ---------------------------------------------------------------- loop == vectorised


def random_groups(sizes, seed, width=6, string_uids=False):
    gen = torch.Generator().manual_seed(seed)
    uids = np.concatenate([np.full(size, g) for g, size in enumerate(sizes)])
    uids = uids[torch.randperm(len(uids), generator=gen).numpy()]  # groups interleaved
    if string_uids:
        uids = np.array([f"uid-{u}" for u in uids], dtype=object)
    lengths = torch.randint(1, width + 1, (len(uids),), generator=gen)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    rewards = torch.randn(len(uids), width, generator=gen) * mask
    rewards[:2] = torch.round(rewards[:2])  # some ties
    return rewards, mask, uids


@pytest.mark.parametrize("sizes", [[1], [2, 2, 2], [1, 3, 5, 8], [4] * 16, [7, 1, 1, 2]])
@pytest.mark.parametrize("string_uids", [False, True])
def test_grpo_loop_equals_vectorised(sizes, string_uids):
    rewards, mask, uids = random_groups(sizes, seed=sum(sizes), string_uids=string_uids)
    for norm in (True, False):
        fast = compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=norm)
        slow = compute_grpo_outcome_advantage_loop(rewards, mask, uids, norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", [[1], [2, 2, 2], [1, 3, 5, 8], [4] * 16, [7, 1, 1, 2]])
@pytest.mark.parametrize("string_uids", [False, True])
def test_rloo_loop_equals_vectorised(sizes, string_uids):
    rewards, mask, uids = random_groups(sizes, seed=100 + sum(sizes), string_uids=string_uids)
    fast = compute_rloo_outcome_advantage(rewards, mask, uids)
    slow = compute_rloo_outcome_advantage_loop(rewards, mask, uids)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- registry contract


def test_registry_entries_route_to_the_direct_functions():
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    via_registry = get_adv_estimator_fn("grpo")(
        rewards,
        mask,
        index=INDEX,
        values=None,
        gamma=1.0,
        lam=1.0,
        norm_adv_by_std_in_grpo=False,
        epsilon=1e-6,
    )
    direct = compute_grpo_outcome_advantage(rewards, mask, INDEX, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(via_registry, direct)
    assert get_adv_estimator_fn("grpo") is get_adv_estimator_fn("grpo_vectorized")
    assert get_adv_estimator_fn("rloo") is get_adv_estimator_fn("rloo_vectorized")


def test_estimator_needs_critic():
    assert estimator_needs_critic("gae")
    assert not any(estimator_needs_critic(n) for n in ("grpo", "rloo", "remax", "reinforce_plus_plus"))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        estimator_needs_critic("nope")


def test_missing_inputs_raise_clear_errors():
    rewards, mask = REWARDS, MASK
    with pytest.raises(ValueError, match="'gae' needs values"):
        get_adv_estimator_fn("gae")(rewards, mask, index=np.arange(2), values=None)
    with pytest.raises(ValueError, match="'remax' needs reward_baselines"):
        get_adv_estimator_fn("remax")(rewards, mask, index=np.arange(2), reward_baselines=None)


def test_grpo_batch_whitened_is_grpo_whitened_over_the_batch_tokens():
    """Two groups of (1, 0) rewards: GRPO gives +-1/sqrt(2) on every token; the 8 tokens then have
    mean 0 and unbiased variance 4/7, so whitening gives +-sqrt(7/8). A masked token is 0."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    index = np.array(["a", "a", "b", "b"])
    adv, ret = get_adv_estimator_fn("grpo_batch_whitened")(rewards, mask, index=index)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 2)
    torch.testing.assert_close(adv, sign * (7 / 8) ** 0.5, atol=1e-4, rtol=0)
    assert torch.equal(adv, ret)
    mask[1, 1] = 0
    adv, _ = get_adv_estimator_fn("grpo_batch_whitened")(rewards, mask, index=index)
    assert adv[1, 1] == 0 and masked_mean(adv, mask).abs() < 1e-6
