"""KL estimators, straight-through variants, exact KL from logits, KL in the reward."""

import math

import pytest
import torch

from hybridrl.algos import apply_kl_penalty, get_kl_estimator_fn, kl_penalty, kl_penalty_full_from_logits

# two tokens: (pi, pi_ref) = (0.5, 0.25) -> log r = log(pi_ref/pi) = -ln 2
#                           (0.2, 0.6)  -> log r = ln 3
LOGPROB = torch.log(torch.tensor([[0.5, 0.2]]))
REF_LOGPROB = torch.log(torch.tensor([[0.25, 0.6]]))
LN2, LN3 = math.log(2), math.log(3)

EXPECTED = {
    "kl": [LN2, -LN3],  # log pi - log pi_ref
    "k1": [LN2, -LN3],
    "abs": [LN2, LN3],
    "mse": [0.5 * LN2**2, 0.5 * LN3**2],
    "k2": [0.5 * LN2**2, 0.5 * LN3**2],
    "low_var_kl": [0.5 - 1 + LN2, 3 - 1 - LN3],  # r - 1 - log r
    "k3": [0.5 - 1 + LN2, 3 - 1 - LN3],
    "k1+": [LN2, -LN3],  # values of k1 / k3, gradients of k2
    "k3+": [0.5 - 1 + LN2, 3 - 1 - LN3],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_kl_estimator_values(name):
    torch.testing.assert_close(kl_penalty(LOGPROB, REF_LOGPROB, name), torch.tensor([EXPECTED[name]]))


def test_k3_is_clamped():
    # log r = -30 -> clamped to -10: e^-10 - 1 + 10; log r = +30 -> clamped to 10, e^10 - 11 -> output clamp 10
    logprob, ref = torch.tensor([[0.0, -30.0]]), torch.tensor([[-30.0, 0.0]])
    torch.testing.assert_close(kl_penalty(logprob, ref, "k3"), torch.tensor([[math.exp(-10) + 9, 10.0]]))


@pytest.mark.parametrize("name", ["k1+", "k3+"])
def test_straight_through_gradient_is_that_of_k2(name):
    logprob = LOGPROB.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_penalty(logprob, REF_LOGPROB, name).sum(), logprob)
    # d/dlogprob of 1/2 (logprob - ref)^2 = logprob - ref = [ln 2, -ln 3]
    torch.testing.assert_close(grad, torch.tensor([[LN2, -LN3]]))
    logprob_k2 = LOGPROB.clone().requires_grad_(True)
    (grad_k2,) = torch.autograd.grad(kl_penalty(logprob_k2, REF_LOGPROB, "k2").sum(), logprob_k2)
    torch.testing.assert_close(grad, grad_k2)


def test_full_needs_logits():
    with pytest.raises(ValueError, match="kl_penalty_full_from_logits"):
        kl_penalty(LOGPROB, REF_LOGPROB, "full")
    with pytest.raises(ValueError, match="known: abs, k1, k1\\+"):
        get_kl_estimator_fn("k4")


def test_full_kl_from_logits():
    # pi = softmax([0, ln 3]) = [1/4, 3/4], pi_ref = [1/2, 1/2]
    logits = torch.tensor([[[0.0, LN3]]])
    ref_logits = torch.zeros(1, 1, 2)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl_penalty_full_from_logits(logits, ref_logits).item() == pytest.approx(expected)
    assert kl_penalty_full_from_logits(logits, logits).item() == pytest.approx(0.0, abs=1e-7)


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    logprob = torch.log(torch.tensor([[0.5, 0.2], [0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.6], [0.25, 0.9]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rewards, metrics = apply_kl_penalty(scores, logprob, ref, mask, kl_coef=0.1, kl_penalty_type="kl")
    # k1 = [[ln2, -ln3], [ln2, masked]]
    torch.testing.assert_close(rewards, torch.tensor([[-0.1 * LN2, 1 + 0.1 * LN3], [-0.1 * LN2, 2.0]]))
    # sequence means: (ln2 - ln3)/2 and ln2; batch mean of those
    assert metrics["reward_kl_penalty"].item() == pytest.approx(((LN2 - LN3) / 2 + LN2) / 2)
    assert metrics["reward_kl_penalty_coeff"].item() == pytest.approx(0.1)
