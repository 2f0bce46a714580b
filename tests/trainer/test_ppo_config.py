"""Start-up validation of the PPO config: every bad input is a one-line error naming the key."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from hybridrl.trainer.ppo.config import PPOConfig, load_config
from hybridrl.utils.config_loader import ConfigError


def _compose(overrides=()):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def _keys(node, prefix=""):
    out = set()
    for k, v in node.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, prefix + k + ".")
    return out


def test_yaml_has_exactly_the_schema_keys():
    yaml_keys = _keys(OmegaConf.to_container(_compose(), resolve=False))
    schema_keys = _keys(OmegaConf.to_container(OmegaConf.structured(PPOConfig)))
    assert yaml_keys == schema_keys


def test_defaults_load_and_interpolations_resolve():
    c = load_config(_compose())
    assert c.actor_rollout_ref.rollout.response_length == c.data.max_response_length
    assert c.actor_rollout_ref.rollout.prompt_length == c.data.max_prompt_length
    assert c.critic.rollout_n == c.actor_rollout_ref.rollout.n
    assert c.algorithm.adv_estimator == "grpo"


def test_unknown_key_names_the_key_and_suggests():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.ppo_mini_batch'.*ppo_mini_batch_size"):
        load_config(_compose(["+actor_rollout_ref.actor.ppo_mini_batch=3"]))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            ["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
            "ppo_mini_batch_size",
        ),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"], "ppo_micro_batch_size_per_gpu=7"),
        (["trainer.n_gpus_per_node=3"], "ranks"),
        (["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"], "rollout.n must be >= 2"),
        (["algorithm.adv_estimator=nope"], "algorithm.adv_estimator='nope'"),
        (["actor_rollout_ref.rollout.name=trt"], "actor_rollout_ref.rollout.name"),
        (["data.train_files=/no/such.parquet"], "data.train_files: file '/no/such.parquet' does not exist"),
        (["data.truncation=sideways"], "data.truncation"),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=5"],
            "critic.ppo_micro_batch_size_per_gpu",
        ),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
        (["reward_model.enable=true"], "reward_model.model.path"),
        (
            ["actor_rollout_ref.actor.use_prefix_grouper=true", "actor_rollout_ref.actor.strategy=megatron"],
            "use_prefix_grouper=True with strategy=megatron",
        ),
        (
            [
                "actor_rollout_ref.actor.use_prefix_grouper=true",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.model.use_remove_padding=true",
            ],
            "use_prefix_grouper=True with ulysses_sequence_parallel_size=2",
        ),
        (["actor_rollout_ref.actor.router_replay.mode=R4"], r"router_replay.mode='R4': use one of"),
        (["actor_rollout_ref.actor.router_replay.mode=R3"], "enable_rollout_routing_replay=true"),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                "actor_rollout_ref.rollout.name=sglang",
            ],
            "rollout.name=sglang: this rollout engine does not return the experts it routed to",
        ),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R2",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                "actor_rollout_ref.rollout.name=hf",
            ],
            "mode=R2 records the routing in the old-log-prob pass",
        ),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R2",
                "actor_rollout_ref.actor.strategy=megatron",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                "trainer.n_gpus_per_node=2",
            ],
            "mode=R2 records the old-log-prob pass's routing, which the Megatron engine does with pipeline",
        ),
        (
            ["actor_rollout_ref.actor.router_replay.record_file=/tmp/r.pt"],
            "routing files are not implemented",
        ),
    ],
)
def test_bad_config_fails_at_start_up_naming_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(_compose(overrides))


def test_routing_replay_keys_are_read():
    c = load_config(
        _compose(["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                  "actor_rollout_ref.rollout.name=hf"])
    )  # fmt: skip
    arr = c.actor_rollout_ref
    assert (arr.actor.router_replay.mode, arr.ref.router_replay.mode) == ("R3", "R3")  # the reference follows
    assert arr.rollout.enable_rollout_routing_replay is True
    assert load_config(_compose()).actor_rollout_ref.actor.router_replay.mode == "disabled"
    r3_vllm = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
               "actor_rollout_ref.rollout.name=vllm"]  # fmt: skip
    # vLLM returns routed experts on GPUs: taken here, refused by the engine on CPU (tests/rollout/test_moe_vllm.py)
    assert load_config(_compose(r3_vllm)).actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2",
          "actor_rollout_ref.model.use_remove_padding=true"]  # fmt: skip
    for mode in ("R2", "R3"):  # routing replay runs under Ulysses SP (tests/workers/test_moe_sp.py)
        extra = ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"] if mode == "R3" else []
        c = load_config(_compose([*sp, f"actor_rollout_ref.actor.router_replay.mode={mode}", *extra]))
        assert c.actor_rollout_ref.actor.router_replay.mode == mode


_ON = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


@pytest.mark.parametrize(
    "overrides, redundant",
    [
        (_ON, True),
        (["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8"], False),
        ([*_ON, "actor_rollout_ref.actor.ppo_epochs=2"], False),
        ([*_ON, "algorithm.use_kl_in_reward=true"], False),
        ([*_ON, "algorithm.rollout_is=true"], False),
        ([*_ON, "actor_rollout_ref.actor.skip_on_policy_old_log_prob=false"], False),
    ],
)
def test_old_log_prob_pass_is_skipped_only_when_exactly_on_policy(overrides, redundant):
    from hybridrl.trainer.ppo.trainer import old_log_prob_is_redundant

    assert old_log_prob_is_redundant(load_config(_compose(overrides))) is redundant
