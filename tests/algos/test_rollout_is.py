"""Rollout importance weights: levels, modes, veto, metrics."""

import math

import pytest
import torch

from hybridrl.algos import compute_rollout_importance_weights

# per-token ratios pi_old / pi_rollout: seq 0 = [2, 0.5, 4]; seq 1 = [1, 3, (masked garbage)]
ROLLOUT = torch.zeros(2, 3)
OLD = torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.0, 3.0, 1e6]]))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def weights(**kwargs):
    w, metrics = compute_rollout_importance_weights(OLD, ROLLOUT, MASK, **kwargs)
    return w, metrics


def test_token_truncate():
    w, m = weights(rollout_is_level="token", rollout_is_mode="truncate", rollout_is_threshold=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 3.0], [1.0, 3.0, 0.0]]))
    assert m["rollout_is_clipped_frac"].item() == pytest.approx(1 / 5)
    assert m["rollout_is_mean"].item() == pytest.approx((2 + 0.5 + 4 + 1 + 3) / 5)
    assert m["rollout_is_max"].item() == pytest.approx(4.0) and m["rollout_is_min"].item() == pytest.approx(
        0.5
    )
    final = torch.tensor([2.0, 0.5, 3.0, 1.0, 3.0])
    assert m["rollout_is_eff_sample_size"].item() == pytest.approx(
        (final.sum() ** 2 / (5 * (final**2).sum())).item()
    )


def test_token_mask_mode():
    # lower defaults to 1/3: 0.5 survives, 4 > 3 is zeroed
    w, m = weights(rollout_is_level="token", rollout_is_mode="mask", rollout_is_threshold=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 3.0, 0.0]]))
    w, _ = weights(rollout_is_mode="mask", rollout_is_threshold=3.0, rollout_is_threshold_lower=0.6)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 0.0], [1.0, 3.0, 0.0]]))


def test_sequence_and_geometric_levels():
    # sequence weights: 2 * 0.5 * 4 = 4 and 1 * 3 = 3; geometric: 4^(1/3), 3^(1/2)
    w, _ = weights(rollout_is_level="sequence", rollout_is_threshold=3.5)
    torch.testing.assert_close(w, torch.tensor([[3.5, 3.5, 3.5], [3.0, 3.0, 0.0]]))
    w, _ = weights(rollout_is_level="geometric", rollout_is_threshold=10.0)
    g0, g1 = 4 ** (1 / 3), math.sqrt(3)
    torch.testing.assert_close(w, torch.tensor([[g0, g0, g0], [g1, g1, 0.0]]))


def test_veto():
    old = OLD.clone()
    old[1, 0] = math.log(1e-5)  # catastrophic token in sequence 1
    w, m = compute_rollout_importance_weights(
        old, ROLLOUT, MASK, rollout_is_threshold=3.0, rollout_is_veto_threshold=1e-4
    )
    torch.testing.assert_close(w[1], torch.zeros(3))
    torch.testing.assert_close(w[0], torch.tensor([2.0, 0.5, 3.0]))
    assert m["rollout_is_veto_frac"].item() == 0.5


def test_weights_are_detached_and_metrics_present():
    old = OLD.clone().requires_grad_(True)
    w, m = compute_rollout_importance_weights(old, ROLLOUT, MASK)
    assert not w.requires_grad
    assert m["rollout_kl"].item() == pytest.approx(
        -(math.log(2) + math.log(0.5) + math.log(4) + 0 + math.log(3)) / 5
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="known: token, sequence, geometric"):
        weights(rollout_is_level="batch")
    with pytest.raises(ValueError, match="known: truncate, mask"):
        weights(rollout_is_mode="veto")
    with pytest.raises(ValueError, match="rollout_is_threshold_lower"):
        weights(rollout_is_threshold=2.0, rollout_is_threshold_lower=3.0)
