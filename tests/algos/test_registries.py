"""Every registry entry, walked with random inputs: shapes, finiteness, masking.

"Masking" means: whatever sits under response_mask == 0 (padding, tool output) cannot change
any result. Each test runs the entry twice, with different garbage under the mask.
"""

import numpy as np
import pytest
import torch

from hybridrl.algos import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    agg_loss,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    kl_penalty,
    register_adv_est,
    register_kl_estimator,
    register_loss_agg,
    register_policy_loss,
)

B, T = 12, 6
INDEX = np.array([0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3])[np.random.default_rng(0).permutation(B)]


def random_mask(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).float()
    mask[0, 1] = 0  # a multi-turn hole
    return mask


def with_garbage(x, mask, seed, scale=50.0):
    """x with its masked entries replaced by large random values."""
    noise = scale * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(mask.bool(), x, noise)


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_every_advantage_estimator(name):
    gen = torch.Generator().manual_seed(1)
    mask = random_mask(2)
    rewards = torch.randn(B, T, generator=gen) * mask
    values = torch.randn(B, T, generator=gen) * mask
    common = dict(index=INDEX, gamma=0.9, lam=0.95, norm_adv_by_std_in_grpo=True, epsilon=1e-6)
    common["reward_baselines"] = torch.randn(B, generator=gen)
    common["old_log_probs"] = -torch.rand(B, T, generator=gen) * 2  # optimal_token_baseline
    common["sum_pi_squared"] = torch.rand(B, T, generator=gen)
    common["reward_components"] = torch.randn(2, B, generator=gen)  # gdpo
    common["reward_weights"] = [1.0, 0.5]
    fn = get_adv_estimator_fn(name)

    outputs = []
    for seed in (10, 20):
        adv, ret = fn(
            with_garbage(rewards, mask, seed), mask, values=with_garbage(values, mask, seed + 1), **common
        )
        assert adv.shape == (B, T) and ret.shape == (B, T)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
        outputs.append((adv, ret))
    torch.testing.assert_close(outputs[0], outputs[1])
    assert outputs[0][0].abs().sum() > 0  # not trivially zero


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES.names())
def test_every_policy_loss(name, loss_agg_mode):
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(4)
    old = -torch.rand(B, T, generator=gen) * 3
    new = old + 0.3 * torch.randn(B, T, generator=gen)
    behave = old + 0.1 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, T, generator=gen)
    is_weights = torch.rand(B, T, generator=gen) * 2 * mask
    fn = get_policy_loss_fn(name)

    results = []
    for seed in (10, 20):
        log_prob = with_garbage(new, mask, seed).requires_grad_(True)
        loss, metrics = fn(
            with_garbage(old, mask, seed + 1),
            log_prob,
            with_garbage(adv, mask, seed + 2),
            mask,
            loss_agg_mode=loss_agg_mode,
            rollout_is_weights=is_weights,
            clip_ratio=0.2,
            clip_ratio_c=3.0,
            behave_log_prob=with_garbage(behave, mask, seed + 3),
            behave_imp_weight_cap=5.0,
            clip_cov_ratio=0.05,
            kl_cov_ratio=0.05,
            generator=torch.Generator().manual_seed(7),
            dro_beta=0.1,
            tau_pos=1.0,
            tau_neg=1.05,
        )
        assert loss.shape == () and torch.isfinite(loss)
        assert {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"} <= metrics.keys()
        assert all(
            isinstance(v, torch.Tensor) and v.shape == () and not v.requires_grad for v in metrics.values()
        )
        (grad,) = torch.autograd.grad(loss, log_prob)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
        results.append((loss.detach(), grad, metrics))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][2], results[1][2])
    assert results[0][1].abs().sum() > 0


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_every_kl_estimator(name):
    gen = torch.Generator().manual_seed(5)
    logprob = -torch.rand(B, T, generator=gen) * 5
    ref = -torch.rand(B, T, generator=gen) * 5
    kl = kl_penalty(logprob, ref, name)
    assert kl.shape == (B, T) and torch.isfinite(kl).all()
    # per-token: changing other tokens leaves a token's value alone
    other = kl_penalty(torch.where(torch.eye(B, T).bool(), logprob, logprob - 3), ref, name)
    torch.testing.assert_close(kl.diagonal(), other.diagonal())
    assert (kl_penalty(logprob, logprob, name) == 0).all()  # KL(pi || pi) = 0 for every estimator


@pytest.mark.parametrize("name", LOSS_AGG_MODES.names())
def test_every_loss_agg_mode(name):
    mask = random_mask(6)
    loss_mat = torch.randn(B, T, generator=torch.Generator().manual_seed(7))
    a = agg_loss(with_garbage(loss_mat, mask, 1), mask, name)
    b = agg_loss(with_garbage(loss_mat, mask, 2), mask, name)
    assert a.shape == () and torch.isfinite(a)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "register, existing",
    [
        (register_adv_est, "grpo"),
        (register_policy_loss, "vanilla"),
        (register_kl_estimator, "k3"),
        (register_loss_agg, "token-mean"),
    ],
)
def test_duplicate_registration_raises(register, existing):
    with pytest.raises(ValueError, match=f"'{existing}' is already registered"):
        register(existing)(lambda *args, **kwargs: None)


@pytest.mark.parametrize(
    "registry, known",
    [
        (ADV_ESTIMATORS, "gae, gdpo, gpg"),
        (POLICY_LOSSES, "bypass_mode, cispo, clip_cov"),
        (KL_ESTIMATORS, "abs, k1"),
        (LOSS_AGG_MODES, "seq-mean"),
    ],
)
def test_unknown_name_lists_the_known_ones(registry, known):
    with pytest.raises(ValueError, match=f"unknown {registry.kind} 'nope'; known: {known}"):
        registry.get("nope")


def test_a_new_entry_is_usable_by_name():
    registry = Registry("thing")
    registry.register("double")(lambda x: 2 * x)
    assert registry.get("double")(3) == 6 and "double" in registry and registry.names() == ["double"]


def test_list_functions_match_the_registries():
    from hybridrl import algos

    assert algos.list_adv_estimators() == ADV_ESTIMATORS.names()
    assert "grpo_passk" in algos.list_adv_estimators() and "gae" in algos.list_adv_estimators()
    assert algos.list_policy_losses() == POLICY_LOSSES.names() and "decoupled" in algos.list_policy_losses()
    assert {"gdpo", "tir_optimal_token_baseline"} <= set(algos.list_adv_estimators())
    assert {"dppo_tv", "dppo_kl", "sapo", "dro"} <= set(algos.list_policy_losses())  # veRL's newest
    assert algos.list_kl_estimators() == KL_ESTIMATORS.names()
    assert algos.list_loss_agg_modes() == LOSS_AGG_MODES.names()
