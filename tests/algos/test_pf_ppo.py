"""PF-PPO resampling weights and draws (hand-derived; veRL's formulas)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl import algos
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.batch_steps import pf_ppo_resample
from hybridrl.trainer.ppo.sections import PFPPOConfig

SCORES = torch.tensor([-2.0, 0.0, 1.0, 3.0])


def test_pow_weights():
    w = algos.pf_ppo_weights(SCORES, "pow", 2.0)
    torch.testing.assert_close(w, torch.tensor([4.0, 0.0, 1.0, 9.0]) + 1e-8)


def test_max_min_keeps_only_the_extremes():
    w = algos.pf_ppo_weights(SCORES, "max_min")
    torch.testing.assert_close(w, torch.tensor([1.0, 0.0, 0.0, 1.0]) + 1e-8)


def test_max_random():
    w = algos.pf_ppo_weights(SCORES, "max_random")
    torch.testing.assert_close(w, torch.tensor([0.1, 0.1, 0.1, 0.4]) + 1e-8)


def test_unknown_method():
    with pytest.raises(ValueError, match="reweight_method"):
        algos.pf_ppo_weights(SCORES, "nope")


def test_draws_follow_the_weights():
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = SCORES
    g = torch.Generator().manual_seed(0)
    idx = algos.pf_ppo_resample_indices(rewards, reweight_method="max_min", generator=g)
    assert idx.shape == (4,)
    assert set(idx.tolist()) <= {0, 3}  # the middle scores have weight ~1e-8
    expected = torch.multinomial(
        torch.tensor([1.0, 0.0, 0.0, 1.0]) + 1e-8,
        4,
        replacement=True,
        generator=torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(idx, expected)
    big = algos.pf_ppo_resample_indices(rewards.repeat(500, 1), weight_pow=2.0, generator=g)
    freq = torch.bincount(big % 4, minlength=4).float() / big.numel()
    torch.testing.assert_close(freq, torch.tensor([4.0, 0.0, 1.0, 9.0]) / 14, atol=0.02, rtol=0)


def test_batch_step_resamples_every_column_together():
    scores = torch.zeros(4, 2)
    scores[:, -1] = SCORES
    batch = DataProto.from_dict(
        tensors={"token_level_scores": scores, "advantages": torch.arange(4.0)[:, None].expand(4, 2)},
        non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)},
    )
    metrics = {}
    torch.manual_seed(0)
    out = pf_ppo_resample(PFPPOConfig(reweight_method="max_min"), batch, metrics)
    assert len(out) == 4
    rows = out.batch["advantages"][:, 0].long()
    assert set(rows.tolist()) <= {0, 3}
    assert list(out.non_tensor_batch["uid"]) == [["a", "b", "c", "d"][i] for i in rows]
    torch.testing.assert_close(out.batch["token_level_scores"][:, -1], SCORES[rows])
    assert 0 < metrics["pf_ppo/unique_frac"] <= 0.5
