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


def test_rollout_tp_groups_the_rollout_slots_into_engines(base):
    from hybridrl.trainer.async_ppo.config import n_rollout_engines, n_rollout_workers

    c = load(
        base,
        **{
            "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
            "async_training.rollout_n_gpus_per_node": 4,
        },
    )
    assert (n_rollout_workers(c), n_rollout_engines(c)) == (4, 2)
    assert c.async_training.chunk_size == 4  # B / engines, not B / slots


def test_partial_rollout_is_accepted_with_tp_engines(base):
    """Formerly refused: the TP ranks now agree on the abort step (tests/rollout/test_rollout_tp.py)."""
    c = load(
        base,
        **{
            "actor_rollout_ref.rollout.name": "vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
            "async_training.rollout_n_gpus_per_node": 2,
            "async_training.partial_rollout": "true",
        },
    )
    assert c.async_training.partial_rollout and c.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


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
        ({"algorithm.filter_groups.enable": "true", "reward_model.enable": "true"}, "reward model scores"),
        (
            {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2},
            "=2 does not divide async_training.rollout_n_gpus_per_node=1",
        ),
        (
            {
                "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                "async_training.rollout_n_gpus_per_node": 2,
            },
            "tensor_model_parallel_size=2 with actor_rollout_ref.rollout.name=hf.*use rollout.name=vllm",
        ),
        (
            {
                "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                "async_training.rollout_n_gpus_per_node": 2,
                "actor_rollout_ref.rollout.name": "sglang",
            },
            "name=sglang in asynchronous mode.*use rollout.name=vllm",
        ),
        ({"async_training.weight_update_mode": "nccl"}, "weight_update_mode='nccl': use one of"),
        ({"async_training.weight_update_timeout_s": 0}, "weight_update_timeout_s=0 must be > 0"),
        (
            {
                "actor_rollout_ref.rollout.enable_rollout_routing_replay": "true",
                "actor_rollout_ref.actor.router_replay.mode": "R3",
                "actor_rollout_ref.rollout.name": "hf",
            },
            "asynchronous rollout workers do not carry it",
        ),
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


# ------------------------------------------------------------------ main_ppo's config stage
def test_refused_keys_are_refused_in_async_mode_too(base):
    with pytest.raises(ConfigError, match="trainer.default_hdfs_dir"):
        load(base, **{"trainer.default_hdfs_dir": "hdfs://x"})


def test_deprecated_micro_batch_key_is_converted(base):
    c = load(
        base,
        **{
            "actor_rollout_ref.actor.ppo_micro_batch_size": 8,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "null",
        },
    )
    assert c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8  # global 8 over one training rank


def test_verl_algorithm_keys_are_checked_in_async_mode(base):
    with pytest.raises(ConfigError, match="gdpo needs algorithm.gdpo_reward_keys"):
        load(base, **{"algorithm.adv_estimator": "gdpo"})


def test_command_line_config_errors_are_one_line_and_exit_1(capsys):
    from hybridrl.trainer.main_async import main

    with pytest.raises(SystemExit) as e:
        main(["+trainer.default_hdfs_dir=hdfs://x"])  # veRL's `+key=` spelling reaches the schema
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ConfigError: trainer.default_hdfs_dir")


def test_small_batch_defaults_are_adapted_on_the_command_line_as_in_main_ppo():
    from hybridrl.trainer.async_ppo.config import load_async_config
    from hybridrl.trainer.ppo.config_stage import load_for_cli

    argv = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    c = load_for_cli(compose_async_config(argv), load_async_config, {a.split("=")[0] for a in argv})
    assert c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 16  # 2 prompts x n=8, one rank


def test_ray_init_is_honoured(base):
    import ray

    from hybridrl.trainer.async_ppo.launch import init_ray

    c = load(
        base,
        **{
            "ray_kwargs.ray_init.num_cpus": 3,
            "ray_kwargs.ray_init.runtime_env.env_vars.HYBRIDRL_T23": "yes23",
        },
    )
    if ray.is_initialized():  # a shared instance from an earlier module (ray_local starts it again)
        ray.shutdown()
    try:
        init_ray(c)
        assert ray.cluster_resources()["CPU"] == 3

        @ray.remote(num_cpus=0)
        def env():
            import os

            return os.environ.get("HYBRIDRL_T23")

        assert ray.get(env.remote()) == "yes23"
    finally:
        ray.shutdown()
