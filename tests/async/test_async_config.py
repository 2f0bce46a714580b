"""async_training.* loading, derived values and start-up errors (no Ray)."""

from __future__ import annotations

import pytest

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config
from hybridrl.utils.config_loader import ConfigError


@pytest.fixture(scope="module")
def base():
    """The composed quickstart config (Hydra compose once; each test edits a copy)."""
    return compose_async_config([])


def load(base, **keys):
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in keys.items()]))
    return load_async_config(cfg)


def test_defaults_are_derived_from_the_batch(base):
    c = load(base)
    at = c.async_training
    assert c.data.train_batch_size == 8
    assert at.max_head_offpolicyness == 1
    assert at.consumer_batch_size == 8
    assert at.max_concurrent_rollouts == 16  # (eta + 1) * B
    assert at.queue_size == 256  # max_concurrent_rollouts * 16, AReaL's default
    assert at.chunk_size == 8  # B / one rollout worker
    assert c.trainer.cpus_per_worker == 1  # main_async's default: one core each side
    pl = c.actor_rollout_ref.actor.policy_loss
    assert pl.loss_mode == "decoupled"
    assert pl.behave_imp_weight_cap == 5.0
    assert c.actor_rollout_ref.rollout.calculate_log_probs  # behaviour log-probs for the loss


def test_explicit_values_and_two_rollout_workers(base):
    c = load(
        base,
        **{
            "async_training.max_head_offpolicyness": 3,
            "async_training.rollout_n_gpus_per_node": 2,
            "async_training.max_concurrent_rollouts": 12,
            "async_training.behave_imp_weight_cap": "null",
        },
    )
    at = c.async_training
    assert (at.max_concurrent_rollouts, at.queue_size, at.chunk_size) == (12, 192, 4)
    assert c.actor_rollout_ref.actor.policy_loss.behave_imp_weight_cap is None


def test_without_decoupled_loss_the_actor_loss_is_left_alone(base):
    c = load(base, **{"async_training.use_decoupled_loss": "false"})
    assert c.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    assert not c.actor_rollout_ref.rollout.calculate_log_probs
    c = load(
        base, **{"async_training.use_decoupled_loss": "false", "async_training.recompute_logprob": "false"}
    )
    assert c.actor_rollout_ref.rollout.calculate_log_probs  # the behaviour log-probs are the old ones


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"async_training.consumer_batch_size": 4}, "set data.train_batch_size"),
        ({"async_training.recompute_logprob": "false"}, "needs async_training.recompute_logprob=true"),
        ({"async_training.max_head_offpolicyness": -1}, "must be >= 0"),
        ({"async_training.queue_size": 0}, "queue_size=0 must be >= 1"),
        ({"async_training.behave_imp_weight_cap": 0}, "must be > 0"),
        (
            {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"},
            "use_decoupled_loss=false to keep 'gspo'",
        ),
        ({"algorithm.filter_groups.enable": "true"}, "not supported in asynchronous mode"),
        ({"algorithm.adv_estimator": "remax"}, "not supported in asynchronous mode"),
        ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 2}, "must be 1 in asynchronous mode"),
    ],
)
def test_bad_values_fail_at_start_naming_the_key(base, keys, message):
    with pytest.raises(ConfigError, match=message):
        load(base, **keys)


def test_unknown_async_key_suggests_the_right_one(base):
    with pytest.raises(ConfigError, match="Did you mean async_training.max_head_offpolicyness"):
        load(base, **{"async_training.max_head_offpolicynes": 2})


def test_command_line_accepts_async_keys_with_or_without_plus():
    cfg = compose_async_config(
        [
            "async_training.max_head_offpolicyness=2",
            "+async_training.queue_size=7",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        ]
    )
    c = load_async_config(cfg)
    assert (c.async_training.max_head_offpolicyness, c.async_training.queue_size) == (2, 7)
    assert c.data.train_batch_size == 4
