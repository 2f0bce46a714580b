"""Masked statistics, log-probs and entropy: hand-derived values."""

import math

import pytest
import torch

from hybridrl.algos import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0])
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0])  # the 3.0 is padding


def test_masked_sum_and_mean():
    assert masked_sum(VALUES, MASK).item() == 1 + 2 + 4
    assert masked_mean(VALUES, MASK).item() == pytest.approx((1 + 2 + 4) / 3)
    assert masked_mean(VALUES, torch.zeros(4)).item() == 0.0  # empty mask -> 0, not nan


def test_masked_mean_along_axis():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    torch.testing.assert_close(masked_mean(values, mask, axis=-1), torch.tensor([2.0, 5.0]))


def test_masked_var_is_unbiased():
    # unmasked [1, 2, 4]: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9, / (3 - 1)
    assert masked_var(VALUES, MASK).item() == pytest.approx(42 / 9 / 2)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(42 / 9 / 3)


def test_masked_var_needs_two_entries():
    with pytest.raises(ValueError, match="at least 2 unmasked"):
        masked_var(VALUES, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_masked_whiten():
    mean, std = 7 / 3, math.sqrt(42 / 9 / 2)
    whitened = masked_whiten(VALUES, MASK)
    for i in (0, 1, 3):
        assert whitened[i].item() == pytest.approx((VALUES[i].item() - mean) / std, rel=1e-6)
    # shift_mean=False rescales but keeps the mean
    assert masked_whiten(VALUES, MASK, shift_mean=False)[0].item() == pytest.approx((1 - mean) / std + mean)


def test_logprobs_from_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax = [1/4, 3/4]
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(3 / 4))
    assert logprobs_from_logits(logits, torch.tensor([[0]])).item() == pytest.approx(math.log(1 / 4))


def test_logprobs_from_logits_matches_log_softmax_gather():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    expected = logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)


def test_entropy_from_logits():
    # [1/4, 3/4]: H = 1/4 ln 4 + 3/4 ln(4/3); uniform over 8: H = ln 8
    two_point = torch.tensor([0.0, math.log(3.0)])
    expected = 0.25 * math.log(4) + 0.75 * math.log(4 / 3)
    assert entropy_from_logits(two_point).item() == pytest.approx(expected)
    assert entropy_from_logits(torch.zeros(8)).item() == pytest.approx(math.log(8))


def test_entropy_chunked_equals_unchunked_values_and_grads():
    logits = torch.randn(4, 7, 13, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weights = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    full = entropy_from_logits(logits)
    (grad_full,) = torch.autograd.grad((full * weights).sum(), logits)
    chunked = entropy_from_logits_chunked(logits, chunk_size=3)  # 28 positions: 9 chunks + 1
    (grad_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(grad_chunked, grad_full)
    with torch.no_grad():
        torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk_size=5), full)
