"""megatron-core's `OptimizerConfig` for the Megatron engine, with veRL's `optim.override_optimizer_config`.

The engine sets the AdamW fields from `*.optim` (lr, weight decay, betas, eps) and the precision from
`megatron.dtype`; `override_optimizer_config` (veRL's `actor_rollout_ref.actor.optim.override_optimizer_config`,
read here from `megatron.override_optimizer_config`) sets any other field of megatron-core's
`OptimizerConfig`:

- a name megatron-core's `OptimizerConfig` does not have is refused, naming it;
- a field the engine takes from another key (`lr`, `weight_decay`, `adam_eps`, `clip_grad`, ...) is
  refused with that key: the engine's learning-rate schedule and gradient clipping own them;
- fields that only work with CUDA (optimizer CPU offload, the precision-aware optimizer, which runs
  Transformer Engine's FusedAdam) are refused on a machine without CUDA, with the reason, when set
  to anything but megatron-core's default; on GPUs they go to megatron-core as given.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch

from hybridrl.config.roles import OptimConfig

__all__ = ["megatron_optimizer_config"]

OWNED = {  # OptimizerConfig field -> the key that sets it
    "optimizer": "optim.optimizer (AdamW)",
    "lr": "optim.lr",
    "min_lr": "optim.min_lr / optim.min_lr_ratio",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "adam_eps": "optim.eps",
    "clip_grad": "optim.clip_grad",
    "use_distributed_optimizer": "megatron.use_distributed_optimizer",
    "params_dtype": "megatron.dtype",
    "bf16": "megatron.dtype",
    "fp16": "megatron.dtype",
}
CUDA_ONLY = {  # OptimizerConfig field -> why it needs CUDA
    "optimizer_cpu_offload": "Megatron's HybridDeviceOptimizer moves optimizer states between the GPU and host "
    "memory (here they already live in host memory)",
    "optimizer_offload_fraction": "it sets how much of the optimizer HybridDeviceOptimizer offloads from the GPU",
    "overlap_cpu_optimizer_d2h_h2d": "it overlaps HybridDeviceOptimizer's GPU <-> host copies",
    "use_torch_optimizer_for_cpu_offload": "it picks HybridDeviceOptimizer's host optimizer",
    "pin_cpu_grads": "pinned host buffers serve GPU <-> host copies",
    "pin_cpu_params": "pinned host buffers serve GPU <-> host copies",
    "use_precision_aware_optimizer": "the precision-aware optimizer runs Transformer Engine's FusedAdam (CUDA)",
    "main_grads_dtype": "reduced-precision optimizer buffers need the precision-aware optimizer (CUDA)",
    "main_params_dtype": "reduced-precision optimizer buffers need the precision-aware optimizer (CUDA)",
    "exp_avg_dtype": "reduced-precision optimizer buffers need the precision-aware optimizer (CUDA)",
    "exp_avg_sq_dtype": "reduced-precision optimizer buffers need the precision-aware optimizer (CUDA)",
    "store_param_remainders": "it is an option of the precision-aware optimizer (CUDA)",
}
_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp8": torch.uint8, "uint8": torch.uint8}  # fmt: skip


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _value(name: str, value: Any, key: str) -> Any:
    """veRL writes dtypes as strings ('fp32', 'bf16'); megatron-core wants torch dtypes."""
    if name in _DTYPE_FIELDS and isinstance(value, str):
        if value.lower() not in _DTYPES:
            raise ValueError(f"{key}.{name}={value!r}: use one of {sorted(_DTYPES)}")
        return _DTYPES[value.lower()]
    return value


def checked_overrides(overrides: dict[str, Any], key: str, on_cpu: bool) -> dict[str, Any]:
    """`overrides` validated against megatron-core's OptimizerConfig (module docstring); the fields to set."""
    from megatron.core.optimizer import OptimizerConfig

    defaults = _defaults(OptimizerConfig)
    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    out = {}
    for name, value in (overrides or {}).items():
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"{key}.{name}: megatron-core's OptimizerConfig has no field {name!r}{hint}")
        if name in OWNED:
            raise ValueError(
                f"{key}.{name}: the engine sets this field from {OWNED[name]}; set that key instead"
            )
        value = _value(name, value, key)
        if on_cpu and name in CUDA_ONLY and value != defaults.get(name):
            raise ValueError(
                f"{key}.{name}={value}: {CUDA_ONLY[name]}; this machine has no CUDA. Drop the override "
                "(on GPUs it goes to megatron-core as given)"
            )
        out[name] = value
    return out


def megatron_optimizer_config(
    optim: OptimConfig,
    *,
    use_distributed_optimizer: bool,
    dtype: torch.dtype,
    overrides: dict[str, Any],
    key: str,
    on_cpu: bool,
) -> Any:
    """megatron-core's OptimizerConfig: AdamW from `optim`, precision from `dtype`, then `overrides`.

    `min_lr` is the schedule's floor (`lr * min_lr_ratio`); the engine's ParamGroupLR sets the
    learning rate of every step. Gradients are clipped by the engine (`clip_grad=0` here).
    """
    from megatron.core.optimizer import OptimizerConfig

    kwargs = dict(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        clip_grad=0.0,
        use_distributed_optimizer=use_distributed_optimizer,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=False,
    )
    kwargs.update(checked_overrides(overrides, key, on_cpu))
    return OptimizerConfig(**kwargs)
