"""Advantages computed in halves (per-response values on the driver, per-token work on the
workers that hold the rows) equal the whole-batch functions."""

from __future__ import annotations

import numpy as np
import torch

from hybridrl import algos


def _batch(b: int = 12, t: int = 7):
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    values = torch.randn(b, t, generator=g)
    index = np.array([f"p{i // 4}" for i in range(b)], dtype=object)
    return rewards, mask, values, index


def test_grpo_in_halves_is_exact():
    rewards, mask, _, index = _batch()
    want, _ = algos.compute_grpo_outcome_advantage(rewards, mask, index)
    per_response = algos.grpo_response_advantages(algos.outcome_scores(rewards, mask), index)
    rows = [slice(0, 5), slice(5, 12)]  # two workers, each broadcasting its own rows
    got = torch.cat([algos.broadcast_to_tokens(per_response[r], mask[r]) for r in rows])
    assert torch.equal(got, want)


def test_gae_whitened_from_row_moments_matches():
    rewards, mask, values, _ = _batch()
    want_adv, want_ret = algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    rows = [slice(0, 5), slice(5, 12)]
    halves = [algos.gae_before_whitening(rewards[r], values[r], mask[r], 0.99, 0.95) for r in rows]
    moments = torch.cat([algos.masked_row_moments(a, mask[r]) for (a, _), r in zip(halves, rows)])
    mean, var = algos.mean_var_from_moments(moments)
    adv = torch.cat(
        [(a - mean) * torch.rsqrt(torch.tensor(var + 1e-8)) * mask[r] for (a, _), r in zip(halves, rows)]
    )
    ret = torch.cat([ret * mask[r] for (_, ret), r in zip(halves, rows)])
    assert torch.equal(ret, want_ret)
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-6)
