"""algos/sft.py: the SFT loss on hand-computed values (shifted mask, global normaliser, data-parallel scale)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algos.agg import LossScale
from hybridrl.algos.sft import next_token_targets, sft_loss, sft_nll_sum, sft_token_loss


def test_targets_are_the_tokens_after_the_first():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert next_token_targets(ids).tolist() == [[6, 7, 8]]


def test_nll_sum_reads_the_mask_one_column_to_the_right():
    # log_probs[t] is the log-prob of token t + 1, so it counts where loss_mask[t + 1] is 1
    log_probs = torch.tensor([[-1.0, -2.0, -3.0]])
    loss_mask = torch.tensor([[1, 1, 0, 1]])  # column 0 is never a target
    assert sft_nll_sum(log_probs, loss_mask).item() == 1.0 + 3.0
    with pytest.raises(ValueError, match=r"\(B, S-1\) = \(1, 3\)"):
        sft_nll_sum(torch.zeros(1, 4), loss_mask)


def test_loss_is_the_share_of_the_global_token_mean_times_dp():
    log_probs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    loss_mask = torch.tensor([[0, 1, 0, 1]])
    loss, nll = sft_loss(log_probs, loss_mask, LossScale(num_tokens=8.0, dp_size=2))
    assert nll.item() == pytest.approx(4.0 / 8.0)
    assert loss.item() == pytest.approx(4.0 / 8.0 * 2)
    loss.backward()
    # d loss / d log_probs[t] = -loss_mask[t + 1] * D / N
    assert log_probs.grad.tolist() == [[-0.25, 0.0, -0.25]]
    with pytest.raises(ValueError, match="num_tokens"):
        sft_loss(log_probs, loss_mask, LossScale())


def test_micro_batch_shares_add_up_to_the_whole_batch_mean():
    """Rows with 1 and 3 loss tokens: split or not, the summed shares are the token mean over 4 tokens."""
    log_probs = torch.tensor([[-4.0, -9.0, -9.0], [-1.0, -1.0, -4.0]])
    loss_mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]])
    expected = (4.0 + 1.0 + 1.0 + 4.0) / 4
    scale = LossScale(num_tokens=4.0)
    whole = sft_loss(log_probs, loss_mask, scale)[1].item()
    split = sum(sft_loss(log_probs[i : i + 1], loss_mask[i : i + 1], scale)[1].item() for i in range(2))
    assert whole == pytest.approx(expected) and split == pytest.approx(expected)
    # a per-micro-batch mean would weigh the one-token row as much as the three-token row
    assert (4.0 + (1.0 + 1.0 + 4.0) / 3) / 2 != pytest.approx(expected)


def test_token_loss_from_logits_scores_the_shifted_tokens():
    v = 5
    logits = torch.zeros(1, 3, v)
    logits[0, 0, 4] = math.log(4.0)  # position 0: p(token 4) = 4 / (4 + 4) = 1/2
    ids = torch.tensor([[0, 4, 1]])
    mask = torch.tensor([[0, 1, 1]])
    # token 1 (= 4) from position 0: -log(1/2); token 2 (= 1) from position 1 (uniform): -log(1/5)
    expected = math.log(2.0) + math.log(5.0)
    assert sft_token_loss(logits, ids, mask).item() == pytest.approx(expected, rel=1e-6)
