"""`actor.use_prefix_grouper: auto` (the yaml default): on exactly where the shared-prompt forward can run
and pays, off with a printed reason everywhere else; true / false mean what they say."""

from __future__ import annotations

import copy
import functools

import pytest
from hydra import compose, initialize_config_module
from transformers import (
    BloomConfig,
    Gemma2Config,
    LlamaConfig,
    LlavaConfig,
    MistralConfig,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2VLConfig,
)

from hybridrl import algos
from hybridrl.engine.prefix_group import model_refusal
from hybridrl.trainer.ppo.config import load_config
from hybridrl.trainer.ppo.prefix_auto import auto_decision, resolve_prefix_grouper
from hybridrl.utils.config_loader import ConfigError

KEY = "actor_rollout_ref.actor.use_prefix_grouper"
# hand-derived: the estimators whose advantage compares the responses to one prompt
GROUP_ESTIMATORS = {
    "grpo", "grpo_vectorized", "grpo_batch_whitened", "rloo", "rloo_vectorized", "grpo_passk", "opo", "gpg", "gdpo",
    "reinforce_plus_plus_baseline", "optimal_token_baseline", "tir_optimal_token_baseline",
}  # fmt: skip


def _load(overrides=()):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=list(overrides))
    return load_config(cfg, explicit_keys={o.split("=")[0] for o in overrides})  # as main_ppo passes them


@functools.cache
def _defaults():
    return _load()


@pytest.mark.parametrize("name", algos.list_adv_estimators())
def test_registry_knows_which_estimators_group_by_prompt(name):
    assert algos.estimator_groups_by_prompt(name) == (name in GROUP_ESTIMATORS)


def test_registry_flag_can_be_given_explicitly():
    from hybridrl.algos.advantage import _GROUPS_BY_PROMPT, ADV_ESTIMATORS, register_adv_est

    @register_adv_est("_test_grouped_without_index", groups_by_prompt=True)
    def _est(token_level_rewards, response_mask, **_):
        return token_level_rewards, token_level_rewards

    try:
        assert algos.estimator_groups_by_prompt("_test_grouped_without_index")
    finally:
        ADV_ESTIMATORS._entries.pop("_test_grouped_without_index")
        _GROUPS_BY_PROMPT.discard("_test_grouped_without_index")


def test_yaml_default_is_auto_and_turns_on_for_grpo_on_the_builtin_model(capsys):
    c = _load()
    assert c.actor_rollout_ref.actor.use_prefix_grouper is True
    out = capsys.readouterr().out
    assert f"{KEY}=auto -> on: rollout.n=8 responses per prompt for grpo" in out
    assert out.count(KEY) == 1  # printed once


def test_gradient_checkpointing_turns_auto_off_and_refuses_true(capsys):
    ckpt = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
    assert _load([ckpt]).actor_rollout_ref.actor.use_prefix_grouper is False
    assert "auto -> off: model.enable_gradient_checkpointing=True" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="enable_gradient_checkpointing=True.*set one of them to false"):
        _load([ckpt, f"{KEY}=true"])


def _builtin_path() -> str:
    from hybridrl.models.builtin import get_builtin_model_path

    return get_builtin_model_path()


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["actor_rollout_ref.rollout.n=1"], "rollout.n=1: no prompt is shared"),
        (["algorithm.adv_estimator=gae"], "adv_estimator=gae does not compare"),
        (["algorithm.adv_estimator=reinforce_plus_plus"], "adv_estimator=reinforce_plus_plus does not"),
        (["algorithm.adv_estimator=remax"], "adv_estimator=remax does not"),
        (["actor_rollout_ref.actor.strategy=megatron"], "actor.strategy=megatron"),
        (
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.model.use_remove_padding=true",
            ],
            "ulysses_sequence_parallel_size=2",
        ),
        (
            [
                "distillation.enabled=true",
                "distillation.distillation_loss.loss_mode=forward_kl_topk",
                "distillation.teacher_models.teacher_model.model_path=" + _builtin_path(),
            ],
            "loss_mode=forward_kl_topk",
        ),
    ],
)
def test_auto_is_off_with_the_reason_outside_its_case(overrides, reason, capsys):
    c = _load(overrides)
    assert c.actor_rollout_ref.actor.use_prefix_grouper is False
    out = capsys.readouterr().out
    assert f"{KEY}=auto -> off" in out and reason in out, out


@pytest.mark.parametrize(
    "hf_config, reason",
    [
        (MistralConfig(), "sliding-window attention (sliding_window=4096)"),
        (Qwen2Config(use_sliding_window=True, num_hidden_layers=2, max_window_layers=0), "sliding_attention"),
        (Gemma2Config(), "sliding_attention"),
        (BloomConfig(), "BloomForCausalLM's forward does not pass extra keyword arguments"),
        (LlavaConfig(), "a vision-language model of model_type='llava'"),  # Qwen2-VL families only
        (None, "cannot be read here"),
    ],
)
def test_auto_is_off_for_a_model_the_grouper_refuses(hf_config, reason):
    c = copy.deepcopy(_defaults())
    c.actor_rollout_ref.actor.use_prefix_grouper = "auto"
    on, why = auto_decision(c, hf_config)
    assert on is False and reason in why, why
    assert resolve_prefix_grouper(c, hf_config) is False
    assert c.actor_rollout_ref.actor.use_prefix_grouper is False


@pytest.mark.parametrize(
    "hf_config",
    [LlamaConfig(), Qwen2Config(), MistralConfig(sliding_window=None), Qwen2VLConfig(), Qwen2_5_VLConfig()],
)
def test_supported_models_have_no_refusal(hf_config):
    assert model_refusal(hf_config) is None


def test_auto_is_on_for_a_qwen2_vl_grpo_run():
    """The shared-prompt forward takes images (tests/engine/test_prefix_group_vlm.py)."""
    c = copy.deepcopy(_defaults())
    c.actor_rollout_ref.actor.use_prefix_grouper = "auto"
    c.actor_rollout_ref.rollout.n, c.algorithm.adv_estimator = 4, "grpo"
    on, why = auto_decision(c, Qwen2VLConfig())
    assert on is True, why


def test_unreadable_model_path_turns_auto_off(capsys):
    c = _load(["actor_rollout_ref.model.path=/no/such/model", "critic.model.path=builtin:tiny"])
    assert c.actor_rollout_ref.actor.use_prefix_grouper is False
    assert "cannot be read here" in capsys.readouterr().out


@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), ("True", True)])
def test_true_and_false_are_kept_and_print_nothing(value, expected, capsys):
    c = _load([f"{KEY}={value}", "algorithm.adv_estimator=gae"])  # true even where auto says off
    assert c.actor_rollout_ref.actor.use_prefix_grouper is expected
    assert KEY not in capsys.readouterr().out


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=rf"{KEY}='sometimes': expected true, false or auto"):
        _load([f"{KEY}=sometimes"])
