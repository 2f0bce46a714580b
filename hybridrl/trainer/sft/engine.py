"""The SFT model behind a registered training engine (`model.strategy` / `model_engine`: FSDP2, Megatron).

SFT builds its engine as the RL workers do (engine/base.py: `get_engine(strategy)` ->
`engine_cls.build_role(EngineBuildSpec)`), with the `model` section as the role section: its
`fsdp_config` for FSDP2, its `megatron` for Megatron. The layout (data-parallel ranks, Megatron's
tp x pp) comes from `ParallelDims.for_role`, so bad sizes fail there naming `model.megatron.*`.
The optimizer is AdamW with `optim.*`; the lr schedule (cosine / wsd / constant with warm-up,
`optim.lr_scheduler`) replaces the engine's own once the number of steps is known.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.config.roles import ModelConfig, OptimConfig
from hybridrl.engine.base import EngineBuildSpec, TrainEngine, get_engine
from hybridrl.engine.optim import lr_factor
from hybridrl.models.builtin import resolve_model_path
from hybridrl.models.hf import load_tokenizer
from hybridrl.trainer.sft.config import SFTConfig
from hybridrl.workers.parallel_dims import ParallelDims

__all__ = ["build_sft_engine", "sft_lr_factor", "sft_model_config", "use_lr_schedule"]


def sft_model_config(config: SFTConfig) -> ModelConfig:
    """The engines' ModelConfig of the SFT `model` section.

    `use_fused_kernels=False`: the log-probs come from the model's full logits (the HF head), the
    computation SFT always made, so the losses are the same bit for bit.
    """
    m, d = config.model, config.data
    path = resolve_model_path(m.partial_pretrain, key="model.partial_pretrain")
    tok_path = resolve_model_path(m.tokenizer_path, key="model.tokenizer_path") if m.tokenizer_path else None
    return ModelConfig(
        path=path,
        tokenizer_path=tok_path,
        trust_remote_code=m.trust_remote_code,
        override_config=dict(m.override_config),
        external_lib=m.external_lib,
        enable_gradient_checkpointing=m.enable_gradient_checkpointing,
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        target_modules=m.target_modules,
        custom_chat_template=d.chat_template,
        use_fused_kernels=False,
    )


def _role_section(config: SFTConfig) -> Any:
    """The `model` section as the engines read it (veRL SFT's cpu_offload / offload_params names
    become FSDP2's CPUOffloadPolicy)."""
    m = config.model
    fsdp = m.fsdp_config
    if fsdp.cpu_offload or fsdp.offload_params:
        fsdp = dataclasses.replace(fsdp, offload_policy=True)
    return dataclasses.replace(m, fsdp_config=fsdp)


def build_sft_engine(config: SFTConfig) -> tuple[TrainEngine, ParallelDims]:
    """(engine, parallel dims) of the SFT model on every rank (a collective), with AdamW and a
    constant lr until `use_lr_schedule`."""
    o = config.optim
    section = _role_section(config)
    entry = get_engine(section.strategy, "model.strategy")
    dims = ParallelDims.for_role(dist.get_world_size(), section, "model")
    model_config = sft_model_config(config)
    optim_config = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=list(o.betas), eps=o.eps)
    spec = EngineBuildSpec(
        role="actor",
        model_config=model_config,
        role_config=section,
        optim_config=optim_config,
        key="model",
        model_key="model",
        mesh=dims.train_mesh(),
        rank=dist.get_rank(),
    )
    engine = entry.engine_cls.build_role(spec)
    if engine.tokenizer is None:
        engine.tokenizer = load_tokenizer(model_config, key="model")  # raises the loading error
    return engine, dims


def sft_lr_factor(config: SFTConfig, total_steps: int) -> Callable[[int], float]:
    """step -> multiplier of optim.lr (`optim.lr_scheduler` with warm-up, see optim.lr_factor)."""
    o = config.optim
    warmup = o.lr_warmup_steps if o.lr_warmup_steps > 0 else int(o.lr_warmup_steps_ratio * total_steps)
    return functools.partial(
        lr_factor,
        scheduler_type=o.lr_scheduler,
        warmup_steps=warmup,
        total_steps=total_steps,
        min_lr_ratio=o.min_lr_ratio,
        num_cycles=o.num_cycles,
        stable_ratio=o.stable_ratio,
    )


def use_lr_schedule(engine: TrainEngine, factor: Callable[[int], float]) -> None:
    """Make `engine`'s lr follow optim.lr * factor(step) from step 0 (before the first step).

    A torch optimizer gets a LambdaLR (what the checkpoints of the FSDP engine hold); Megatron's
    optimizer keeps its engine's schedule object (`ParamGroupLR`, the same semantics) with the
    factor replaced.
    """
    if isinstance(engine.optimizer, torch.optim.Optimizer):
        engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, factor)
        return
    schedule = engine.lr_scheduler
    if not hasattr(schedule, "factor"):
        raise NotImplementedError(
            f"{type(engine).__name__}: its lr schedule {type(schedule).__name__} takes no step -> factor "
            "function, so optim.lr_scheduler cannot be applied"
        )
    schedule.factor = factor
    schedule.load_state_dict(schedule.state_dict())  # applies factor(current step) to the param groups
