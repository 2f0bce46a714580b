"""veRL's Megatron keys of its MoE scripts: batch splitting over data-parallel ranks, the optimizer's
`min_lr` and `override_optimizer_config`."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

from hybridrl.trainer.ppo.config import load_config
from hybridrl.utils.config_loader import ConfigError

ARR = "actor_rollout_ref"
# veRL's Moonlight script: 24 ranks, TP=4 x PP=3 (2 data-parallel ranks), 64 prompts x 5 per mini-batch
MOONLIGHT = [
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=3",
    "data.train_batch_size=192",
    f"{ARR}.actor.ppo_mini_batch_size=64",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=16",
    f"{ARR}.rollout.n=5",
]
MEGATRON = [
    f"{ARR}.actor.strategy=megatron",
    f"{ARR}.actor.megatron.tensor_model_parallel_size=4",
    f"{ARR}.actor.megatron.pipeline_model_parallel_size=3",
]


def _load(overrides):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        return load_config(compose("ppo_trainer", overrides=list(overrides)))


def test_mini_batch_splits_over_data_parallel_ranks_not_all_ranks():
    c = _load(MOONLIGHT + MEGATRON)  # 320 rows per mini-batch over 2 data-parallel ranks (veRL's rule)
    assert c.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 4
    with pytest.raises(ConfigError, match="320 rows must divide across the actor's 24 data-parallel ranks"):
        _load(MOONLIGHT)  # FSDP: every rank is a data-parallel rank
    with pytest.raises(
        ConfigError,
        match=r"per-rank mini-batch 160 \(.*\) is not divisible by .*ppo_micro_batch_size_per_gpu=3",
    ):
        _load([*MOONLIGHT, *MEGATRON, f"{ARR}.actor.ppo_micro_batch_size_per_gpu=3"])


def test_override_optimizer_config_moves_to_the_megatron_section():
    key = f"+{ARR}.actor.optim.override_optimizer_config"
    c = _load([*MEGATRON, "trainer.n_gpus_per_node=12", f"{key}.decoupled_weight_decay=false"])
    assert c.actor_rollout_ref.actor.megatron.override_optimizer_config == {"decoupled_weight_decay": False}
    with pytest.raises(
        ConfigError, match="override_optimizer_config sets fields of Megatron's OptimizerConfig"
    ):
        _load([f"{key}.decoupled_weight_decay=false"])  # strategy=fsdp


def _optim_config(overrides, on_cpu=True, **optim):
    pytest.importorskip("megatron.core")
    from hybridrl.config.roles import OptimConfig
    from hybridrl.engine.megatron.optim_config import megatron_optimizer_config

    return megatron_optimizer_config(
        OptimConfig(lr=1e-5, **optim), use_distributed_optimizer=True, dtype=torch.float32,
        overrides=overrides, key="actor_rollout_ref.actor.optim.override_optimizer_config", on_cpu=on_cpu,
    )  # fmt: skip


def test_optimizer_overrides_reach_megatron_optimizer_config():
    ocfg = _optim_config({"decoupled_weight_decay": False, "log_num_zeros_in_grad": True}, min_lr_ratio=0.1)
    assert ocfg.decoupled_weight_decay is False and ocfg.log_num_zeros_in_grad is True
    assert ocfg.lr == 1e-5 and ocfg.min_lr == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="has no field 'optimizer_offload'"):
        _optim_config({"optimizer_offload": True})
    with pytest.raises(ValueError, match="adam_eps: the engine sets this field from optim.eps"):
        _optim_config({"adam_eps": 1e-6})
    for name, value in (("optimizer_cpu_offload", True), ("use_precision_aware_optimizer", True)):
        with pytest.raises(ValueError, match=f"{name}=True: .* this machine has no CUDA"):
            _optim_config({name: value})
    # on GPUs they go to megatron-core as given (the precision-aware optimizer also needs Transformer Engine)
    ocfg = _optim_config({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}, on_cpu=False)
    assert ocfg.optimizer_cpu_offload is True and ocfg.optimizer_offload_fraction == 0.5


def test_min_lr_floors_the_megatron_schedule():
    pytest.importorskip("megatron.core")
    from hybridrl.config.roles import OptimConfig
    from hybridrl.engine.megatron.engine import ParamGroupLR

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        c = load_config(
            compose(
                "ppo_trainer", overrides=[f"{ARR}.actor.optim.lr=1e-5", f"+{ARR}.actor.optim.min_lr=2e-6"]
            )
        )
    ratio = c.actor_rollout_ref.actor.optim.min_lr_ratio
    assert ratio == pytest.approx(0.2)
    optim = OptimConfig(lr=1e-5, lr_scheduler_type="cosine", min_lr_ratio=ratio, total_training_steps=10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-5)
    sched, lrs = ParamGroupLR(opt, optim, "actor_rollout_ref.actor.optim"), []
    for _ in range(15):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs[0] == pytest.approx(1e-5) and min(lrs) == pytest.approx(2e-6)
    assert lrs[10:] == pytest.approx([2e-6] * 5)  # the floor after the decay
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


FOUR_RANKS = [
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=8",
    f"{ARR}.actor.ppo_mini_batch_size=8",
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2",
]


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ([f"{ARR}.rollout.moe_tensor_parallel_size=2"], "TensorRT-LLM's MoE tensor parallelism"),
        ([f"{ARR}.rollout.expert_parallel_size=2"], "are vLLM / SGLang engine settings; rollout.name=hf"),
        (
            [f"{ARR}.rollout.name=vllm", f"{ARR}.rollout.expert_parallel_size=64", f"{ARR}.rollout.tensor_model_parallel_size=2"],
            "expert_parallel_size=64 must equal tensor_model_parallel_size \\* data_parallel_size = 2",
        ),
        (
            [f"{ARR}.rollout.name=vllm", f"{ARR}.rollout.expert_parallel_size=4", f"{ARR}.rollout.tensor_model_parallel_size=2",
             f"{ARR}.rollout.data_parallel_size=2"],
            "one engine whose experts span 2 data-parallel groups",
        ),
        (
            [f"{ARR}.rollout.name=vllm", f"{ARR}.rollout.data_parallel_size=4", f"{ARR}.rollout.tensor_model_parallel_size=2"],
            "= 8 must divide the 4 rollout ranks",
        ),
    ],
)  # fmt: skip
def test_rollout_engine_parallel_sizes_follow_verl_rules(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _load([*FOUR_RANKS, *overrides])


def test_rollout_expert_parallel_reaches_the_engine_arguments():
    r = _load(
        [*FOUR_RANKS, f"{ARR}.rollout.name=vllm", f"{ARR}.rollout.tensor_model_parallel_size=2",
         f"{ARR}.rollout.expert_parallel_size=2"]
    ).actor_rollout_ref.rollout  # fmt: skip
    assert (r.expert_parallel_size, r.data_parallel_size) == (2, 1)
    pytest.importorskip("vllm")
    from hybridrl.rollout.vllm_rollout import VLLMRollout

    engine = VLLMRollout.__new__(VLLMRollout)  # the argument builder only; no engine starts
    engine._owns_default_group, engine._sleep_enabled, engine.dtype = True, False, torch.float32
    r.engine_kwargs.vllm = {"kv_cache_memory_bytes": 1 << 20}
    assert engine._engine_kwargs(r, "unused", None)["enable_expert_parallel"] is True


def test_engine_level_router_replay_is_the_role_level_key():
    replay = [f"{ARR}.rollout.enable_rollout_routing_replay=true", f"{ARR}.rollout.name=hf", *MEGATRON[:1]]
    c = _load([f"+{ARR}.actor.megatron.router_replay.mode=R3", *replay])
    assert (c.actor_rollout_ref.actor.router_replay.mode, c.actor_rollout_ref.ref.router_replay.mode) == (
        "R3",
        "R3",
    )
    c = _load([f"+{ARR}.actor.megatron.router_replay.mode=R3", f"{ARR}.actor.router_replay.mode=R3", *replay])
    assert c.actor_rollout_ref.actor.router_replay.mode == "R3"  # both spellings, one value
    with pytest.raises(
        ConfigError, match=r"megatron.router_replay.mode='R3' \(veRL's newer spelling\) and .*disagree"
    ):
        _load([f"+{ARR}.actor.megatron.router_replay.mode=R3", f"{ARR}.actor.router_replay.mode=R2", *replay])
    with pytest.raises(ConfigError, match="critic.megatron.router_replay.mode='R3' is a veRL key"):
        _load(["+critic.megatron.router_replay.mode=R3"])


@pytest.mark.parametrize(
    "override",
    [
        f"{ARR}.actor.optim.min_lr=1e-6",
        f"{ARR}.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
        f"{ARR}.actor.megatron.router_replay.mode=R3",
        f"{ARR}.rollout.expert_parallel_size=2",
        f"{ARR}.rollout.moe_tensor_parallel_size=1",
    ],
)
def test_command_line_takes_verl_spellings_without_plus(override):
    from hybridrl.compat.verl_layout import layout_knows
    from hybridrl.trainer.ppo.config import PPOConfig
    from hybridrl.utils.config_loader import check_override_keys

    check_override_keys([override], PPOConfig, "ppo_trainer.yaml", layout_knows)


def test_verls_model_lora_keys_are_the_megatron_lora():
    lora = f"+{ARR}.model.lora"
    given = [f"{lora}.rank=32", f"{lora}.alpha=64", f"{lora}.lora_A_init_method=kaiming", f"{lora}.merge=false",
             f"{lora}.type=lora", f"{lora}.dropout=0.0", f"{lora}.lora_B_init_method=zero"]  # fmt: skip
    m = _load([*MEGATRON, "trainer.n_gpus_per_node=12", *given]).actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.lora_init_a) == (32, 64, "kaiming")
    m = _load(
        [*MEGATRON, "trainer.n_gpus_per_node=12", f"{lora}.rank=8", f"{lora}.target_modules=[linear_proj]"]
    )
    assert (m.actor_rollout_ref.model.lora_rank, list(m.actor_rollout_ref.model.target_modules)) == (
        8,
        ["linear_proj"],
    )
    with pytest.raises(ConfigError, match=r"model.lora.dropout=0.1 .*LoRA dropout is not implemented"):
        _load([*MEGATRON, "trainer.n_gpus_per_node=12", f"{lora}.rank=8", f"{lora}.dropout=0.1"])
    with pytest.raises(ConfigError, match="lora_init_a='kaiming' .* strategy=fsdp uses PEFT's own init"):
        _load([f"{lora}.rank=8", f"{lora}.lora_A_init_method=kaiming"])
    with pytest.raises(
        ConfigError,
        match=r"model.lora.rank=16 \(veRL's newer spelling\) and actor_rollout_ref.model.lora_rank=8 disagree",
    ):
        _load([*MEGATRON, "trainer.n_gpus_per_node=12", f"{ARR}.model.lora_rank=8", f"{lora}.rank=16"])
    with pytest.raises(ConfigError, match="critic.model.lora.rank=8"):
        _load(["+critic.model.lora.rank=8"])


def test_megatron_lora_targets():
    from hybridrl.engine.megatron.lora import megatron_targets

    assert megatron_targets("all-linear", None, "m") == (
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    )
    assert megatron_targets(["q_proj", "k_proj", "v_proj", "down_proj"], None, "m") == (
        "linear_qkv",
        "linear_fc2",
    )
    assert megatron_targets("all-linear", ["linear_qkv", "linear_fc.*"], "m") == ("linear_proj",)
    with pytest.raises(ValueError, match="'q_proj' is part of Megatron's fused linear_qkv"):
        megatron_targets(["q_proj", "v_proj"], None, "m")
    with pytest.raises(ValueError, match="'lm_head' is not a Megatron linear"):
        megatron_targets(["lm_head"], None, "m")
