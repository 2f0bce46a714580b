"""AdamW and the learning-rate schedule (linear warm-up, then constant, cosine, linear or 1/sqrt).

The schedule is a pure function of the step (`lr_factor`), wrapped in a `LambdaLR` whose state
(last step, base lrs) goes into checkpoints.
"""

from __future__ import annotations

import functools
import math

import torch

from hybridrl.config.roles import LR_SCHEDULER_TYPES, OptimConfig
from hybridrl.cpu.adamw import use_fused_adamw


def num_warmup_steps(config: OptimConfig, key: str = "optim") -> int:
    """`lr_warmup_steps` when > 0, else int(lr_warmup_steps_ratio * total_training_steps)."""
    if config.lr_warmup_steps > 0:
        return int(config.lr_warmup_steps)
    if config.lr_warmup_steps_ratio > 0:
        if config.total_training_steps <= 0:
            raise ValueError(
                f"{key}.lr_warmup_steps_ratio={config.lr_warmup_steps_ratio} needs {key}.total_training_steps "
                "(the trainer sets it); or give the warm-up as lr_warmup_steps"
            )
        return int(config.lr_warmup_steps_ratio * config.total_training_steps)
    return 0


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    scheduler_type: str,
    total_steps: int,
    min_lr_ratio: float,
    num_cycles: float,
    stable_ratio: float = 0.0,
) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based); RL and SFT.

    Warm-up: step / warmup_steps for step < warmup_steps (so step 0 has lr 0, as in veRL and
    transformers). Then
      constant: 1;
      cosine:   from 1 down to `min_lr_ratio`: min + (1 - min) * (1 + cos(2 pi num_cycles p)) / 2,
                p the post-warm-up progress (clamped to 1 after `total_steps`);
      linear:   min + (1 - min) * (1 - p) (Megatron's `linear` lr_decay_style);
      inverse_square_root: max(min, sqrt(max(1, warmup_steps) / step)) (Megatron's: 1 at the end
                of warm-up, independent of `total_steps`);
      wsd:      1 for the first `stable_ratio` of the post-warm-up steps, then the cosine above
                over the remaining steps (warm-up, stable, decay).
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if scheduler_type == "constant":
        return 1.0
    if scheduler_type == "inverse_square_root":
        return max(min_lr_ratio, math.sqrt(max(1, warmup_steps) / max(1, step)))
    decay_start = warmup_steps
    if scheduler_type == "wsd":
        decay_start = warmup_steps + int(stable_ratio * max(0, total_steps - warmup_steps))
        if step < decay_start:
            return 1.0
    elif scheduler_type not in ("cosine", "linear"):
        raise ValueError(
            f"unknown lr_scheduler_type {scheduler_type!r}; use 'constant', 'cosine', 'linear', "
            "'inverse_square_root' or 'wsd'"
        )
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    if scheduler_type == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress))
    return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def build_optimizer(module: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `module` (sharded DTensors under FSDP2).

    Where every parameter is a CPU floating-point tensor the step runs torch's fused kernel
    (`fused=True`, hybridrl.cpu.adamw); elsewhere torch picks its default (foreach on CUDA).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    kwargs: dict = {}
    if use_fused_adamw(params):
        kwargs["fused"] = True
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=(float(config.betas[0]), float(config.betas[1])),
        eps=config.eps,
        weight_decay=config.weight_decay,
        **kwargs,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, key: str = "optim"
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor` with the settings of `config`."""
    scheduler_type = config.scheduler_type
    if scheduler_type not in LR_SCHEDULER_TYPES:
        raise ValueError(f"{key}.lr_scheduler_type={scheduler_type!r} is not one of {LR_SCHEDULER_TYPES}")
    if scheduler_type in ("cosine", "linear") and config.total_training_steps <= 0:
        raise ValueError(
            f"{key}.lr_scheduler_type={scheduler_type} needs {key}.total_training_steps > 0 (the trainer sets it)"
        )
    fn = functools.partial(
        lr_factor,
        warmup_steps=num_warmup_steps(config, key),
        scheduler_type=scheduler_type,
        total_steps=config.total_training_steps,
        min_lr_ratio=config.min_lr_ratio,
        num_cycles=config.num_cycles,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
