"""The FSDP2 training engine (`model_engine=dp`, `strategy=fsdp`): a Hugging Face model of one role
(models/hf.build_hf_model), sharded, offloaded between calls; compute, weights and checkpoints are
`ModuleEngine`'s (engine/module_engine.py).

Sharding: `fully_shard` on every decoder layer (the model's `_no_split_modules`, or
`wrap_policy.transformer_layer_cls_to_wrap`), then on the root, over a 1-D mesh of all ranks;
0 < fsdp_size < world gives a 2-D (replicate, shard) mesh (hybrid sharding). Every rank loads
the full checkpoint on CPU before sharding (simple and fine for models that fit in host memory).
On CPU the defaults favour speed: eager attention for bf16/fp16 training
(`default_attn_implementation`) and no resharding after forward when each shard group is one rank
(`resolve_reshard_after_forward`). Full parameters for weight sync and export come from
`full_params.iter_full_params` (a bucket of parameters per all-gather).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.config.roles import FSDPConfig, ModelConfig, OptimConfig
from hybridrl.cpu.train_linear import install_onednn_linear, resolve_onednn_linear
from hybridrl.engine.base import EngineBuildSpec, register_engine
from hybridrl.engine.batching import clip_grad_norm
from hybridrl.engine.full_params import GATHER_BUCKET_BYTES, iter_full_params
from hybridrl.engine.module_engine import ModuleEngine
from hybridrl.models.hf import build_hf_model, load_tokenizer
from hybridrl.utils.device import get_device_name, get_torch_device
from hybridrl.utils.torch_utils import str_to_dtype

logger = logging.getLogger(__name__)

__all__ = [
    "FSDPEngine",
    "apply_fsdp2",
    "clip_grad_norm",
    "create_device_mesh",
    "default_attn_implementation",
    "iter_full_params",
    "offload_fsdp_model_to_cpu",
    "load_fsdp_model_to_device",
    "offload_optimizer",
    "load_optimizer",
    "resolve_reshard_after_forward",
    "resolve_shard_one_rank",
    "compile_decoder_layers",
]


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def default_attn_implementation(
    model_config: ModelConfig, fsdp_config: FSDPConfig, role: str, device_type: str | None = None
) -> str | None:
    """'eager' for a trained role (actor, critic) computing in bf16/fp16 on CPU, else None.

    On CPU PyTorch's bf16 SDPA backward is several times slower than fp32's for short sequences;
    eager attention makes a bf16 update faster there (`bench/mfu.py --dtype bf16 --attn eager`). An
    `override_config.attn_implementation` set by the user always wins.
    """
    if role not in ("actor", "critic") or "attn_implementation" in (model_config.override_config or {}):
        return None
    if (device_type or get_device_name()) != "cpu":
        return None
    if str_to_dtype(fsdp_config.mixed_precision.param_dtype) not in (torch.bfloat16, torch.float16):
        return None
    _log_once(
        "attn_implementation=eager for the trained model (bf16/fp16 compute on CPU, where SDPA's "
        "backward is slow); set model.override_config.attn_implementation to choose another"
    )
    return "eager"


# ----------------------------------------------------------------------------------------------
# sharding
# ----------------------------------------------------------------------------------------------
def create_device_mesh(world_size: int | None = None, fsdp_size: int = -1, device_type: str | None = None):
    """1-D ('fsdp',) mesh over all ranks, or 2-D ('ddp', 'fsdp') when 0 < fsdp_size < world_size."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = world_size or dist.get_world_size()
    device_type = device_type or get_device_name()
    if fsdp_size <= 0 or fsdp_size >= world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if world_size % fsdp_size:
        raise ValueError(
            f"fsdp_config.fsdp_size={fsdp_size} must divide the number of ranks ({world_size}); use a divisor or -1"
        )
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def _layer_classes(module: nn.Module, fsdp_config: FSDPConfig) -> set[str]:
    names = fsdp_config.wrap_policy.transformer_layer_cls_to_wrap
    if names:
        return set(names)
    found: set[str] = set()
    for m in module.modules():
        found.update(getattr(m, "_no_split_modules", None) or [])
    return found


def resolve_reshard_after_forward(fsdp_config: FSDPConfig, mesh) -> bool:
    """`fsdp_config.reshard_after_forward`, or for None (auto): False when each shard group is
    one CPU rank, True otherwise.

    With one rank per shard group resharding frees only the unsharded (param_dtype) copy of each
    layer, which the backward then builds again: on CPU keeping it saves that second cast (with
    eager attention, -23% time for the 30M model's bf16 update). On GPUs auto keeps veRL's True,
    so the unsharded copies do not stay in device memory until the backward.
    """
    if fsdp_config.reshard_after_forward is not None:
        return fsdp_config.reshard_after_forward
    return not (mesh.device_type == "cpu" and mesh.size(mesh.ndim - 1) == 1)


def resolve_shard_one_rank(fsdp_config: FSDPConfig, mesh, key: str = "fsdp_config") -> bool:
    """Whether the model goes through `fully_shard` (True) or stays the plain module (False).

    `fsdp_config.shard_one_rank`: True always shards (veRL's behaviour); False keeps the plain
    module, which needs a one-rank mesh and no cast (param_dtype = reduce_dtype = model_dtype, no
    offload_policy), else it is refused; None (auto) is False when the mesh is one CPU rank, nothing
    is cast and no FSDP-only key (reshard_after_forward, forward_prefetch, offload_policy) is set.

    On one rank FSDP2 shards nothing, but every parameter becomes a DTensor: AdamW and the grad-norm
    clip dispatch through DTensor, and each layer's forward and backward pay the (one-rank)
    all-gather / reduce-scatter hooks. The plain module computes the same numbers (test_fsdp_engine,
    `test_one_rank_plain_module_equals_fsdp2`) and saves the same DCP checkpoints.
    """
    mp = fsdp_config.mixed_precision
    dtypes = {str_to_dtype(d) for d in (fsdp_config.model_dtype, mp.param_dtype, mp.reduce_dtype)}
    choice = fsdp_config.shard_one_rank
    if choice is None:
        fsdp_only = (
            fsdp_config.reshard_after_forward is not None
            or fsdp_config.forward_prefetch
            or fsdp_config.offload_policy
        )
        return not (mesh.device_type == "cpu" and mesh.size() == 1 and len(dtypes) == 1 and not fsdp_only)
    if not choice:
        why = []
        if mesh.size() != 1:
            why.append(f"the shard mesh has {mesh.size()} ranks")
        if len(dtypes) != 1:
            why.append(
                f"model_dtype={fsdp_config.model_dtype}, param_dtype={mp.param_dtype} and "
                f"reduce_dtype={mp.reduce_dtype} differ (the plain module computes in its own dtype)"
            )
        if fsdp_config.offload_policy:
            why.append("offload_policy=true is FSDP2's CPU offload")
        if why:
            raise ValueError(
                f"{key}.shard_one_rank=false keeps the model unsharded, but {'; '.join(why)}: "
                f"set {key}.shard_one_rank=null (auto) or true"
            )
    return bool(choice)


def place_unsharded(module: nn.Module, device_type: str) -> nn.Module:
    """The plain-module path of `resolve_shard_one_rank`: the model moved to this rank's device."""
    if device_type != "cpu":  # written for GPUs, not run on one (only CPU has run this path)
        module.to(get_torch_device())
    _log_once(
        "the model is not wrapped by FSDP2 (one rank, no cast: nothing to shard); "
        "set fsdp_config.shard_one_rank=true to shard it anyway"
    )
    return module


def compile_decoder_layers(module: nn.Module, fsdp_config: FSDPConfig) -> int:
    """`fsdp_config.compile_layers`: `torch.compile` every decoder layer in place; returns how many.

    Called before `fully_shard` (torchtitan's order: each compiled block is then sharded). In place
    (`nn.Module.compile`), so parameter names, state dicts and checkpoints are those of the eager
    model. `dynamic=True`: one graph for every sequence length, where a static graph recompiles
    at each new response length. `bench/compile_layers.py` measures the step against the eager one,
    with the compile time and the steps it takes to earn it back.
    """
    classes = _layer_classes(module, fsdp_config)
    layers = [m for m in module.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(
            f"fsdp_config.compile_layers=true: {type(module).__name__} names no decoder-layer class "
            "(_no_split_modules); set fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[<LayerClass>]"
        )
    for layer in layers:
        layer.compile(dynamic=True)
    _log_once(
        f"fsdp_config.compile_layers: {len(layers)} decoder layers compiled (the first step compiles them)"
    )
    return len(layers)


def apply_fsdp2(module: nn.Module, mesh, fsdp_config: FSDPConfig) -> nn.Module:
    """`fully_shard` every decoder layer, then the root; returns the (same, now sharded) module.

    `mixed_precision.param_dtype` is the compute dtype; gradients are reduced in `reduce_dtype`.
    `offload_policy=True` keeps sharded parameters, gradients and the optimizer step on CPU.
    Resharding after forward follows `resolve_reshard_after_forward`; `forward_prefetch` adds the
    explicit next-layer prefetch (`set_forward_prefetch`).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = fsdp_config.mixed_precision
    mp_policy = MixedPrecisionPolicy(
        param_dtype=str_to_dtype(mp.param_dtype),
        reduce_dtype=str_to_dtype(mp.reduce_dtype),
        cast_forward_inputs=True,
    )
    offload = CPUOffloadPolicy() if fsdp_config.offload_policy else OffloadPolicy()
    reshard = resolve_reshard_after_forward(fsdp_config, mesh)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard)
    classes = _layer_classes(module, fsdp_config)
    if not classes:
        raise ValueError(
            f"{type(module).__name__} names no decoder-layer class (_no_split_modules); set "
            "fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[<LayerClass>]"
        )
    layers = [m for m in module.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"no module of class {sorted(classes)} found in {type(module).__name__} to shard")
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    if fsdp_config.forward_prefetch:
        set_forward_prefetch(layers)
    return module


def set_forward_prefetch(layers: list[nn.Module]) -> None:
    """`fsdp_config.forward_prefetch`: each layer's forward issues the next layer's all-gather.

    FSDP2's explicit prefetch (`set_modules_to_forward_prefetch`): the all-gather of layer i+1 is
    started before layer i computes, so it overlaps with that compute (veRL's FSDP1 key of the
    same name). Numbers are unchanged; only the order of the collectives moves.
    """
    for layer, nxt in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([nxt])


# ----------------------------------------------------------------------------------------------
# offload between calls (GPU only; on CPU the same calls are no-ops)
# ----------------------------------------------------------------------------------------------
def offload_fsdp_model_to_cpu(module: nn.Module) -> None:
    """Move the (sharded) parameters and gradients of `module` to host memory."""
    if next(module.parameters()).device.type == "cpu":
        return
    module.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_fsdp_model_to_device(module: nn.Module, device: torch.device | str | None = None) -> None:
    """Move the parameters of `module` back to the compute device."""
    device = torch.device(device) if device is not None else get_torch_device()
    if next(module.parameters()).device == device:
        return
    module.to(device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != device and v.dim() > 0:
                state[k] = v.to(device, non_blocking=True)


def offload_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """Move the optimizer state (Adam moments) to host memory."""
    if optimizer is None or not optimizer.state:
        return
    _move_optimizer_state(optimizer, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def load_optimizer(optimizer: torch.optim.Optimizer | None, device: torch.device | str | None = None) -> None:
    """Move the optimizer state back to the compute device."""
    if optimizer is None or not optimizer.state:
        return
    _move_optimizer_state(optimizer, torch.device(device) if device is not None else get_torch_device())


# ----------------------------------------------------------------------------------------------
# the engine: model + optimizer + scheduler of one role on one rank
# ----------------------------------------------------------------------------------------------
class FSDPEngine(ModuleEngine):
    """An FSDP2-sharded model of one role, with its optimizer and lr scheduler (None for ref/reward).

    Build it with `FSDPEngine.build(...)` on every rank after `init_process_group` (or
    `FSDPEngine.build_role(...)`, the registry's entry). With `param_offload` /
    `optimizer_offload` the engine starts offloaded: call `onload()` before each role call and
    `offload()` after it (both are no-ops on CPU). Compute, weights and checkpoints are
    `ModuleEngine`'s: FSDP2 gathers each layer inside the forward.
    """

    def __init__(
        self,
        module: nn.Module,
        hf_config: Any,
        mesh: Any,
        fsdp_config: FSDPConfig,
        model_config: ModelConfig,
        role: str,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(
            module,
            optimizer,
            lr_scheduler,
            role=role,
            dp_size=int(math.prod(mesh.shape)),
            use_remove_padding=model_config.use_remove_padding,
            use_fused_kernels=model_config.use_fused_kernels,
            tokenizer=tokenizer,
        )
        self.hf_config, self.mesh = hf_config, mesh
        self.fsdp_config, self.model_config = fsdp_config, model_config

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        fsdp_config: FSDPConfig,
        optim_config: OptimConfig | None = None,
        *,
        role: str = "actor",
        mesh=None,
        key: str = "actor_rollout_ref.model",
        optim_key: str | None = None,
        load_tok: bool = True,
        freeze_vision_tower: bool = False,
    ) -> FSDPEngine:
        """Build, shard and (if configured) offload the model of `role`; optimizer for actor/critic.

        Args:
            mesh: device mesh to shard over (default: all ranks, see `create_device_mesh`).
            key / optim_key: config paths named in error messages.
            load_tok: also load the tokenizer (None when the folder has none).
            freeze_vision_tower: a vision-language model's vision encoder gets no gradients.
        """
        from hybridrl.engine.optim import build_lr_scheduler, build_optimizer

        if not dist.is_initialized():
            raise RuntimeError(
                "FSDPEngine.build needs torch.distributed: call hybridrl.utils.device.init_process_group first"
            )
        mesh = mesh or create_device_mesh(dist.get_world_size(), fsdp_config.fsdp_size)
        attn = default_attn_implementation(model_config, fsdp_config, role, mesh.device_type)
        module = build_hf_model(
            model_config, role=role, dtype=fsdp_config.model_dtype, key=key, default_attn=attn
        )
        hf_config = module.config
        if freeze_vision_tower:
            from hybridrl.models.vlm import freeze_vision_tower as freeze

            freeze(module, "actor_rollout_ref.actor.freeze_vision_tower")
        if resolve_onednn_linear(fsdp_config.onednn_linear, mesh.device_type, f"the {role}'s fsdp_config"):
            install_onednn_linear(module)  # before compile: a compiled layer lowers F.linear itself
        if fsdp_config.compile_layers:
            compile_decoder_layers(module, fsdp_config)
        if resolve_shard_one_rank(fsdp_config, mesh, f"the {role}'s fsdp_config"):
            apply_fsdp2(module, mesh, fsdp_config)
        else:
            place_unsharded(module, mesh.device_type)
        optimizer = lr_scheduler = None
        if optim_config is not None and role in ("actor", "critic"):
            optim_key = optim_key or ("critic.optim" if role == "critic" else "actor_rollout_ref.actor.optim")
            optimizer = build_optimizer(module, optim_config)
            lr_scheduler = build_lr_scheduler(optimizer, optim_config, key=optim_key)
        tokenizer = None
        if load_tok:
            with contextlib.suppress(OSError, ValueError):
                tokenizer = load_tokenizer(model_config, key)
        engine = cls(
            module, hf_config, mesh, fsdp_config, model_config, role, optimizer, lr_scheduler, tokenizer
        )
        engine.offload()
        return engine

    @classmethod
    def build_role(cls, spec: EngineBuildSpec) -> FSDPEngine:
        """The registry's entry: the role's engine from its config sections, Ulysses SP applied."""
        from hybridrl.engine.ulysses import apply_sp

        section = spec.role_config
        if getattr(getattr(section, "megatron", None), "override_optimizer_config", None):
            raise ValueError(
                f"{spec.key}.optim.override_optimizer_config sets fields of Megatron's OptimizerConfig; the FSDP "
                "engine trains with torch's AdamW: drop it or use strategy=megatron"
            )
        fsdp_config = section.fsdp_config if hasattr(section, "fsdp_config") else section.model.fsdp_config
        engine = cls.build(
            spec.model_config, fsdp_config, spec.optim_config, role=spec.role, key=spec.model_key,
            freeze_vision_tower=spec.role == "actor" and getattr(section, "freeze_vision_tower", False),
        )  # fmt: skip
        apply_sp(engine, spec.mesh, spec.rank, spec.key)
        return engine

    # -- offload (no-ops unless the params/optimizer live on an accelerator) ---------------------
    def offload(self) -> None:
        """Move what the config asks to offload to host memory (call after each role call)."""
        if self.fsdp_config.param_offload:
            offload_fsdp_model_to_cpu(self.module)
        if self.fsdp_config.optimizer_offload:
            offload_optimizer(self.optimizer)

    def onload(self, with_optimizer: bool = False) -> None:
        """Bring offloaded parameters (and, if asked, optimizer state) back to the device."""
        if self.fsdp_config.param_offload and not self.fsdp_config.offload_policy:
            load_fsdp_model_to_device(self.module)
        if with_optimizer and self.fsdp_config.optimizer_offload:
            load_optimizer(self.optimizer)

    def iter_full_params(
        self, dtype: torch.dtype | None = None, device=None, bucket_bytes: int = GATHER_BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs, gathered in buckets (a collective), see `iter_full_params`."""
        return iter_full_params(self.module, dtype=dtype, device=device, bucket_bytes=bucket_bytes)


register_engine("dp", FSDPEngine, aliases=("fsdp", "fsdp2"))
