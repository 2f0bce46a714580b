"""`actor.fsdp_config.compile_layers: null` (the actor's yaml default): on only for a long CPU run of a
large enough text-only model on the FSDP engine, off with a printed reason everywhere else; true / false
mean what they say; the other roles default to false."""

from __future__ import annotations

import copy
import functools
import shutil

import pytest
from hydra import compose, initialize_config_module

from hybridrl.trainer.ppo.compile_auto import (
    MIN_PARAMS,
    MIN_STEPS,
    auto_decision,
    estimate_params,
    resolve_compile_layers,
)
from hybridrl.trainer.ppo.config import load_config
from hybridrl.utils.config_loader import ConfigError

KEY = "actor_rollout_ref.actor.fsdp_config.compile_layers"
# the ~100M bench model's sizes (bench/real_model.py: real100m, 4 KV heads, tied embeddings)
REAL100M = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "vocab_size": 32768,
    "tie_word_embeddings": True,
}
# the ~30M bench model (bench/_common.py MODEL_30M: 30,766,080 parameters with norms and biases)
MODEL_30M = {
    "hidden_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 12,
    "intermediate_size": 2304,
    "vocab_size": 103,
    "tie_word_embeddings": True,
}
# the built-in tiny model's sizes (docs/builtin_model.md)
TINY = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 103,
    "tie_word_embeddings": True,
}


@functools.cache
def _defaults():
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer")
    return load_config(cfg)


def _config(steps=400, grouper=False, **model):
    config = copy.deepcopy(_defaults())
    config.trainer.total_training_steps = steps
    config.actor_rollout_ref.actor.use_prefix_grouper = grouper  # as resolved at the config stage
    for k, v in model.items():
        setattr(config.actor_rollout_ref.model, k, v)
    return config


def test_yaml_defaults():
    config = _defaults()
    assert config.actor_rollout_ref.actor.fsdp_config.compile_layers is None  # auto
    assert config.actor_rollout_ref.ref.fsdp_config.compile_layers is False
    assert config.critic.model.fsdp_config.compile_layers is False


def test_param_estimate_is_hand_derived():
    # per layer: q, o 2 * 768^2, k, v 2 * 768 * (4 * 64), gate, up, down 3 * 768 * 2048; tied embedding
    want = 32768 * 768 + 12 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048)
    assert estimate_params(REAL100M) == want == 100_663_296
    assert estimate_params({**REAL100M, "tie_word_embeddings": False}) == want + 32768 * 768
    # 30M: 4 * (4 * 768^2 + 3 * 768 * 2304) + 103 * 768 = 30,749,952 (the 30,766,080 less norms, biases)
    assert estimate_params(MODEL_30M) == 30_749_952
    assert estimate_params({"hidden_size": 8}) is None


def test_on_for_a_long_cpu_run_of_a_large_model_with_the_padded_forward():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: auto is off, tested below")
    on, reason = auto_decision(_config(), REAL100M, on_gpu=False)
    assert on, reason
    assert "101M parameters, 400 steps" in reason


@pytest.mark.parametrize(
    "case, config_kw, model_json, on_gpu, why",
    [
        ("tiny model", {}, TINY, False, "under 80M"),
        ("short run", {"steps": MIN_STEPS - 1}, REAL100M, False, f"{MIN_STEPS - 1} training steps"),
        ("GPU", {}, REAL100M, True, "on GPUs"),
        ("unreadable config", {}, None, False, "cannot be read"),
        ("VLM", {}, {**REAL100M, "vision_config": {}}, False, "vision-language"),
        ("LoRA", {"lora_rank": 8}, REAL100M, False, "LoRA"),
        ("checkpointing", {"enable_gradient_checkpointing": True}, REAL100M, False, "gradient checkpointing"),
        ("unknown size", {}, {"hidden_size": 8}, False, "an unknown size"),
        ("shared-prompt forward", {"grouper": True}, REAL100M, False, "the shared-prompt forward"),
        ("packed forward", {"use_remove_padding": True}, REAL100M, False, "the packed forward"),
    ],
)
def test_off_with_its_reason(case, config_kw, model_json, on_gpu, why):
    on, reason = auto_decision(_config(**config_kw), model_json, on_gpu=on_gpu)
    assert not on and why in reason, (case, reason)


def test_several_training_ranks_are_off():
    config = _config()
    config.trainer.n_gpus_per_node = 2
    on, reason = auto_decision(config, REAL100M, on_gpu=False)
    assert not on and "2 training ranks" in reason


def test_megatron_is_off():
    config = _config()
    config.actor_rollout_ref.actor.strategy = "megatron"
    on, reason = auto_decision(config, REAL100M, on_gpu=False)
    assert not on and "FSDP engine" in reason


def test_threshold_is_between_the_measured_sizes():
    # measured: no gain at ~30M, a gain at ~100M (bench/compile_layers.py)
    assert estimate_params(MODEL_30M) < MIN_PARAMS < estimate_params(REAL100M)
    assert not auto_decision(_config(), MODEL_30M, on_gpu=False)[0]


def test_resolve_prints_once_and_stores_a_bool(capsys):
    config = _config()
    on = resolve_compile_layers(config, TINY, on_gpu=False)
    assert on is False and config.actor_rollout_ref.actor.fsdp_config.compile_layers is False
    assert f"{KEY}=null (auto) -> off" in capsys.readouterr().out
    for value in (True, False):  # explicit values are kept, nothing printed
        config.actor_rollout_ref.actor.fsdp_config.compile_layers = value
        assert resolve_compile_layers(config, TINY, on_gpu=False) is value
        assert capsys.readouterr().out == ""
    config.actor_rollout_ref.actor.fsdp_config.compile_layers = "sometimes"
    with pytest.raises(ConfigError, match=KEY):
        resolve_compile_layers(config, TINY, on_gpu=False)


def test_the_driver_decides_before_the_workers_start(tmp_path, capsys, monkeypatch):
    """`prepare_run` (the driver's part before Ray) turns the actor's null into a bool, from the real
    config.json, the computed step count and the resolved shared-prompt forward: the zero-argument
    GRPO run stays eager."""
    from hybridrl.trainer.ppo.setup import prepare_run
    from tests.e2e.ppo_runs import compose_config

    monkeypatch.setenv("HYBRIDRL_LOG_DIR", str(tmp_path / "logs"))
    config = compose_config(["trainer.logger=[console]"], tmp_path)
    assert config.actor_rollout_ref.actor.fsdp_config.compile_layers is None
    run = prepare_run(config)
    run.tracker.finish()
    assert config.actor_rollout_ref.actor.fsdp_config.compile_layers is False
    out = capsys.readouterr().out
    assert f"{KEY}=null (auto) -> off: the shared-prompt forward" in out, out
