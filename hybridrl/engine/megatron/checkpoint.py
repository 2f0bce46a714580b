"""Checkpoints of a MegatronEngine with Megatron's dist_checkpointing (resharding), and HF export.

Layout of a checkpoint directory `<path>` (written to `<path>.tmp`, renamed when all ranks are
done, as the FSDP checkpoints: an interrupted save never leaves a half-written `<path>`):
    dist/                  dist_checkpointing of model (+ optimizer) sharded state dicts
    extra_state_rank{r}.pt lr schedule + RNG states of rank r + the caller's extra
    huggingface/           full model as a Hugging Face folder (contents 'hf_model')
    meta.json              global step, contents, world size, parallel sizes, role

The model and optimizer are saved as global (sharded) tensors, so a checkpoint saved at one
TP/PP/DP/EP layout loads at another (e.g. TP=2 -> TP=1, EP=2 -> EP=1). The optimizer is saved with
`fully_reshardable` for Megatron's distributed optimizer (reshardable). Loading
Megatron's distributed optimizer gives every parameter the same `step` tensor object, so one
Adam step would advance all of them N times: each `step` is cloned after the load.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.engine.extra_state import load_extra_state, save_extra_state
from hybridrl.engine.megatron.cpu_shims import cuda_to_cpu
from hybridrl.utils.checkpointing import replace_dir

__all__ = ["export_hf_folder", "load_checkpoint", "load_dist_weights", "save_checkpoint"]

DEFAULT_CONTENTS = ("model", "optimizer", "extra")
KNOWN_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# gloo gathers (the default path moves buffers to CUDA for nccl)
_OPT_META = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    # MoE: Megatron chains a dense and an expert optimizer, and how many it chains depends on the
    # expert-parallel size; state keys without the 'chained_<i>.' prefix load at any EP size
    "chained_optim_avoid_prefix": True,
}


def _contents(contents) -> set[str]:
    chosen = set(DEFAULT_CONTENTS if contents is None else contents)
    unknown = chosen - set(KNOWN_CONTENTS)
    if unknown:
        raise ValueError(f"unknown checkpoint contents {sorted(unknown)}; use a subset of {KNOWN_CONTENTS}")
    return chosen


def _inner(chunk):
    return getattr(chunk, "module", chunk)  # DDP's own sharded_state_dict adds a 'module.' prefix


def _chunk_sharded(chunk) -> dict[str, Any]:
    """A chunk's sharded state dict. The metadata is megatron-core's default, spelt out: GPTModel reads
    metadata['dp_cp_group'] itself for the last stage's embedding copy of an MTP model under PP."""
    from megatron.core import parallel_state as ps

    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    return _inner(chunk).sharded_state_dict(metadata=meta)


def _model_sharded(engine) -> dict[str, Any]:
    chunks = engine.chunks
    if len(chunks) == 1:
        return {"model": _chunk_sharded(chunks[0])}
    return {f"model{i}": _chunk_sharded(c) for i, c in enumerate(chunks)}


def _sharded(engine, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
    sd = _model_sharded(engine)
    if with_optimizer:
        model_sd = {k: v for k, v in sd.items()}
        sd["optimizer"] = engine.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_OPT_META
        )
    return sd


def save_checkpoint(engine, path: str, *, contents=None, global_step: int | None = None, extra=None) -> None:
    """Write model (+ optimizer, lr schedule, RNG) of `engine` to `path`, atomically (a collective)."""
    from megatron.core import dist_checkpointing

    chosen = _contents(contents)
    with_opt = "optimizer" in chosen and engine.optimizer is not None
    path = os.path.abspath(path.rstrip("/"))
    tmp = path + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "dist"))
    dist.barrier()
    if "model" in chosen or with_opt:
        sd = _sharded(engine, with_opt, is_loading=False)
        if "model" not in chosen:
            sd = {"optimizer": sd["optimizer"]}
        with cuda_to_cpu():
            dist_checkpointing.save(sd, os.path.join(tmp, "dist"))
    if "extra" in chosen:
        save_extra_state(tmp, rank, engine.lr_scheduler, extra)
    if "hf_model" in chosen:
        export_hf_folder(engine, os.path.join(tmp, "huggingface"))
    dist.barrier()
    if rank == 0:
        m = engine.megatron_config
        meta = {
            "global_step": global_step,
            "contents": sorted(chosen if with_opt else chosen - {"optimizer"}),
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": m.tensor_model_parallel_size,
            "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
            "expert_model_parallel_size": m.expert_model_parallel_size,
            "role": engine.role,
            "backend": "megatron",
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        replace_dir(tmp, path)  # fsync of every file and folder, then the rename
    dist.barrier()


def _untie_steps(optimizer) -> None:
    """Give each parameter its own Adam `step` tensor (the load shares one object between all)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _tolerate_missing_step(optimizer) -> None:
    """Work around megatron-core 0.16 loading torch AdamW state (no Apex / Transformer Engine).

    The reshardable optimizer checkpoint holds each parameter's moments, not its `step` (that is
    restored from the param groups), but `_set_main_param_and_optimizer_states` copies every key
    of the live state, `step` included, from the loaded tensors: keys the checkpoint lacks are
    left to the rest of the load instead.
    """
    for sub in optimizer.chained_optimizers:
        setter = getattr(sub, "_set_main_param_and_optimizer_states", None)
        if setter is None or getattr(setter, "_hybridrl_tolerant", False):
            continue

        def tolerant(model_param, tensors, _sub=sub, _orig=setter):
            group_index, group_order = _sub.model_param_group_index_map[model_param]
            main_param = _sub.optimizer.param_groups[group_index]["params"][group_order]
            live = {"param": main_param, **_sub.optimizer.state[main_param]}
            filled = (
                {k: tensors.get(k, v) for k, v in live.items()}
                if not _sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                else tensors
            )
            return _orig(model_param, filled)

        tolerant._hybridrl_tolerant = True
        sub._set_main_param_and_optimizer_states = tolerant


def _ensure_optimizer_state(engine) -> None:
    """Give a never-stepped optimizer its Adam state before a load (Megatron loads into existing state).

    One step with zero gradients and lr 0 creates exactly the state a real step leaves (moments,
    per-parameter `step`) without changing a weight; the load then overwrites all of it.
    """
    opt = engine.optimizer
    if all(getattr(sub, "optimizer", None) is None or sub.optimizer.state for sub in opt.chained_optimizers):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    for chunk in engine.chunks:
        chunk.zero_grad_buffer()
    for g in opt.param_groups:
        g["lr"] = 0.0
    with cuda_to_cpu():
        opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    engine.zero_grad()


def _read_meta(path: str) -> dict[str, Any]:
    meta_file = os.path.join(path, "meta.json")
    if not os.path.exists(meta_file):
        raise FileNotFoundError(
            f"no checkpoint at {path} (meta.json missing); point resume at a directory written by save_checkpoint"
        )
    with open(meta_file) as f:
        return json.load(f)


def load_checkpoint(engine, path: str, *, contents=None) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote (any TP/PP layout for model and optimizer; a collective)."""
    from megatron.core import dist_checkpointing

    chosen = _contents(contents) - {"hf_model"}
    path = os.path.abspath(path.rstrip("/"))
    meta = _read_meta(path)
    with_opt = "optimizer" in chosen and engine.optimizer is not None
    missing = (chosen - {"optimizer"} | ({"optimizer"} if with_opt else set())) - set(meta["contents"])
    if missing:
        raise ValueError(
            f"checkpoint {path} does not hold {sorted(missing)} (it has {meta['contents']}); "
            "drop them from checkpoint.load_contents"
        )
    if with_opt:
        _ensure_optimizer_state(engine)
        _tolerate_missing_step(engine.optimizer)
    if "model" in chosen or with_opt:
        sd = _sharded(engine, with_opt, is_loading=True)
        if "model" not in chosen:
            sd = {"optimizer": sd["optimizer"]}
        with cuda_to_cpu(), torch.no_grad():
            loaded = dist_checkpointing.load(sd, os.path.join(path, "dist"))
            if "model" in chosen:
                for i, chunk in enumerate(engine.chunks):
                    _inner(chunk).load_state_dict(loaded["model" if len(engine.chunks) == 1 else f"model{i}"])
            if with_opt:
                engine.optimizer.load_state_dict(loaded["optimizer"])
                _untie_steps(engine.optimizer)
    extra = None
    if "extra" in chosen:
        extra = load_extra_state(path, dist.get_rank(), engine.lr_scheduler, meta["world_size"])
    dist.barrier()
    return {"global_step": meta.get("global_step"), "extra": extra}


def load_dist_weights(chunks: list[Any], path: str) -> None:
    """Initial weights from a Megatron dist checkpoint folder (`megatron.dist_checkpointing_path`).

    Accepts a hybridrl checkpoint (its `dist/` sub-folder) or a plain dist_checkpointing folder
    whose model state dict is saved under 'model' (veRL's layout).
    """
    from megatron.core import dist_checkpointing

    folder = os.path.join(path, "dist") if os.path.isdir(os.path.join(path, "dist")) else path
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"megatron.dist_checkpointing_path={path!r}: no such folder")
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    sd = {k: _chunk_sharded(c) for k, c in zip(keys, chunks)}
    with cuda_to_cpu(), torch.no_grad():
        loaded = dist_checkpointing.load(sd, folder)
        for k, c in zip(keys, chunks):
            _inner(c).load_state_dict(loaded[k])


def export_hf_folder(engine, out_dir: str) -> None:
    """Save the full model as a Hugging Face folder on rank 0 (a collective: call on every rank)."""
    from hybridrl.models.hf import build_hf_model

    full = dict(engine.iter_full_params(device="cpu"))
    if dist.get_rank() == 0:
        import dataclasses

        cfg = dataclasses.replace(engine.model_config, init_from_scratch=True, lora_rank=0)
        model = build_hf_model(cfg, role=engine.role if engine.role != "ref" else "actor", key="export")
        missing, unexpected = model.load_state_dict(full, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and engine.spec.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"HF export: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        if engine.tokenizer is not None:
            engine.tokenizer.save_pretrained(out_dir)
    dist.barrier()
