"""Start the worker groups of a PPO run: one colocated Ray actor per device slot.

ActorRolloutRef, Critic and RewardModel share the same slots (one process each slot), so the
hybrid engine switches between training and generation on the same device.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from hybridrl import algos
from hybridrl.config.megatron import check_colocated_megatron
from hybridrl.single_controller.backend import resolve_backend
from hybridrl.single_controller.local import LocalWorkerGroup
from hybridrl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridrl.single_controller.ray.colocate import create_colocated_worker_cls
from hybridrl.trainer.ppo.roles import Role, mapped_class
from hybridrl.trainer.ppo.teachers import start_teacher_pool, teacher_role_classes, teacher_views
from hybridrl.utils.device import is_cuda_available
from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes, normalize_critic_batch_sizes
from hybridrl.workers.parallel_dims import ParallelDims

LOCAL_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class WorkerGroups:
    """The per-role views of the colocated worker group."""

    actor_rollout: Any
    critic: Any = None
    reward_model: Any = None
    reward_loop: Any = None  # RewardLoopManager with reward_model.use_reward_loop (start_reward_loop)
    teachers: dict | None = None  # distillation: {teacher key: view} (trainer/ppo/teachers.py)
    _group: Any = None
    _pool: Any = None
    _teacher_pool: Any = None  # distillation.nnodes > 0: the teachers' own pool (teacher_pool.py)

    def shutdown(self) -> None:
        if self.reward_loop is not None:
            self.reward_loop.shutdown()
        if self._teacher_pool is not None:
            self._teacher_pool.shutdown()
        if self._group is not None:
            self._group.shutdown()
        if self._pool is not None:
            self._pool.remove()


def use_gpu(config) -> bool:
    """Whether the workers take GPUs: trainer.device=cuda, or auto with CUDA visible."""
    dev = config.trainer.device
    return dev == "cuda" or (dev == "auto" and is_cuda_available())


def worker_classes(config, role_worker_mapping=None) -> tuple[type, type, type]:
    """(ActorRolloutRef, Critic, RewardModel) worker classes: one per role, whatever the engine
    (`*.strategy`), or the user's subclasses from `role_worker_mapping` (trainer/ppo/roles.py);
    checks first that colocated roles agree on their Megatron layout (docs/megatron.md)."""
    from hybridrl.workers.engine_workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

    arr = config.actor_rollout_ref
    check_colocated_megatron(
        {
            "actor_rollout_ref.actor": (arr.actor.strategy, arr.actor.megatron),
            "actor_rollout_ref.ref": (arr.ref.strategy, arr.ref.megatron),
            "critic": (config.critic.strategy, config.critic.megatron)
            if algos.estimator_needs_critic(config.algorithm.adv_estimator)
            else ("fsdp", None),
        }
    )
    return (
        mapped_class(role_worker_mapping, Role.ActorRollout, ActorRolloutRefWorker),
        mapped_class(role_worker_mapping, Role.Critic, CriticWorker),
        mapped_class(role_worker_mapping, Role.RewardModel, RewardModelWorker),
    )


def actor_dims(config, world: int, with_rollout: bool = True) -> ParallelDims:
    """The actor's ParallelDims on `world` ranks (its rollout TP when it holds the rollout)."""
    arr = config.actor_rollout_ref
    tp = arr.rollout.tensor_model_parallel_size if with_rollout else 1
    return ParallelDims.for_role(world, arr.actor, "actor_rollout_ref.actor", rollout_tp=tp)


def actor_class(
    config,
    actor_cls: type,
    world: int,
    threads: int | None,
    peak_flops: float | None,
    disaggregated: bool = False,
) -> RayClassWithInitArgs:
    """The actor worker of a run on `world` slots: main_ppo's hybrid engine (actor + rollout
    [+ ref]) or, `disaggregated`, main_async's training actor [+ ref] (its rollout engines live
    in workers of their own)."""
    arr = config.actor_rollout_ref
    use_ref = config.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
    dims = actor_dims(config, world, with_rollout=not disaggregated)
    return RayClassWithInitArgs(
        actor_cls,
        model=arr.model,
        actor=arr.actor,
        ref=arr.ref,
        rollout=arr.rollout,
        role="actor_rollout_ref" if use_ref else ("actor" if disaggregated else "actor_rollout"),
        actor_batch_sizes=normalize_actor_batch_sizes(
            arr.actor, rollout_n=arr.rollout.n, dp_size=dims.data_ranks
        ),
        num_threads=threads,
        pg_timeout_s=arr.nccl_timeout,
        peak_flops=peak_flops,
        dims=dims,
        disaggregated=disaggregated,
        distillation=config.distillation.distillation_loss if config.distillation.enabled else None,
    )


def role_classes(
    config, world: int, threads: int | None, peak_flops: float | None, role_worker_mapping=None
) -> dict[str, Any]:
    """{role name: RayClassWithInitArgs} of the roles this run needs, for `world` slots."""
    actor_cls, critic_cls, reward_cls = worker_classes(config, role_worker_mapping)
    classes = {"actor_rollout": actor_class(config, actor_cls, world, threads, peak_flops)}
    classes.update(support_role_classes(config, critic_cls, reward_cls, world, threads, peak_flops))
    classes.update(teacher_role_classes(config, actor_cls, threads))
    return classes


def support_role_classes(
    config, critic_cls: type, reward_cls: type, world: int, threads: int | None, peak_flops: float | None
) -> dict[str, Any]:
    """{"critic": ..., "reward_model": ...} for the roles this run needs (synchronous and asynchronous)."""
    classes = {}
    if algos.estimator_needs_critic(config.algorithm.adv_estimator):
        dims = ParallelDims.for_role(world, config.critic, "critic")
        classes["critic"] = RayClassWithInitArgs(
            critic_cls,
            config=config.critic,
            batch_sizes=normalize_critic_batch_sizes(
                config.critic, dp_size=dims.data_ranks, rollout_n=config.actor_rollout_ref.rollout.n
            ),
            num_threads=threads,
            pg_timeout_s=config.actor_rollout_ref.nccl_timeout,
            peak_flops=peak_flops,
            dims=dims,
        )
    if config.reward_model.enable and not config.reward_model.use_reward_loop:
        classes["reward_model"] = RayClassWithInitArgs(
            reward_cls,
            config=config.reward_model,
            policy_tokenizer_path=config.actor_rollout_ref.model.path,
            num_threads=threads,
            pg_timeout_s=config.actor_rollout_ref.nccl_timeout,
        )
    return classes


def start_workers(config, peak_flops: float | None = None, role_worker_mapping=None) -> WorkerGroups:
    """Reserve `nnodes x n_gpus_per_node` slots, start the colocated workers (the user's classes of
    `role_worker_mapping` where given), build their models."""
    tr = config.trainer
    gpu = use_gpu(config)
    threads = max(1, int(tr.cpus_per_worker)) if not gpu else None
    classes = role_classes(config, tr.nnodes * tr.n_gpus_per_node, threads, peak_flops, role_worker_mapping)
    spec = create_colocated_worker_cls(classes)
    apply_nsight(config, spec, gpu)
    group, pool = _start_group(config, spec, gpu, threads)
    groups = WorkerGroups(actor_rollout=None, _group=group, _pool=pool)
    # A start that fails anywhere below (a model that does not load, a teacher pool that does not
    # fit) releases the actors and the placement groups, so the Ray session is left as it was.
    with shutdown_on_error(groups):
        views = group.spawn(list(classes))
        groups.actor_rollout = views["actor_rollout"]
        groups._teacher_pool = start_teacher_pool(config, worker_classes(config)[0], gpu, uses_ray(config))
        groups.critic, groups.reward_model = views.get("critic"), views.get("reward_model")
        groups.teachers = teacher_views(config, views, groups._teacher_pool)
        # Critic, reward model and teachers first, the actor (and its rollout engine) last, as veRL does.
        for name in (
            "critic",
            "reward_model",
            *sorted(k for k in views if k.startswith("teacher_")),
            "actor_rollout",
        ):
            if name in views:
                views[name].init_model()
    return groups


@contextlib.contextmanager
def shutdown_on_error(groups: WorkerGroups):
    """Shut `groups` down (actors, reward loop, placement groups) when the block raises, then re-raise."""
    try:
        yield groups
    except BaseException:
        try:
            groups.shutdown()
        except Exception as cleanup:  # the start's own error is the one to report
            print(f"[hybridrl] warning: releasing the workers after a failed start: {cleanup!r}")
        raise


def start_reward_loop(config, reward_fn, val_reward_fn=None) -> Any:
    """veRL's reward loop (`reward_model.use_reward_loop=True`): its workers and served reward model, or
    None (hybridrl/reward/reward_loop.py). With a GenRM both reward managers get its client."""
    if not config.reward_model.use_reward_loop:
        return None
    from hybridrl.reward.reward_loop import RewardLoopManager
    from hybridrl.trainer.ppo.genrm_config import is_genrm

    tr, rm, rollout = config.trainer, config.reward_model, config.actor_rollout_ref.rollout
    total = rollout.gpu_memory_utilization + rm.rollout.gpu_memory_utilization
    if use_gpu(config) and rm.enable and rm.rollout.name == "vllm" and rollout.name == "vllm" and total > 1:
        raise ValueError(  # untested on GPU: the served RM keeps its memory (no sleep/wake here)
            f"actor_rollout_ref.rollout.gpu_memory_utilization + reward_model.rollout.gpu_memory_utilization = "
            f"{total:.2f} > 1 on the same GPUs; the reward model's engine does not sleep between steps here, so "
            "lower them to sum to at most 1"
        )
    return RewardLoopManager(
        config.reward_model,
        config.actor_rollout_ref.model.path,
        reward_fn,
        slots=tr.nnodes * tr.n_gpus_per_node,
        use_ray=uses_ray(config),
        num_threads=None if use_gpu(config) else max(1, int(tr.cpus_per_worker)),
        genrm=is_genrm(config),
        val_reward_fn=val_reward_fn,
    )


def apply_nsight(config, spec, gpu: bool) -> None:
    """global_profiler.tool=nsys: check CUDA and `nsys`, and let Ray start the workers under Nsight
    (runtime_env nsight = global_tool_config.nsys.worker_nsight_options). Untested on GPU."""
    glob = config.global_profiler
    if glob.tool != "nsys" or not glob.steps:
        return
    from hybridrl.utils.profiler_tools import check_nsys_available, nsys_options

    check_nsys_available(gpu)
    spec.update_options(
        {"runtime_env": {"nsight": nsys_options(glob.global_tool_config)["worker_nsight_options"]}}
    )


def uses_ray(config) -> bool:
    """True when the run's workers are Ray actors (`trainer.backend`, see single_controller.backend)."""
    tr = config.trainer
    return resolve_backend(tr.backend, slots=tr.nnodes * tr.n_gpus_per_node, use_gpu=use_gpu(config)) == "ray"


def _start_group(config, spec, use_gpu: bool, threads: int | None):
    """(group, pool): one Ray actor per slot, or the single worker in this process (pool None)."""
    tr = config.trainer
    if not uses_ray(config):
        print(f"[hybridrl] trainer.backend={tr.backend}: the worker runs in the driver process (one slot)")
        for key, value in LOCAL_ENV.items():  # what start_ray gives Ray workers
            os.environ.setdefault(key, value)
        return LocalWorkerGroup(spec, name_prefix="hybridrl", num_threads=threads), None
    pool = RayResourcePool(
        [tr.n_gpus_per_node] * tr.nnodes,
        use_gpu=use_gpu,
        cpus_per_slot=tr.cpus_per_worker,
        ready_timeout_s=tr.resources_timeout_s,
    )
    try:
        return RayWorkerGroup(pool, spec, name_prefix="hybridrl"), pool
    except BaseException:
        pool.remove()
        raise
