import dataclasses

import pytest
from omegaconf import OmegaConf

from hybridrl.config.roles import (
    ActorConfig,
    CriticConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RewardModelConfig,
)
from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes, normalize_critic_batch_sizes


def test_defaults_follow_verl():
    a = ActorConfig()
    assert (a.ppo_mini_batch_size, a.clip_ratio, a.loss_agg_mode, a.kl_loss_type) == (
        256,
        0.2,
        "token-mean",
        "low_var_kl",
    )
    assert a.optim.lr == 1e-6 and a.optim.lr_scheduler_type == "constant" and a.optim.lr_warmup_steps == -1
    assert a.policy_loss.loss_mode == "vanilla" and a.ulysses_sequence_parallel_size == 1
    assert a.checkpoint.save_contents == ["model", "optimizer", "extra"]
    assert CriticConfig().cliprange_value == 0.5 and CriticConfig().optim.lr == 1e-5
    assert RewardModelConfig().reward_manager == "naive"
    assert a.max_grad_norm == 1.0 and dataclasses.replace(a, grad_clip=0.5).max_grad_norm == 0.5


@pytest.mark.parametrize("cls", [ModelConfig, ActorConfig, RefConfig, CriticConfig, RewardModelConfig])
def test_structured_configs_merge_and_reject_unknown_keys(cls):
    schema = OmegaConf.structured(cls)
    obj = OmegaConf.to_object(OmegaConf.merge(schema, {}))
    assert isinstance(obj, cls)
    with pytest.raises(Exception, match="not_a_key"):
        OmegaConf.merge(schema, {"not_a_key": 1})


def test_structured_actor_overrides():
    merged = OmegaConf.merge(
        OmegaConf.structured(ActorConfig),
        {
            "ppo_micro_batch_size_per_gpu": 4,
            "optim": {"lr": 3e-5, "betas": [0.9, 0.95]},
            "fsdp_config": {"mixed_precision": {"param_dtype": "fp32"}},
            "policy_loss": {"loss_mode": "gspo"},
        },
    )
    a = OmegaConf.to_object(merged)
    assert a.ppo_micro_batch_size_per_gpu == 4 and a.optim.betas == [0.9, 0.95]
    assert a.fsdp_config.mixed_precision.param_dtype == "fp32" and a.policy_loss.loss_mode == "gspo"


def test_normalize_actor_sizes():
    cfg = ActorConfig(ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=4)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=4, dp_size=8)
    assert sizes.mini_batch_size == 8 and sizes.micro_batch_size == 4  # 16 * 4 / 8
    assert cfg.ppo_mini_batch_size == 16  # not mutated
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.mini_batch_size = 3
    dyn = normalize_actor_batch_sizes(dataclasses.replace(cfg, use_dynamic_bsz=True), rollout_n=1, dp_size=2)
    assert dyn.micro_batch_size is None and dyn.use_dynamic_bsz and dyn.max_token_len == 16384


@pytest.mark.parametrize(
    ("kwargs", "n", "dp", "match"),
    [
        (
            {"ppo_mini_batch_size": 3},
            1,
            2,
            r"actor_rollout_ref\.actor\.ppo_mini_batch_size \* rollout\.n = 3 \* 1",
        ),
        (
            {"ppo_micro_batch_size_per_gpu": None},
            1,
            1,
            r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu is not set",
        ),
        (
            {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 3},
            1,
            2,
            r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=3 does not divide the per-rank mini-batch of 4",
        ),
        (
            {"ulysses_sequence_parallel_size": 2},
            1,
            1,
            r"actor_rollout_ref\.actor\.ulysses_sequence_parallel_size=2",
        ),
        ({"loss_agg_mode": "mean"}, 1, 1, r"actor_rollout_ref\.actor\.loss_agg_mode='mean'"),
        ({"shuffle": True}, 1, 1, r"actor_rollout_ref\.actor\.data_loader_seed"),
        ({"strategy": "deepspeed"}, 1, 1, r"actor_rollout_ref\.actor\.strategy='deepspeed' is not supported"),
        (
            {"optim": OptimConfig(lr_scheduler_type="polynomial")},
            1,
            1,
            r"actor_rollout_ref\.actor\.optim\.lr_scheduler_type",
        ),
    ],
)
def test_normalize_actor_errors_name_the_key(kwargs, n, dp, match):
    base = {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}
    with pytest.raises(ValueError, match=match):
        normalize_actor_batch_sizes(ActorConfig(**{**base, **kwargs}), rollout_n=n, dp_size=dp)


def test_normalize_critic():
    cfg = CriticConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=2)
    sizes = normalize_critic_batch_sizes(cfg, dp_size=2)
    assert sizes.mini_batch_size == 4 and sizes.forward_micro_batch_size == 2
    cfg2 = dataclasses.replace(cfg, forward_micro_batch_size_per_gpu=8)
    assert normalize_critic_batch_sizes(cfg2, dp_size=2).forward_micro_batch_size == 8
    with pytest.raises(ValueError, match=r"critic\.ppo_micro_batch_size_per_gpu=3"):
        normalize_critic_batch_sizes(dataclasses.replace(cfg, ppo_micro_batch_size_per_gpu=3), dp_size=2)
    with pytest.raises(ValueError, match=r"critic\.model\.use_liger=True is not implemented"):
        bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, use_liger=True))
        normalize_critic_batch_sizes(bad, dp_size=2)
