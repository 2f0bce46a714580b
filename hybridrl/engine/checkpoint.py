"""Sharded checkpoints of an FSDP2 model with `torch.distributed.checkpoint`, and HF export.

Layout of a checkpoint directory `<path>`:
    model/                 DCP shards of the model state dict        ('model')
    optimizer/             DCP shards of the optimizer state dict    ('optimizer')
    extra_state_rank{r}.pt lr scheduler + RNG states of rank r        ('extra')
    huggingface/           full model as save_pretrained + tokenizer  ('hf_model')
    lora_adapter/          adapter_config.json of a PEFT LoRA model (with 'model')
    meta.json              global step, contents, world size

Everything is first written to `<path>.tmp`, fsynced and renamed to `<path>` when all ranks are done,
so an interrupted save never leaves a half-written `<path>`. All ranks must see the same
filesystem (a local disk on one machine, or a shared one across machines). Saving and loading
are collectives: call them on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hybridrl.engine.extra_state import load_extra_state, save_extra_state
from hybridrl.engine.full_params import iter_full_params
from hybridrl.utils.checkpointing import replace_dir

DEFAULT_CONTENTS = ("model", "optimizer", "extra")
KNOWN_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# optimizer param-group keys that choose kernels, not values: kept from the running optimizer on load
_IMPL_KEYS = ("fused", "foreach")
HF_DIR = "huggingface"
LORA_DIR = "lora_adapter"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _contents(contents: Iterable[str] | None) -> set[str]:
    chosen = set(DEFAULT_CONTENTS if contents is None else contents)
    unknown = chosen - set(KNOWN_CONTENTS)
    if unknown:
        raise ValueError(f"unknown checkpoint contents {sorted(unknown)}; use a subset of {KNOWN_CONTENTS}")
    return chosen


def save_checkpoint(
    path: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    *,
    contents: Iterable[str] | None = None,
    tokenizer: Any = None,
    global_step: int | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint of `module` (and optimizer, scheduler, RNG) to `path`, atomically.

    Args:
        contents: subset of ('model', 'optimizer', 'extra', 'hf_model'); default the first three.
        tokenizer: saved next to the HF export.
        extra: small per-rank state returned again by `load_checkpoint`: tensors and plain types only
            (str, numbers, None, list, tuple, dict), since it is read with `torch.load(weights_only=True)`.
    """
    chosen = _contents(contents)
    path = os.path.abspath(path.rstrip("/"))
    tmp = path + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if "model" in chosen:
        dcp.save({"model": get_model_state_dict(module)}, checkpoint_id=os.path.join(tmp, "model"))
        if _rank() == 0 and hasattr(module, "peft_config"):  # the merger needs lora_alpha / r
            for name, peft_cfg in module.peft_config.items():
                peft_cfg.save_pretrained(
                    os.path.join(tmp, LORA_DIR if name == "default" else f"{LORA_DIR}_{name}")
                )
    if "optimizer" in chosen and optimizer is not None:
        osd = get_optimizer_state_dict(module, optimizer)
        dcp.save({"optimizer": osd}, checkpoint_id=os.path.join(tmp, "optimizer"))
    if "extra" in chosen:
        save_extra_state(tmp, _rank(), lr_scheduler, extra)
    if "hf_model" in chosen:
        export_hf_model(module, os.path.join(tmp, HF_DIR), tokenizer=tokenizer)
    _barrier()
    if _rank() == 0:
        meta = {
            "global_step": global_step,
            "contents": sorted(chosen if optimizer is not None else chosen - {"optimizer"}),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        replace_dir(tmp, path)  # fsync of every file and folder, then the rename
    _barrier()


def load_checkpoint(
    path: str,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    *,
    contents: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote into an already built (sharded) model/optimizer.

    The number of ranks may differ from the save for 'model' and 'optimizer' (DCP reshards);
    'extra' (per-rank RNG) needs the same number of ranks.

    Returns:
        {'global_step': int | None, 'extra': the `extra` given at save time (this rank's)}.
    """
    chosen = _contents(contents) - {"hf_model"}
    path = os.path.abspath(path.rstrip("/"))
    meta_file = os.path.join(path, "meta.json")
    if not os.path.exists(meta_file):
        raise FileNotFoundError(
            f"no checkpoint at {path} (meta.json missing); point resume at a directory written by save_checkpoint"
        )
    with open(meta_file) as f:
        meta = json.load(f)
    missing = chosen - set(meta["contents"])
    if "optimizer" in missing and optimizer is None:
        missing.discard("optimizer")
    if missing:
        raise ValueError(
            f"checkpoint {path} does not hold {sorted(missing)} (it has {meta['contents']}); "
            "drop them from checkpoint.load_contents"
        )
    if "model" in chosen:
        sd = get_model_state_dict(module)
        state = {"model": sd}
        dcp.load(state, checkpoint_id=os.path.join(path, "model"))
        set_model_state_dict(module, state["model"])
    if "optimizer" in chosen and optimizer is not None:
        # how this run's optimizer executes (fused / foreach kernels) is not training state: a
        # checkpoint written by another build (e.g. before AdamW was fused on CPU) keeps them
        impl = [{k: g[k] for k in _IMPL_KEYS if k in g} for g in optimizer.param_groups]
        osd = get_optimizer_state_dict(module, optimizer)
        state = {"optimizer": osd}
        dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
        set_optimizer_state_dict(module, optimizer, state["optimizer"])
        for group, keep in zip(optimizer.param_groups, impl):
            group.update(keep)
    extra = None
    if "extra" in chosen:
        extra = load_extra_state(path, _rank(), lr_scheduler, meta["world_size"])
    _barrier()
    return {"global_step": meta.get("global_step"), "extra": extra}


# ----------------------------------------------------------------------------------------------
# Hugging Face export
# ----------------------------------------------------------------------------------------------
def _plain_class(model: nn.Module) -> type:
    """The model class before FSDP2 swapped in its FSDP<Class> subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def export_hf_model(module: nn.Module, out_dir: str, tokenizer: Any = None) -> None:
    """Save the full model with `save_pretrained` on rank 0 (a collective: call on every rank).

    LoRA adapters are merged into the base weights, so the folder loads as a plain model.
    """
    full: dict[str, torch.Tensor] = {}
    for name, tensor in iter_full_params(module, device="cpu"):
        if _rank() == 0:
            full[name] = tensor
    if _rank() == 0:
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        cls = _plain_class(base)
        with torch.device("meta"):
            model = cls(base.config)
        model.load_state_dict(full, strict=False, assign=True)
        for name, buf in base.named_buffers():  # non-persistent buffers (e.g. rotary inv_freq)
            owner, _, leaf = name.rpartition(".")
            target = model.get_submodule(owner) if owner else model
            target._buffers[leaf] = buf.detach().to("cpu").clone()
        model.tie_weights()
        leftover = [n for n, p in model.named_parameters() if p.is_meta]
        if leftover:
            raise RuntimeError(f"HF export: parameters without a value {leftover[:5]}")
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        from hybridrl.models.vlm import save_processor_files

        save_processor_files(base.config, out_dir)  # a VLM: its processor files too
    _barrier()
