"""The FSDP2 training engine: build a Hugging Face model, shard it, offload it, sync its weights.

Roles and the model class each builds (all from `model.path`, a local Hugging Face folder, a
hub id or 'builtin:tiny'):
    actor / ref   AutoModelForCausalLM
    critic        AutoModelForTokenClassification, num_labels=1: a linear value head on every
                  position of the backbone (the backbone weights load from a causal-LM
                  checkpoint; the head starts fresh). Classifier dropout is set to 0.
    reward        AutoModelForSequenceClassification, num_labels=1 (scores are read per token by
                  `engine.forward.forward_scores`, so padding conventions do not matter).

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
import importlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.utils.device import get_device_name, get_torch_device
from hybridrl.utils.torch_utils import str_to_dtype
from hybridrl.workers.config import FSDPConfig, ModelConfig, OptimConfig
from hybridrl.workers.engine.checkpoint import load_checkpoint, save_checkpoint
from hybridrl.workers.engine.full_params import GATHER_BUCKET_BYTES, iter_full_params

logger = logging.getLogger(__name__)

ROLES = ("actor", "ref", "critic", "reward")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)

__all__ = [
    "FSDPEngine",
    "apply_fsdp2",
    "build_hf_model",
    "clip_grad_norm",
    "create_device_mesh",
    "default_attn_implementation",
    "iter_full_params",
    "load_hf_config",
    "load_tokenizer",
    "offload_fsdp_model_to_cpu",
    "load_fsdp_model_to_device",
    "offload_optimizer",
    "load_optimizer",
    "resolve_reshard_after_forward",
]


# ----------------------------------------------------------------------------------------------
# Hugging Face model loading
# ----------------------------------------------------------------------------------------------
def import_external_libs(external_lib: str | None) -> None:
    """Import `external_lib` (a module that registers models/tokenizers with transformers)."""
    if not external_lib:
        return
    try:
        importlib.import_module(external_lib)
    except ImportError as e:
        raise ImportError(
            f"model.external_lib={external_lib!r} could not be imported ({e}); install it or fix the name"
        ) from e


def resolve_model_path(path: str | None, key: str) -> str:
    """Map 'builtin:tiny' to the shipped folder and check that a local path exists."""
    if not path:
        raise ValueError(f"{key} is not set; point it at a Hugging Face model folder or 'builtin:tiny'")
    try:
        from hybridrl.models.builtin import resolve_model_path as resolve
    except ImportError:  # the models package is optional for this module
        resolve = None
    if resolve is not None:
        return resolve(path, key=key)
    expanded = os.path.expanduser(path)
    if not os.path.exists(expanded):
        raise FileNotFoundError(
            f"{key}={path!r}: no such model folder; point it at a Hugging Face model folder"
        )
    return expanded


def load_hf_config(model_config: ModelConfig, role: str = "actor", key: str = "actor_rollout_ref.model"):
    """The Hugging Face config of `model_config.path` with `override_config` applied.

    Critic / reward configs get num_labels=1; the critic's classifier dropout is set to 0.
    """
    from transformers import AutoConfig

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    import_external_libs(model_config.external_lib)
    path = resolve_model_path(model_config.path, f"{key}.path")
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    if role in ("critic", "reward"):
        hf_config.num_labels = 1
    if role == "critic":
        hf_config.classifier_dropout = 0.0
    overrides = dict(model_config.override_config or {})
    attn = overrides.pop("attn_implementation", None)
    overrides.pop("model_config", None)
    overrides.pop("moe_config", None)
    for name, value in overrides.items():
        if not hasattr(hf_config, name):
            raise ValueError(
                f"{key}.override_config.{name}: the {type(hf_config).__name__} has no attribute {name!r}; "
                "remove it or check the spelling"
            )
        setattr(hf_config, name, value)
    if attn is not None:
        hf_config._attn_implementation = attn
    return hf_config


def load_tokenizer(model_config: ModelConfig, key: str = "actor_rollout_ref.model"):
    """The tokenizer of `tokenizer_path` (default: `path`), with a pad token (eos when missing)."""
    from transformers import AutoTokenizer

    import_external_libs(model_config.external_lib)
    path = model_config.tokenizer_path or model_config.path
    path_key = f"{key}.tokenizer_path" if model_config.tokenizer_path else f"{key}.path"
    path = resolve_model_path(path, path_key)
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # recent transformers would build an empty tokenizer from a folder without one
        raise FileNotFoundError(f"{path_key}={path!r} holds no tokenizer files; set {key}.tokenizer_path")
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    if model_config.custom_chat_template:
        tok.chat_template = model_config.custom_chat_template
    return tok


def _auto_class(role: str):
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    return {
        "actor": AutoModelForCausalLM,
        "ref": AutoModelForCausalLM,
        "critic": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }[role]


def _dtype_kwarg() -> str:
    """transformers >= 4.56 calls the load dtype `dtype`; older versions `torch_dtype`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def build_hf_model(
    model_config: ModelConfig,
    *,
    role: str = "actor",
    dtype: torch.dtype | str = torch.float32,
    key: str = "actor_rollout_ref.model",
    default_attn: str | None = None,
) -> nn.Module:
    """Build the role's Hugging Face model on CPU in `dtype` (weights from `path`, or random).

    Applies gradient checkpointing (non-reentrant) and LoRA (peft) when configured. The model is
    in train mode with `use_cache` off. `default_attn` is the attention implementation used when
    `override_config` names none (None: transformers' default).
    """
    model_config.validate(key)
    hf_config = load_hf_config(model_config, role, key)
    dtype = str_to_dtype(dtype)
    cls = _auto_class(role)
    attn = getattr(hf_config, "_attn_implementation", None) or default_attn
    kwargs: dict[str, Any] = {"trust_remote_code": model_config.trust_remote_code}
    if attn:
        kwargs["attn_implementation"] = attn
    kwargs[_dtype_kwarg()] = dtype
    if model_config.init_from_scratch:
        model = cls.from_config(hf_config, **kwargs)
    else:
        path = resolve_model_path(model_config.path, f"{key}.path")
        model = cls.from_pretrained(path, config=hf_config, **kwargs)
    model = model.to(dtype)
    model.config.use_cache = False
    if model_config.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_config.enable_activation_offload and role in ("actor", "critic"):
        from hybridrl.workers.engine.activation_offload import enable_activation_offload

        enable_activation_offload(model)
    if model_config.lora_rank > 0 or model_config.lora_adapter_path:
        model = _apply_lora(model, model_config, role)
    if role in ("ref", "reward"):
        model.requires_grad_(False)
    model.train(role in ("actor", "critic"))
    return model


def _apply_lora(model: nn.Module, model_config: ModelConfig, role: str) -> nn.Module:
    """Wrap `model` with a new LoRA adapter, or load the trained one at `lora_adapter_path`
    (veRL's key; trainable for the actor/critic, frozen for the ref)."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    if model_config.enable_gradient_checkpointing:
        model.enable_input_require_grads()
    if model_config.lora_adapter_path:
        return PeftModel.from_pretrained(
            model, model_config.lora_adapter_path, is_trainable=role in ("actor", "critic")
        )
    task = TaskType.CAUSAL_LM if role in ("actor", "ref") else TaskType.TOKEN_CLS
    target = model_config.target_modules
    target = list(target) if isinstance(target, (list, tuple)) else target
    lora = LoraConfig(
        task_type=task,
        r=model_config.lora_rank,
        lora_alpha=model_config.lora_alpha,
        target_modules=target,
        bias="none",
    )
    return get_peft_model(model, lora)


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def default_attn_implementation(
    model_config: ModelConfig, fsdp_config: FSDPConfig, role: str, device_type: str | None = None
) -> str | None:
    """'eager' for a trained role (actor, critic) computing in bf16/fp16 on CPU, else None.

    On CPU PyTorch's bf16 SDPA backward is several times slower than fp32's for short sequences;
    eager attention cut the 30M model's bf16 update by ~16% (docs/performance.md). An
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


def clip_grad_norm(module: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to `max_norm` (<= 0: only measure) and return the norm.

    Works on sharded (DTensor) gradients; the norm is the one of the full, un-sharded gradient.
    A non-finite norm is returned as is and the gradients are left unscaled (the caller skips
    the optimizer step).
    """
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
    value = float((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
    if max_norm and max_norm > 0 and math.isfinite(value):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return value


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
@dataclass
class FSDPEngine:
    """An FSDP2-sharded model of one role, with its optimizer and lr scheduler (None for ref/reward).

    Build it with `FSDPEngine.build(...)` on every rank after `init_process_group`. With
    `param_offload` / `optimizer_offload` the engine starts offloaded: call `onload()` before
    each role call and `offload()` after it (both are no-ops on CPU).
    """

    module: nn.Module
    hf_config: Any
    mesh: Any
    fsdp_config: FSDPConfig
    model_config: ModelConfig
    role: str
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    tokenizer: Any = None

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
    ) -> FSDPEngine:
        """Build, shard and (if configured) offload the model of `role`; optimizer for actor/critic.

        Args:
            mesh: device mesh to shard over (default: all ranks, see `create_device_mesh`).
            key / optim_key: config paths named in error messages.
            load_tok: also load the tokenizer (None when the folder has none).
        """
        from hybridrl.workers.engine.optim import build_lr_scheduler, build_optimizer

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
        apply_fsdp2(module, mesh, fsdp_config)
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

    @property
    def dp_size(self) -> int:
        return int(math.prod(self.mesh.shape))

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

    def save_checkpoint(self, path: str, contents=None, global_step: int | None = None, extra=None) -> None:
        save_checkpoint(
            path,
            self.module,
            self.optimizer,
            self.lr_scheduler,
            contents=contents,
            tokenizer=self.tokenizer,
            global_step=global_step,
            extra=extra,
        )

    def load_checkpoint(self, path: str, contents=None) -> dict[str, Any]:
        return load_checkpoint(path, self.module, self.optimizer, self.lr_scheduler, contents=contents)
