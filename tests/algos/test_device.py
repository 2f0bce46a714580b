"""On a GPU, every registry entry gives the CPU result (tensors stay on the input's device)."""

import numpy as np
import pytest
import torch

from hybridrl.algos import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    compute_rollout_importance_weights,
    get_adv_estimator_fn,
    get_policy_loss_fn,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

B, T = 8, 5
INDEX = np.array([0, 0, 1, 1, 1, 1, 2, 2])


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).float()
    return {name: torch.randn(B, T, generator=gen) for name in ("a", "b", "c", "d")}, mask


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_advantage_on_cuda_matches_cpu(name):
    x, mask = inputs()
    baselines = torch.randn(B)
    results = {}
    for device in ("cpu", "cuda"):
        adv, ret = get_adv_estimator_fn(name)(
            x["a"].to(device),
            mask.to(device),
            index=INDEX,
            values=x["b"].to(device),
            gamma=0.9,
            lam=0.9,
            reward_baselines=baselines.to(device),
        )
        assert adv.device.type == device
        results[device] = (adv.cpu(), ret.cpu())
    torch.testing.assert_close(results["cuda"], results["cpu"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_on_cuda_matches_cpu(name):
    x, mask = inputs(1)
    old = -x["a"].abs()
    results = {}
    for device in ("cpu", "cuda"):
        log_prob = (old + 0.2 * x["b"]).to(device).requires_grad_(True)
        loss, metrics = get_policy_loss_fn(name)(
            old.to(device),
            log_prob,
            x["c"].to(device),
            mask.to(device),
            behave_log_prob=(old + 0.1 * x["d"]).to(device),
            clip_cov_ratio=0.1,
            kl_cov_ratio=0.1,
            generator=torch.Generator().manual_seed(0),
        )
        (grad,) = torch.autograd.grad(loss, log_prob)
        results[device] = (loss.detach().cpu(), grad.cpu(), {k: v.cpu() for k, v in metrics.items()})
    torch.testing.assert_close(results["cuda"], results["cpu"], rtol=1e-5, atol=1e-5)


def test_rollout_is_on_cuda():
    x, mask = inputs(2)
    w, _ = compute_rollout_importance_weights(
        x["a"].cuda(), x["b"].cuda(), mask.cuda(), rollout_is_veto_threshold=1e-3
    )
    cpu, _ = compute_rollout_importance_weights(x["a"], x["b"], mask, rollout_is_veto_threshold=1e-3)
    torch.testing.assert_close(w.cpu(), cpu)
