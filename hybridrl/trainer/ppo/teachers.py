"""The teacher pool of on-policy distillation (veRL's `distillation.*`): driver side.

Each teacher of `distillation.teacher_models` is a reference-policy worker (`ActorRolloutRefWorker`
with role "ref") loaded from the teacher's `model_path`: a forward-only training engine from the
engine registry (`actor_rollout_ref.ref.strategy`: FSDP2 or Megatron), so any student engine
works. With `distillation.nnodes=0` (veRL's colocated mode) the teachers are roles of the actor's
colocated worker, on the actor's slots, offloaded between steps like the reference.

One step (`teacher_step`): rows are routed to teachers by the row's `distillation.teacher_key`
field (the single `teacher_model` takes every row), each teacher computes the log-probs of its
rows' sampled tokens at the rollout temperature, and the batch gets `teacher_log_probs` (B, T)
for the actor's loss (hybridrl/workers/distillation.py). The teachers are never checkpointed;
their paths are recorded in the checkpoint's meta (`teacher_meta`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.utils.metrics import timer
from hybridrl.workers.distillation import TEACHER_LOG_PROBS
from hybridrl.workers.distillation_config import DEFAULT_KEY

ROLE_PREFIX = "teacher_"


def teacher_role_classes(config: Any, actor_cls: type, threads: int | None) -> dict[str, Any]:
    """{"teacher_<i>": RayClassWithInitArgs} of the colocated teachers ({} when disabled)."""
    from hybridrl.single_controller.ray.base import RayClassWithInitArgs

    dist, arr = config.distillation, config.actor_rollout_ref
    if not dist.enabled:
        return {}
    if not dist.colocated:
        raise NotImplementedError(
            f"distillation.nnodes={dist.nnodes}: a separate teacher pool is not implemented yet; set "
            "distillation.nnodes=0 (the teachers share the actor's slots, as veRL's colocated mode)"
        )
    classes = {}
    for i, (_key, t) in enumerate(sorted(dist.teachers().items())):
        model = dataclasses.replace(
            arr.model, path=t.model_path, init_from_scratch=False, lora_rank=0, lora_adapter_path=None
        )
        temperature = t.inference.temperature or arr.rollout.temperature
        classes[f"{ROLE_PREFIX}{i}"] = RayClassWithInitArgs(
            actor_cls,
            model=model,
            ref=arr.ref,
            rollout=dataclasses.replace(arr.rollout, temperature=temperature),
            role="ref",
            num_threads=threads,
            pg_timeout_s=arr.nccl_timeout,
        )
    return classes


def teacher_views(config: Any, views: dict[str, Any]) -> dict[str, Any]:
    """{teacher key: worker-group view} from the spawned role views (same order as the classes)."""
    dist = config.distillation
    if not dist.enabled:
        return {}
    keys = sorted(dist.teachers())
    return {key: views[f"{ROLE_PREFIX}{i}"] for i, key in enumerate(keys)}


def route_rows(batch: DataProto, keys: list[str], teacher_key: str) -> dict[str, np.ndarray]:
    """{teacher key: row indices}: every row to the single default teacher, else by the row's field.

    Raises:
        KeyError: the batch lacks `teacher_key`, or a row's value names no teacher.
    """
    if keys == [DEFAULT_KEY]:
        return {DEFAULT_KEY: np.arange(len(batch))}
    if teacher_key not in batch.non_tensor_batch:
        raise KeyError(
            f"distillation.teacher_key={teacher_key!r} is not a field of the batch (it has "
            f"{sorted(batch.non_tensor_batch)}): set it to the field that names each row's teacher"
        )
    values = np.asarray([str(v) for v in batch.non_tensor_batch[teacher_key]])
    unknown = sorted(set(values.tolist()) - set(keys))
    if unknown:
        raise KeyError(
            f"rows with {teacher_key}={unknown} have no teacher (teacher keys: {keys}); add a "
            "distillation.teacher_models.<name> entry with that key"
        )
    return {k: np.nonzero(values == k)[0] for k in keys if (values == k).any()}


def compute_teacher_log_probs(teachers: dict[str, Any], batch: DataProto, teacher_key: str) -> torch.Tensor:
    """(B, T) log nu(y_t) of each row's teacher (each teacher sees only its own rows)."""
    responses = batch.batch["responses"]
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for key, rows in route_rows(batch, sorted(teachers), teacher_key).items():
        part = batch if len(rows) == len(batch) else batch.select_idxs(rows)
        log_probs = teachers[key].compute_ref_log_prob(part).batch["ref_log_prob"]
        out[torch.as_tensor(rows)] = log_probs.float()
    return out


def teacher_step(trainer: Any, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
    """Add `teacher_log_probs` (B, T) to `batch` (no-op without distillation); the teachers' time
    is timing_s/teacher (the actor reports distillation/student_teacher_kl and distillation/loss)."""
    teachers = getattr(trainer.workers, "teachers", None)
    if not teachers:
        return batch
    with timer("teacher", timing):
        teacher = compute_teacher_log_probs(teachers, batch, trainer.config.distillation.teacher_key)
    batch.batch[TEACHER_LOG_PROBS] = teacher
    return batch


def teacher_meta(config: Any) -> dict[str, str]:
    """{teacher key: model_path}: recorded with every checkpoint (the teachers are not saved)."""
    dist = config.distillation
    return {k: t.model_path for k, t in dist.teachers().items()} if dist.enabled else {}
