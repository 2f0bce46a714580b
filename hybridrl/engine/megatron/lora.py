"""LoRA adapters on megatron-core's tensor-parallel linears (veRL's Megatron LoRA, `model.lora.*`).

A targeted `ColumnParallelLinear` / `RowParallelLinear` W (out, in) gets two trained factors,
A (r, in) and B (out, r); the layer computes with W + (alpha / r) * B @ A, W frozen:

    y = x (W + s B A)^T        s = alpha / r     (Hu et al., 2021, eq. 3; dropout 0)

Every other parameter of the model is frozen. The factors are sharded like the weight they adapt:

    column-parallel (linear_qkv, linear_fc1)   W (out/tp, in)   B (out/tp, r) sharded, A (r, in) replicated
    row-parallel (linear_proj, linear_fc2)     W (out, in/tp)   A (r, in/tp) sharded, B (out, r) replicated

so each rank's W + s B A is its shard of the full merged weight and the layer's own forward
(its TP / sequence-parallel communication) runs unchanged on it. The replicated factor enters
through megatron-core's `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
backward): its gradient is the sum of every TP rank's part. A is drawn in full from a generator
seeded by (megatron.seed, the layer's global name) and sliced, so every TP size starts from the
same adapter. Expert linears take the expert-TP group.

The merged weight is what leaves the engine (weight sync, HF export); `disabled()` runs the base
model (the reference policy of a LoRA actor).
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Hugging Face projection names that are one Megatron linear (the fused ones only as a whole group)
HF_GROUPS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
INITS = ("xavier", "kaiming")


@dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha, the Megatron linears adapted, A's init ('xavier' | 'kaiming'), the seed."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    init_a: str = "xavier"
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def megatron_targets(target_modules: Any, exclude_modules: Any, key: str) -> tuple[str, ...]:
    """The Megatron linears of `target_modules` ('all-linear', Megatron names, or Hugging Face names
    where they are one Megatron linear) minus `exclude_modules`."""
    names = list(TARGETS) if target_modules in (None, "all-linear") else _as_list(target_modules)
    out = []
    for name in names:
        if name in TARGETS:
            out.append(name)
            continue
        group = next((m for m, hf in HF_GROUPS.items() if name in hf), None)
        if group is None:
            raise ValueError(
                f"{key}.target_modules: {name!r} is not a Megatron linear; use 'all-linear' or some of {list(TARGETS)}"
            )
        if not set(HF_GROUPS[group]) <= set(names):
            raise ValueError(
                f"{key}.target_modules: {name!r} is part of Megatron's fused {group} ({'/'.join(HF_GROUPS[group])}), "
                f"which one adapter covers; list all of {list(HF_GROUPS[group])} or {group!r}"
            )
        out.append(group)
    excluded = _as_list(exclude_modules or [])  # names, or regexes over the linear's name
    kept = tuple(t for t in TARGETS if t in out and not any(re.fullmatch(e, t) or e == t for e in excluded))
    if not kept:
        raise ValueError(
            f"{key}.target_modules leaves no Megatron linear to adapt ({names}, excluding {excluded})"
        )
    return kept


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def attach_for_role(
    chunks: list[nn.Module], model_config: Any, mcfg: Any, tcfg: Any, role: str, model_key: str, global_name
) -> None:
    """model.lora_rank > 0: trained LoRA factors on the target linears, the rest frozen (`attach`)."""
    if model_config.lora_rank <= 0 or role != "actor":
        return
    if getattr(tcfg, "gradient_accumulation_fusion", False):
        raise ValueError(
            f"{model_key}.lora_rank > 0 with override_transformer_config.gradient_accumulation_fusion=True: the "
            "fused accumulation writes the frozen base weight's main_grad; set it to false with LoRA"
        )
    targets = megatron_targets(model_config.target_modules, model_config.exclude_modules, model_key)
    spec = LoraSpec(
        model_config.lora_rank,
        float(model_config.lora_alpha),
        targets,
        model_config.lora_init_a or "xavier",
        mcfg.seed,
    )
    if attach(chunks, spec, global_name) == 0:
        raise ValueError(
            f"{model_key}.target_modules={list(targets)}: no such linear in the model on this rank"
        )


def attach(chunks: list[nn.Module], spec: LoraSpec, global_name) -> int:
    """Freeze every parameter of `chunks` and add trained factors to the targeted linears
    (before DDP wraps them). `global_name(local_param_name, chunk)` names a layer model-wide.
    Returns the number of adapted linears on this rank."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for name, mod in chunk.named_modules():
            if name.rsplit(".", 1)[-1] in spec.targets and isinstance(
                mod, (ColumnParallelLinear, RowParallelLinear)
            ):
                _add_factors(
                    mod, isinstance(mod, ColumnParallelLinear), spec, global_name(f"{name}.weight", chunk)
                )
                count += 1
    return count


def _full_a(shape: tuple[int, int], init: str, seed: int, name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(shape)
    if init == "kaiming":  # as PEFT's default: kaiming_uniform with a = sqrt(5)
        bound = math.sqrt(6.0 / ((1 + 5.0) * shape[1]))
    else:  # xavier uniform
        bound = math.sqrt(6.0 / (shape[0] + shape[1]))
    return a.uniform_(-bound, bound, generator=gen)


def _add_factors(mod: nn.Module, column: bool, spec: LoraSpec, name: str) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    group = mod.tp_group
    tp, rank = group.size(), group.rank()
    w = mod.weight
    out_local, in_local = w.shape
    in_full = in_local if column else in_local * tp
    a = _full_a((spec.rank, in_full), spec.init_a, spec.seed, name)
    if not column:
        a = a[:, rank * in_local : (rank + 1) * in_local]
    mod.lora_A = nn.Parameter(a.to(w.dtype).contiguous())
    mod.lora_B = nn.Parameter(torch.zeros(out_local, spec.rank, dtype=w.dtype))
    sharded = mod.lora_B if column else mod.lora_A
    set_tensor_model_parallel_attributes(sharded, True, 0 if column else 1, 1)
    for attr in ("allreduce",):  # expert parameters: reduced over the expert data-parallel group
        if hasattr(w, attr):
            setattr(mod.lora_A, attr, getattr(w, attr))
            setattr(mod.lora_B, attr, getattr(w, attr))
    mod.lora_scale_value = spec.scale
    # the scale is in the checkpoint too (the offline merger reads it), as a tensor
    mod.register_buffer("lora_scale", torch.tensor(spec.scale, dtype=torch.float32))
    mod.lora_column = column
    mod.lora_enabled = True
    _wrap_forward(mod)
    swiglu = (
        column
        and name.endswith("linear_fc1.weight")
        and bool(getattr(mod.config, "gated_linear_unit", False))
    )
    _wrap_sharded_state_dict(mod, column, swiglu)


def delta(mod: nn.Module) -> torch.Tensor:
    """s * B @ A on this rank's shard (the replicated factor's backward sums over the TP group)."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    a, b = mod.lora_A, mod.lora_B
    if mod.lora_column:
        a = copy_to_tensor_model_parallel_region(a, group=mod.tp_group)
    else:
        b = copy_to_tensor_model_parallel_region(b, group=mod.tp_group)
    return (b @ a) * mod.lora_scale_value


def _wrap_forward(mod: nn.Module) -> None:
    base_forward = mod.forward

    def forward(*args: Any, **kwargs: Any):
        if not mod.lora_enabled:
            return base_forward(*args, **kwargs)
        base = mod._parameters["weight"]
        mod._parameters["weight"] = base + delta(mod)  # read by the layer as self.weight
        try:
            return base_forward(*args, **kwargs)
        finally:
            mod._parameters["weight"] = base

    mod.forward = forward


def _wrap_sharded_state_dict(mod: nn.Module, column: bool, swiglu: bool) -> None:
    """Distributed checkpoints: the sharded factor is cut along the weight's TP dimension; a gated
    MLP's fc1 B as megatron-core saves fc1 itself ([gate; up] of the whole layer, whatever the TP size)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        state = mod.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets)
        if swiglu:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            key = f"{prefix}lora_B"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out

    mod.sharded_state_dict = sharded_state_dict


def adapted(chunks: list[nn.Module]) -> Iterator[nn.Module]:
    for chunk in chunks:
        for mod in chunk.modules():
            if hasattr(mod, "lora_A"):
                yield mod


def has_lora(chunks: list[nn.Module]) -> bool:
    return next(adapted(chunks), None) is not None


@contextlib.contextmanager
def disabled(chunks: list[nn.Module]):
    """The base model (adapters off) inside the context."""
    mods = list(adapted(chunks))
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_enabled = True


def export_params(chunk: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`chunk.named_parameters()` as the HF export and the weight sync see them: each adapted
    weight merged (W + s B A, this rank's shard), the factors left out."""
    merged = {}
    for name, mod in chunk.named_modules():
        if hasattr(mod, "lora_A"):
            with torch.no_grad():
                merged[f"{name}.weight" if name else "weight"] = (mod.weight + delta(mod)).detach()
    for name, p in chunk.named_parameters():
        if name.endswith((".lora_A", ".lora_B")):
            continue
        yield name, merged.get(name, p.detach())
