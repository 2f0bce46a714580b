"""The Megatron engine's training machinery: megatron-core's DistributedDataParallel wrapper, its
optimizer (AdamW, plain or distributed; fp32 main parameters under bf16) and an lr schedule with the
FSDP engine's semantics over the optimizer's param groups (`ParamGroupLR`)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hybridrl.config.megatron import MegatronConfig
from hybridrl.config.roles import OptimConfig
from hybridrl.engine.megatron.cpu_shims import cuda_to_cpu, needs_cpu_shims
from hybridrl.engine.megatron.optim_config import megatron_optimizer_config
from hybridrl.engine.optim import lr_factor, num_warmup_steps

__all__ = ["ParamGroupLR", "build_optimizer", "wrap_ddp"]


class ParamGroupLR:
    """The FSDP engine's lr schedule (optim.lr_factor) over a Megatron optimizer's param groups.

    torch's LambdaLR accepts only torch optimizers; this keeps its interface (step, get_last_lr,
    state_dict, load_state_dict) and its semantics (lr = base_lr * factor(step), step 0 first).
    """

    def __init__(self, optimizer: Any, config: OptimConfig, key: str) -> None:
        self.optimizer = optimizer
        self.base_lr = float(config.lr)
        if config.scheduler_type in ("cosine", "linear") and config.total_training_steps <= 0:
            raise ValueError(
                f"{key}.lr_scheduler_type={config.scheduler_type} needs {key}.total_training_steps > 0"
            )
        self.factor = functools.partial(
            lr_factor,
            warmup_steps=num_warmup_steps(config, key),
            scheduler_type=config.scheduler_type,
            total_steps=config.total_training_steps,
            min_lr_ratio=config.min_lr_ratio,
            num_cycles=config.num_cycles,
        )
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.base_lr * self.factor(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["max_lr"] = lr  # Megatron's param-group field
            group["min_lr"] = lr

    def get_last_lr(self) -> list[float]:
        return [self.base_lr * self.factor(self.last_epoch)]

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self.base_lr = float(state["base_lr"])
        self._apply()


def build_optimizer(
    chunks: list[Any], optim: OptimConfig, mcfg: MegatronConfig, dtype: torch.dtype, key: str
):
    """Megatron's AdamW; with bf16 parameters it keeps fp32 main parameters (and steps on fp32 grads).
    `megatron.override_optimizer_config` (veRL's `optim.override_optimizer_config`) sets further fields."""
    from megatron.core.optimizer import get_megatron_optimizer

    ocfg = megatron_optimizer_config(
        optim,
        use_distributed_optimizer=mcfg.use_distributed_optimizer,
        dtype=dtype,
        overrides=mcfg.override_optimizer_config,
        key=f"{key}.override_optimizer_config",
        on_cpu=needs_cpu_shims(),
    )
    with cuda_to_cpu():
        return get_megatron_optimizer(ocfg, chunks)


def wrap_ddp(chunks: list[Any], tcfg: Any, mcfg: MegatronConfig) -> list[Any]:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=mcfg.use_distributed_optimizer,
    )
    tcfg.finalize_model_grads_func = finalize_model_grads
    wrapped = []
    with cuda_to_cpu():
        for i, chunk in enumerate(chunks):
            wrapped.append(
                DistributedDataParallel(
                    config=tcfg, ddp_config=ddp_cfg, module=chunk, disable_bucketing=i > 0
                )
            )
    return wrapped
