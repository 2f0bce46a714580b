"""The teacher pool of on-policy distillation (veRL's `distillation.*`): driver side.

Each teacher of `distillation.teacher_models` is a reference-policy worker (`ActorRolloutRefWorker`
with role "ref") loaded from the teacher's `model_path`: a forward-only training engine from the
engine registry (`actor_rollout_ref.ref.strategy`: FSDP2 or Megatron), so any student engine
works. With `distillation.nnodes=0` (veRL's colocated mode) the teachers are roles of the actor's
colocated worker, on the actor's slots, offloaded between steps like the reference; with
`distillation.nnodes > 0` they run on their own resource pool, in replicas (teacher_pool.py).

One step (`teacher_step`): rows are routed to teachers by the row's `distillation.teacher_key`
field (the single `teacher_model` takes every row), each teacher computes the log-probs of its
rows' sampled tokens at the rollout temperature, and the batch gets `teacher_log_probs` (B, T)
(with loss_mode=forward_kl_topk also the teachers' top-k log-probs and ids (B, T, k)) for the
actor's loss (hybridrl/workers/distillation.py). The teachers are never checkpointed;
their paths are recorded in the checkpoint's meta (`teacher_meta`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.metrics import timer
from hybridrl.workers.distillation import (
    TEACHER_LOG_PROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOG_PROBS,
    needs_topk,
)
from hybridrl.workers.distillation_config import DEFAULT_KEY

ROLE_PREFIX = "teacher_"


def teacher_class(config: Any, actor_cls: type, teacher: Any, threads: int | None) -> Any:
    """RayClassWithInitArgs of one teacher's worker: a reference-policy (forward-only) engine with the
    teacher's weights, at the teacher's temperature (`inference.temperature`, else the rollout's)."""
    from hybridrl.single_controller.ray.base import RayClassWithInitArgs

    arr = config.actor_rollout_ref
    model = dataclasses.replace(
        arr.model, path=teacher.model_path, init_from_scratch=False, lora_rank=0, lora_adapter_path=None
    )
    temperature = teacher.inference.temperature or arr.rollout.temperature
    return RayClassWithInitArgs(
        actor_cls,
        model=model,
        ref=arr.ref,
        rollout=dataclasses.replace(arr.rollout, temperature=temperature),
        role="ref",
        num_threads=threads,
        pg_timeout_s=arr.nccl_timeout,
    )


def teacher_role_classes(config: Any, actor_cls: type, threads: int | None) -> dict[str, Any]:
    """{"teacher_<i>": RayClassWithInitArgs} of the colocated teachers ({} when disabled, or when the
    teachers have their own pool: `start_teacher_pool`)."""
    dist = config.distillation
    if not dist.enabled or not dist.colocated:
        return {}
    teachers = sorted(dist.teachers().items())
    return {
        f"{ROLE_PREFIX}{i}": teacher_class(config, actor_cls, t, threads)
        for i, (_k, t) in enumerate(teachers)
    }


def start_teacher_pool(config: Any, actor_cls: type, gpu: bool, ray_backend: bool) -> Any:
    """The teachers' own pool (distillation.nnodes > 0), models loaded; None when colocated or disabled.

    Raises:
        ValueError: the run's workers are not Ray actors (trainer.backend=local runs one process).
    """
    dist = config.distillation
    if not dist.enabled or dist.colocated:
        return None
    if not ray_backend:
        raise ValueError(
            f"distillation.nnodes={dist.nnodes} (a separate teacher pool) needs Ray worker processes; "
            "set trainer.backend=ray (or auto), or distillation.nnodes=0 to colocate the teachers"
        )
    from hybridrl.trainer.ppo.teacher_pool import TeacherPool

    teachers = dist.teachers()
    threads = None if gpu else max(1, int(config.trainer.cpus_per_worker))
    pool = TeacherPool(config, lambda key: teacher_class(config, actor_cls, teachers[key], threads), gpu)
    try:
        pool.init_models()
    except Exception:
        pool.shutdown()
        raise
    return pool


def teacher_pool_cpus(config: Any) -> float:
    """CPUs the teachers' own pool reserves (distillation.nnodes x n_gpus_per_node x trainer.cpus_per_worker)."""
    dist = config.distillation
    if not dist.enabled or dist.colocated:
        return 0.0
    return dist.nnodes * dist.n_gpus_per_node * config.trainer.cpus_per_worker


def teacher_views(config: Any, views: dict[str, Any], pool: Any = None) -> dict[str, Any]:
    """{teacher key: what serves it}: the colocated role views (same order as the classes), or the
    replicas of the separate pool (`start_teacher_pool`)."""
    dist = config.distillation
    if not dist.enabled:
        return {}
    if pool is not None:
        return pool.views()
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


def compute_teacher_log_probs(
    teachers: dict[str, Any], batch: DataProto, teacher_key: str, topk: int = 0
) -> dict[str, torch.Tensor]:
    """Each row's teacher's log-probs (each teacher sees only its own rows).

    Args:
        teachers: {teacher key: worker-group view}.
        batch: the step's batch (responses (B, T)).
        teacher_key: the row field that routes rows to teachers.
        topk: > 0 (loss_mode=forward_kl_topk): also the teachers' k largest log-probs and ids.

    Returns:
        {teacher_log_probs: (B, T) log nu(y_t)}, with topk also teacher_topk_log_probs (B, T, k)
        float32 and teacher_topk_ids (B, T, k) long.
    """
    b, t = batch.batch["responses"].shape
    out = {TEACHER_LOG_PROBS: torch.zeros((b, t), dtype=torch.float32)}
    if topk > 0:
        out[TEACHER_TOPK_LOG_PROBS] = torch.zeros((b, t, topk), dtype=torch.float32)
        out[TEACHER_TOPK_IDS] = torch.zeros((b, t, topk), dtype=torch.long)
    for key, rows in route_rows(batch, sorted(teachers), teacher_key).items():
        part = batch if len(rows) == len(batch) else batch.select_idxs(rows)
        part = DataProto(
            batch=part.batch,
            non_tensor_batch=part.non_tensor_batch,
            meta_info={**part.meta_info, "topk": topk},
        )
        res = teachers[key].compute_ref_log_prob(part).batch
        idx = torch.as_tensor(rows)
        out[TEACHER_LOG_PROBS][idx] = res["ref_log_prob"].float()
        if topk > 0:
            out[TEACHER_TOPK_LOG_PROBS][idx] = res["ref_topk_log_probs"].float()
            out[TEACHER_TOPK_IDS][idx] = res["ref_topk_ids"].long()
    return out


def teacher_step(trainer: Any, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
    """Add `teacher_log_probs` (B, T) to `batch` (and with forward_kl_topk `teacher_topk_log_probs`,
    `teacher_topk_ids` (B, T, k)); no-op without distillation. The teachers' time is timing_s/teacher
    (the actor reports distillation/student_teacher_kl and distillation/loss)."""
    teachers = getattr(trainer.workers, "teachers", None)
    if not teachers:
        return batch
    dist = trainer.config.distillation
    topk = dist.distillation_loss.topk if needs_topk(dist.distillation_loss) else 0
    with timer("teacher", timing):
        tensors = compute_teacher_log_probs(teachers, batch, dist.teacher_key, topk=topk)
    for name, value in tensors.items():
        batch.batch[name] = value
    return batch


def teacher_meta(config: Any) -> dict[str, str]:
    """{teacher key: model_path}: recorded with every checkpoint (the teachers are not saved)."""
    dist = config.distillation
    return {k: t.model_path for k, t in dist.teachers().items()} if dist.enabled else {}
