"""Optimal token baseline: hand-derived numbers, veRL's per-group loop, and sum of pi^2."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from hybridrl import algos
from hybridrl.algos.otb import compute_optimal_token_baseline_advantage, sum_pi_squared_from_logits


def _reference_loop(rewards, mask, index, old_lp, sps, is_w=None, eps=1e-8):
    """veRL's formulation, written out group by group (the test's own code)."""
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_lp.exp() + sps
    if is_w is not None:
        w = w * is_w**2
    w_cum = (w * mask).cumsum(-1)
    baselines = torch.zeros_like(returns)
    groups = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        r = torch.tensor(rows)
        num = (returns[r] * w_cum[r] * mask[r]).sum(0)
        den = (w_cum[r] * mask[r]).sum(0) + eps
        baselines[r] = (num / den).expand(len(rows), -1)
    return (returns - baselines) * mask, returns


def test_hand_derived_two_responses():
    # one prompt, two responses of length 2 and 1; outcome rewards 1 and 0 on the last token
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old_lp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 1.0]]))
    sps = torch.tensor([[0.5, 0.5], [0.5, 1.0]])  # w = 1 - 2*0.5 + 0.5 = 0.5 per token
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, np.array(["p", "p"]), old_lp, sps)
    # G = [[1, 1], [0, 0]]; W = [[0.5, 1.0], [0.5, 0]]
    # t=0: B = (1*0.5 + 0*0.5) / 1.0 = 0.5; t=1: only response 0 runs: B = 1*1.0 / 1.0 = 1
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    expected = torch.tensor([[0.5, 1.0 - 1.0 / (1.0 + 1e-8)], [-0.5 / (1 + 1e-8), 0.0]])
    torch.testing.assert_close(adv, expected)


def test_equals_the_per_group_loop_with_and_without_is_weights():
    g = torch.Generator().manual_seed(0)
    b, t = 9, 6
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b, 1), generator=g)).float()
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), mask.sum(-1).long() - 1] = torch.randn(b, generator=g)
    old_lp = -torch.rand(b, t, generator=g) * 3
    sps = torch.rand(b, t, generator=g)
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d"], dtype=object)
    is_w = torch.rand(b, t, generator=g) * 2
    for w in (None, is_w):
        got = compute_optimal_token_baseline_advantage(rewards, mask, index, old_lp, sps, w)
        want = _reference_loop(rewards, mask, index, old_lp, sps, w)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    adv, ret = got
    torch.testing.assert_close(adv[5], ret[5] * mask[5])  # group of one: no baseline


def test_registry_entry_needs_sum_pi_squared():
    fn = algos.get_adv_estimator_fn("optimal_token_baseline")
    rewards, mask = torch.ones(2, 3), torch.ones(2, 3)
    try:
        fn(rewards, mask, index=np.array([0, 0]), old_log_probs=torch.zeros(2, 3))
    except ValueError as e:
        assert "calculate_sum_pi_squared=True" in str(e)
    else:
        raise AssertionError("expected a ValueError")
    half = torch.full((2, 3), 0.5)  # pi = 0.5, sum pi^2 = 0.5: w = 0.5 > 0
    adv, _ = fn(rewards, mask, index=np.array([0, 0]), old_log_probs=half.log(), sum_pi_squared=half)
    torch.testing.assert_close(adv, torch.zeros(2, 3), atol=1e-6, rtol=0)  # equal returns: A = 0


def test_sum_pi_squared_from_logits_chunked():
    logits = torch.randn(5, 7, 11, generator=torch.Generator().manual_seed(1))
    want = torch.softmax(logits, -1).square().sum(-1)
    for chunk in (1, 4, 2048):
        torch.testing.assert_close(sum_pi_squared_from_logits(logits, chunk), want)
