"""Loss aggregation: hand-derived values and gradient-accumulation invariance.

Invariance: splitting one mini-batch into micro-batches (and over 2 simulated data-parallel
ranks whose gradients are averaged, as FSDP does) and accumulating gradients must give the
gradient of the un-split mini-batch, for every mode, once the LossScale carries the global
counts. The policy losses inherit this (tested below for each loss whose value is a sum of
per-sequence terms; clip_cov and kl_cov pick tokens by batch-level statistics, so by
definition their loss changes with the batch split).
"""

import pytest
import torch

from hybridrl.algos import LOSS_AGG_MODES, LossScale, agg_loss, get_policy_loss_fn, loss_counts

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 has no loss tokens


def test_modes_hand_derived():
    # tokens: row 0 -> 1, 2; row 1 -> 4. Two non-empty sequences, width 3.
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(((1 + 2) + 4) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx(((1 + 2) / 2 + 4) / 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((1 + 2 + 4) / (3 * 2))


def test_modes_with_global_scale():
    scale = LossScale(num_tokens=6, num_seqs=4, dp_size=2, max_response_length=7)
    assert agg_loss(LOSS, MASK, "token-mean", loss_scale=scale).item() == pytest.approx(7 / 6 * 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", loss_scale=scale).item() == pytest.approx(7 / 4 * 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", loss_scale=scale).item() == pytest.approx(5.5 / 4 * 2)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale=scale).item() == pytest.approx(
        7 / (7 * 4) * 2
    )


def test_loss_counts_and_validation():
    torch.testing.assert_close(loss_counts(MASK), torch.tensor([3.0, 2.0]))
    assert LossScale.from_mask(MASK).num_seqs == 2
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        LossScale(dp_size=0)
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        LossScale(num_tokens=0)
    with pytest.raises(ValueError, match="known: seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "sum")


# ---------------------------------------------------------------- gradient accumulation

B, T = 12, 7


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)  # includes empty and full rows
    lengths[0], lengths[1] = 0, T
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).double()
    mask[3, 2] = 0  # a multi-turn hole
    return x, mask


def per_token_loss(theta, x):
    """A loss whose gradient differs per token: l_it = (x_it * theta_t - 1)^2."""
    return (x * theta[: x.shape[1]] - 1) ** 2


def micro_batch(x, mask, rows):
    """Rows of the batch, trimmed to their own longest response (as padding removal does)."""
    width = int((mask[rows] > 0).nonzero()[:, 1].max()) + 1 if mask[rows].any() else 1
    return x[rows, :width], mask[rows, :width]


def grad_of(theta, loss):
    (g,) = torch.autograd.grad(loss, theta)
    return g


def full_batch_grad(theta, x, mask, mode):
    return grad_of(theta, agg_loss(per_token_loss(theta, x), mask, mode))


RANK_SPLITS = {"rank0": [[0, 5, 2], [7], [9, 3]], "rank1": [[1, 4, 6, 8], [10, 11]]}  # unequal micro-batches


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_micro_batches_accumulate_to_the_full_batch_gradient(mode):
    x, mask = make_batch()
    theta = torch.randn(
        T, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True
    )
    expected = full_batch_grad(theta, x, mask, mode)

    scale = LossScale.from_mask(mask, max_response_length=T)
    accumulated = torch.zeros_like(theta)
    for rows in [[0, 5, 2], [7], [9, 3], [1, 4, 6, 8], [10, 11]]:
        mx, mm = micro_batch(x, mask, rows)
        accumulated += grad_of(theta, agg_loss(per_token_loss(theta, mx), mm, mode, loss_scale=scale))
    torch.testing.assert_close(accumulated, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names())
def test_two_ranks_average_to_the_full_batch_gradient(mode):
    x, mask = make_batch(seed=2)
    theta = torch.randn(
        T, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True
    )
    expected = full_batch_grad(theta, x, mask, mode)

    # each rank counts its own rows; the sum over ranks plays the role of all_reduce
    rank_rows = {rank: sum(splits, []) for rank, splits in RANK_SPLITS.items()}
    counts = sum(loss_counts(mask[rows]) for rows in rank_rows.values())
    scale = LossScale(num_tokens=counts[0], num_seqs=counts[1], dp_size=2, max_response_length=T)
    rank_grads = []
    for splits in RANK_SPLITS.values():
        g = torch.zeros_like(theta)
        for rows in splits:
            mx, mm = micro_batch(x, mask, rows)
            g += grad_of(theta, agg_loss(per_token_loss(theta, mx), mm, mode, loss_scale=scale))
        rank_grads.append(g)
    averaged = sum(rank_grads) / 2  # FSDP/DDP average gradients over ranks
    torch.testing.assert_close(averaged, expected, rtol=1e-6, atol=1e-6)


def test_local_counts_are_not_invariant():
    """Why LossScale exists: normalising each micro-batch by its own token count and averaging
    over micro-batches weights tokens of small micro-batches more."""
    x, mask = make_batch()
    theta = torch.randn(
        T, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True
    )
    expected = full_batch_grad(theta, x, mask, "token-mean")
    splits = [[0, 5, 2], [7], [9, 3], [1, 4, 6, 8], [10, 11]]
    naive = sum(
        grad_of(theta, agg_loss(per_token_loss(theta, x[rows]), mask[rows], "token-mean")) for rows in splits
    ) / len(splits)
    assert not torch.allclose(naive, expected, rtol=1e-3)


def test_sum_norm_needs_a_fixed_length_when_widths_differ():
    x, mask = make_batch()
    theta = torch.randn(
        T, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True
    )
    expected = full_batch_grad(theta, x, mask, "seq-mean-token-sum-norm")
    scale = LossScale.from_mask(mask)  # no max_response_length: L = each micro-batch's width
    accumulated = torch.zeros_like(theta)
    for rows in [[0, 5, 2], [7], [9, 3], [1, 4, 6, 8], [10, 11]]:
        mx, mm = micro_batch(x, mask, rows)
        accumulated += grad_of(
            theta, agg_loss(per_token_loss(theta, mx), mm, "seq-mean-token-sum-norm", loss_scale=scale)
        )
    assert not torch.allclose(accumulated, expected, rtol=1e-3)


SPLIT_INVARIANT_LOSSES = ["vanilla", "decoupled", "gspo", "gpg", "cispo", "geo_mean"]


@pytest.mark.parametrize("name", SPLIT_INVARIANT_LOSSES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_losses_accumulate_to_the_full_batch_gradient(name, mode):
    gen = torch.Generator().manual_seed(4)
    x, mask = make_batch(seed=5)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    behave = old + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T)  # outcome advantages
    theta = torch.zeros(T, dtype=torch.float64, requires_grad=True)
    loss_fn = get_policy_loss_fn(name)

    def loss(rows, scale=None):
        log_prob = old[rows] + 0.3 * x[rows] * torch.tanh(theta + 0.5)  # ratios spread around 1
        hparams = dict(behave_log_prob=behave[rows], behave_imp_weight_cap=1.05, clip_ratio=0.1)
        value, _ = loss_fn(
            old[rows], log_prob, adv[rows], mask[rows], loss_agg_mode=mode, loss_scale=scale, **hparams
        )
        return value

    expected = grad_of(theta, loss(list(range(B))))
    scale = LossScale.from_mask(mask)
    accumulated = sum(
        grad_of(theta, loss(rows, scale)) for rows in [[0, 5, 2], [7], [9, 3], [1, 4, 6, 8], [10, 11]]
    )
    assert expected.abs().max() > 1e-3  # the test is not trivially 0 == 0
    torch.testing.assert_close(accumulated, expected, rtol=1e-6, atol=1e-8)
