"""Start the worker groups of a PPO run: one colocated Ray actor per device slot.

ActorRolloutRef, Critic and RewardModel share the same slots (one process each slot), so the
hybrid engine switches between training and generation on the same device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hybridrl import algos
from hybridrl.single_controller.backend import resolve_backend
from hybridrl.single_controller.local import LocalWorkerGroup
from hybridrl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridrl.single_controller.ray.colocate import create_colocated_worker_cls
from hybridrl.utils.device import is_cuda_available
from hybridrl.workers.config import normalize_actor_batch_sizes, normalize_critic_batch_sizes
from hybridrl.workers.megatron_config import check_colocated_megatron, data_parallel_size

LOCAL_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class WorkerGroups:
    """The per-role views of the colocated worker group."""

    actor_rollout: Any
    critic: Any = None
    reward_model: Any = None
    _group: Any = None
    _pool: Any = None

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.shutdown()
        if self._pool is not None:
            self._pool.remove()


def _use_gpu(config) -> bool:
    dev = config.trainer.device
    return dev == "cuda" or (dev == "auto" and is_cuda_available())


def start_workers(config, peak_flops: float | None = None) -> WorkerGroups:
    """Reserve `nnodes x n_gpus_per_node` slots, start the colocated workers, build their models."""
    from hybridrl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
    from hybridrl.workers.megatron_workers import (
        MegatronActorRolloutRefWorker,
        MegatronCriticWorker,
        uses_megatron,
    )

    tr, arr = config.trainer, config.actor_rollout_ref
    check_colocated_megatron(
        {
            "actor_rollout_ref.actor": (arr.actor.strategy, arr.actor.megatron),
            "actor_rollout_ref.ref": (arr.ref.strategy, arr.ref.megatron),
            "critic": (config.critic.strategy, config.critic.megatron)
            if algos.estimator_needs_critic(config.algorithm.adv_estimator)
            else ("fsdp", None),
        }
    )
    if uses_megatron(arr.actor.strategy):  # strategy=megatron (docs/megatron.md)
        ActorRolloutRefWorker = MegatronActorRolloutRefWorker  # noqa: N806
    if uses_megatron(config.critic.strategy):
        CriticWorker = MegatronCriticWorker  # noqa: N806
    use_gpu = _use_gpu(config)
    world = tr.nnodes * tr.n_gpus_per_node
    threads = max(1, int(tr.cpus_per_worker)) if not use_gpu else None
    n = arr.rollout.n
    use_ref = config.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
    role = "actor_rollout_ref" if use_ref else "actor_rollout"
    classes = {
        "actor_rollout": RayClassWithInitArgs(
            ActorRolloutRefWorker,
            model=arr.model,
            actor=arr.actor,
            ref=arr.ref,
            rollout=arr.rollout,
            role=role,
            actor_batch_sizes=normalize_actor_batch_sizes(
                arr.actor,
                rollout_n=n,
                dp_size=data_parallel_size(arr.actor.strategy, arr.actor.megatron, world),
            ),
            num_threads=threads,
            pg_timeout_s=config.actor_rollout_ref.nccl_timeout,
            peak_flops=peak_flops,
        )
    }
    if algos.estimator_needs_critic(config.algorithm.adv_estimator):
        classes["critic"] = RayClassWithInitArgs(
            CriticWorker,
            config=config.critic,
            batch_sizes=normalize_critic_batch_sizes(
                config.critic,
                dp_size=data_parallel_size(config.critic.strategy, config.critic.megatron, world),
                rollout_n=n,
            ),
            num_threads=threads,
            pg_timeout_s=config.actor_rollout_ref.nccl_timeout,
            peak_flops=peak_flops,
        )
    if config.reward_model.enable:
        classes["reward_model"] = RayClassWithInitArgs(
            RewardModelWorker,
            config=config.reward_model,
            policy_tokenizer_path=arr.model.path,
            num_threads=threads,
            pg_timeout_s=config.actor_rollout_ref.nccl_timeout,
        )
    group, pool = _start_group(config, create_colocated_worker_cls(classes), use_gpu, threads)
    views = group.spawn(list(classes))
    groups = WorkerGroups(
        actor_rollout=views["actor_rollout"],
        critic=views.get("critic"),
        reward_model=views.get("reward_model"),
        _group=group,
        _pool=pool,
    )
    # Critic and reward model first, the actor (and its rollout engine) last, as veRL does.
    for name in ("critic", "reward_model", "actor_rollout"):
        if name in views:
            views[name].init_model()
    return groups


def uses_ray(config) -> bool:
    """True when the run's workers are Ray actors (`trainer.backend`, see single_controller.backend)."""
    tr = config.trainer
    return (
        resolve_backend(tr.backend, slots=tr.nnodes * tr.n_gpus_per_node, use_gpu=_use_gpu(config)) == "ray"
    )


def _start_group(config, spec, use_gpu: bool, threads: int | None):
    """(group, pool): one Ray actor per slot, or the single worker in this process (pool None)."""
    tr = config.trainer
    if not uses_ray(config):
        print(f"[hybridrl] trainer.backend={tr.backend}: the worker runs in the driver process (one slot)")
        for key, value in LOCAL_ENV.items():  # what start_ray gives Ray workers
            os.environ.setdefault(key, value)
        return LocalWorkerGroup(spec, name_prefix="hybridrl", num_threads=threads), None
    pool = RayResourcePool(
        [tr.n_gpus_per_node] * tr.nnodes, use_gpu=use_gpu, cpus_per_slot=tr.cpus_per_worker
    )
    return RayWorkerGroup(pool, spec, name_prefix="hybridrl"), pool
