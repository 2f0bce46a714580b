"""DAPO overlong reward shaping and the dynamic-sampling group filter."""

import numpy as np
import pytest
import torch

from hybridrl.algos import apply_overlong_penalty, filter_groups_by_metric


def test_overlong_penalty():
    # L_max = 10, L_cache = 4: free up to 6, then linear down to -1 at 10, -1 beyond
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([5, 6, 8, 10, 12])
    shaped = apply_overlong_penalty(
        scores, lengths, max_response_length=10, overlong_buffer_len=4, penalty_factor=1.0
    )
    torch.testing.assert_close(shaped, torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0]))
    half = apply_overlong_penalty(
        scores, lengths, max_response_length=10, overlong_buffer_len=4, penalty_factor=0.5
    )
    torch.testing.assert_close(half, torch.tensor([1.0, 1.0, 0.75, 0.5, 0.5]))


def test_overlong_penalty_validates_buffer():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        apply_overlong_penalty(
            torch.ones(1), torch.ones(1), max_response_length=4, overlong_buffer_len=5, penalty_factor=1
        )


def test_filter_groups():
    index = np.array(["a", "a", "b", "b", "c", "d", "d", "d"])
    metric = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5])
    # a: all equal -> drop; b: mixed -> keep; c: alone -> keep (documented); d: all equal -> drop
    expected = np.array([False, False, True, True, True, False, False, False])
    np.testing.assert_array_equal(filter_groups_by_metric(index, metric), expected)
    np.testing.assert_array_equal(filter_groups_by_metric(index, torch.tensor(metric)), expected)


def test_filter_groups_float_noise_free():
    # 0.1 three times: np.std is ~1e-17 here, the max == min test is exact
    keep = filter_groups_by_metric(np.array([7, 7, 7]), np.array([0.1, 0.1, 0.1]))
    assert not keep.any()
