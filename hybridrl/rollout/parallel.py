"""Rollout tensor parallelism inside the colocated workers: meshes, checks, core binding, loaders.

* Meshes: `workers/parallel_dims.ParallelDims` builds them (the rollout mesh is
  ``{"dp": world / tp, "tp": tp}`` with tp innermost, the grouping vLLM's ``external_launcher``
  uses: ranks ``[k*tp, (k+1)*tp)`` form engine k).
* :func:`validate_rollout_parallel`: TP must divide the ranks and the model's attention and KV
  heads, and the engine must support TP (``hf`` does not); checked on the driver before Ray
  starts, messages name the numbers and the fix.
* :func:`bind_cpu_cores`: on CPU, each rank of a TP engine is pinned to its own cores (vLLM's
  CPU ranks spin in OpenMP; two ranks on one core stall each other), and
  ``VLLM_CPU_OMP_THREADS_BIND`` is set to that rank's list.
* :func:`weight_loader_for`: which gather a weight sync uses, from ``load_format`` as veRL
  documents it (``dummy_dtensor`` / ``dtensor`` / real formats: bucketed DTensor gather;
  ``dummy_hf`` / ``hf``: a full HF state dict; ``dummy_megatron``: the Megatron engine's own).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

__all__ = [
    "TP_ENGINES",
    "bind_cpu_cores",
    "check_same_rows",
    "validate_rollout_parallel",
    "weight_loader_for",
]

TP_ENGINES = ("vllm", "sglang")
KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


def validate_rollout_parallel(
    tp: int,
    world_size: int,
    engine: str,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
) -> None:
    """Raise ValueError (naming the numbers and the fix) if ``tp`` cannot run on this setup.

    Args:
        tp: rollout.tensor_model_parallel_size.
        world_size: ranks of the colocated worker group (nnodes * n_gpus_per_node).
        engine: rollout.name.
        num_attention_heads / num_key_value_heads: from the model's config (None: not checked).
    """
    if tp < 1:
        raise ValueError(f"{KEY}={tp}: use an integer >= 1")
    if tp == 1:
        return
    if engine not in TP_ENGINES:
        raise ValueError(
            f"{KEY}={tp} with actor_rollout_ref.rollout.name={engine}: the {engine} engine generates with one "
            f"rank per model copy; use rollout.name=vllm (or sglang on GPUs) for tensor parallelism, or set {KEY}=1"
        )
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"{KEY}={tp} does not divide the {world_size} ranks (trainer.nnodes * trainer.n_gpus_per_node): "
            f"world / TP engines must be whole; use one of {divisors}"
        )
    for what, heads in (("attention heads", num_attention_heads), ("KV heads", num_key_value_heads)):
        if heads is not None and heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0 and world_size % d == 0]
            raise ValueError(
                f"{KEY}={tp} does not divide the model's {heads} {what} (each TP rank holds heads / TP of "
                f"them); use one of {divisors}"
            )


def model_heads(hf_config: Any) -> tuple[int, int]:
    """(attention heads, KV heads) of an HF config (its text config for multimodal models)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    return heads, int(getattr(text, "num_key_value_heads", None) or heads)


def bind_cpu_cores(local_rank: int, local_world_size: int, threads: int) -> list[int]:
    """Pin this process to its own ``threads`` cores of the allowed set (on CPU only).

    Rank r of the node takes cores ``[r * threads, (r + 1) * threads)`` of the sorted allowed
    set; when the node has fewer cores than ranks x threads, they wrap around. Sets
    ``VLLM_CPU_OMP_THREADS_BIND`` to the chosen list (vLLM's name for the same thing).

    Returns:
        the cores this process is bound to.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) >= local_world_size * threads:
        cores = allowed[local_rank * threads : (local_rank + 1) * threads]
    else:
        cores = [allowed[(local_rank * threads + i) % len(allowed)] for i in range(threads)]
    os.sched_setaffinity(0, cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    return cores


def _rows_digest(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    h = hashlib.sha256()
    h.update(str(tuple(input_ids.shape)).encode())
    h.update((input_ids * attention_mask).cpu().contiguous().numpy().tobytes())
    return torch.tensor(list(h.digest()[:8]), dtype=torch.int64)


def check_same_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, group: Any, what: str) -> None:
    """Fail (instead of hanging or generating garbage) when the ranks of one TP engine were given
    different prompts: one small all-gather of a digest over ``group``."""
    import torch.distributed as dist

    mine = _rows_digest(input_ids, attention_mask)
    all_digests = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(all_digests, mine, group=group)
    if any(not torch.equal(d, mine) for d in all_digests):
        raise RuntimeError(
            f"{what}: the ranks of one tensor-parallel engine received different prompts; dispatch it over the "
            'rollout mesh (register(dispatch_mode=make_mesh_dispatch("rollout")))'
        )


# load formats that name a weight loader (veRL's meanings); "hf" does only where the engine feeds it
_FORMAT_LOADER = {
    "dummy_megatron": "megatron",
    "dummy_dtensor": "dtensor",
    "dtensor": "dtensor",
    "dummy_hf": "hf",
}
_LOADER_WORDS = {
    "megatron": "syncs from a Megatron actor",
    "dtensor": "is an FSDP loader",
    "hf": "is an FSDP loader",
}
_LOADER_FORMAT = {"megatron": "dummy_megatron", "dtensor": "dummy_dtensor", "hf": "dummy_hf"}


def weight_loader_for(load_format: str, strategy: str = "fsdp") -> str:
    """The gather a weight sync uses: "dtensor", "hf" or "megatron" (veRL's load_format meanings),
    among the loaders the actor's engine feeds (`TrainEngine.weight_loaders`, its own first).

    Raises:
        ValueError: a load format whose loader the engine does not feed (dummy_megatron with an FSDP
            actor, dtensor/hf formats with a Megatron one).
    """
    from hybridrl.engine.base import get_engine

    loaders = get_engine(strategy, "actor_rollout_ref.actor.strategy").engine_cls.weight_loaders
    wanted = _FORMAT_LOADER.get(load_format)
    if load_format == "hf" and "hf" in loaders:
        wanted = "hf"
    if wanted is None:
        return loaders[0]
    if wanted not in loaders:
        fixes = " (or ".join(_LOADER_FORMAT.get(x, x) for x in loaders) + ")" * (len(loaders) - 1)
        raise ValueError(
            f"actor_rollout_ref.rollout.load_format={load_format} {_LOADER_WORDS.get(wanted, 'names the ' + wanted + ' loader')}, "
            f"but actor.strategy={strategy}, whose engine feeds {list(loaders)}; use load_format={fixes} "
            "(or auto to load the checkpoint first)"
        )
    return wanted


def heads_of_model_path(
    model_path: str | None, trust_remote_code: bool = False
) -> tuple[int | None, int | None]:
    """Heads from the model's config when it can be read here (a local folder or a cached hub id)."""
    from hybridrl.models.builtin import resolve_model_path

    if not model_path:
        return None, None
    try:
        from transformers import AutoConfig

        path = resolve_model_path(model_path)
        return model_heads(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    except (OSError, ValueError, KeyError, AttributeError):
        return None, None  # unreadable here: the engine checks the heads itself when it starts


def check_rollout_parallel_config(
    *,
    tp: int,
    world_size: int,
    engine: str,
    load_format: str,
    strategy: str,
    model_path: str | None,
    trust_remote_code: bool = False,
) -> None:
    """The driver's start-up check of the rollout's parallel layout (before Ray starts).

    Raises:
        ValueError: from :func:`validate_rollout_parallel` or :func:`weight_loader_for`.
    """
    heads, kv_heads = heads_of_model_path(model_path, trust_remote_code) if tp > 1 else (None, None)
    validate_rollout_parallel(tp, world_size, engine, heads, kv_heads)
    weight_loader_for(load_format, strategy)
