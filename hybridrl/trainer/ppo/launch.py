"""Run a PPO config: start (or attach to) Ray, build the trainer, fit, write the report."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading

from hybridrl.report import make_report
from hybridrl.trainer.ppo.config import PPOConfig
from hybridrl.trainer.ppo.restarts import run_with_restarts
from hybridrl.trainer.ppo.sections import AsyncTrainingConfig
from hybridrl.trainer.ppo.setup import build_trainer
from hybridrl.trainer.ppo.trainer import RayPPOTrainer
from hybridrl.utils import plugins
from hybridrl.utils.run_lock import RunLock
from hybridrl.utils.shutdown import preemption_saves


def run_ppo_config(config: PPOConfig, role_worker_mapping=None, trainer_cls=None) -> dict[str, float]:
    """Train `config` (checked); the user's worker / trainer classes where given (see main_ppo.run_ppo)."""
    if config.async_training != AsyncTrainingConfig():
        print(
            "hybridrl: async_training.* is set but main_ppo trains synchronously and ignores it; "
            "run python -m hybridrl.trainer.main_async for asynchronous training (docs/async.md)",
            file=sys.stderr,
        )

    tr = config.trainer
    attempt = functools.partial(_attempt, role_worker_mapping=role_worker_mapping, trainer_cls=trainer_cls)
    # SIGTERM / SIGUSR1: the step is finished or abandoned, saved, and the cleanup (tracker, workers) runs
    with preemption_saves(tr.preemption_grace_s), run_folder_lock(config):
        return run_with_restarts(config, attempt)  # trainer.max_restarts: again after a dead / hung worker


def run_folder_lock(config: PPOConfig):
    """The run folder's lock (one writing run per trainer.default_local_dir); none for val_only runs."""
    tr = config.trainer
    if tr.val_only:
        return contextlib.nullcontext()
    return RunLock(tr.default_local_dir, label=f"{tr.project_name}/{tr.experiment_name}")


def _attempt(config: PPOConfig, role_worker_mapping=None, trainer_cls=None) -> dict[str, float]:
    trainer = build_trainer(  # data and rewards are checked before Ray starts
        config,
        init_ray=_init_ray,
        role_worker_mapping=role_worker_mapping,
        trainer_cls=trainer_cls or RayPPOTrainer,
    )
    return fit_and_report(trainer, trainer.workers, config)


def fit_and_report(trainer, workers, config) -> dict[str, float]:
    """`trainer.fit()`, then always close the tracker and the workers; the report PNG if asked for."""
    try:
        metrics = trainer.fit()
    finally:
        trainer.tracker.finish()
        workers.shutdown()
    if config.trainer.make_report:
        write_report(trainer.tracker)
    return metrics


def _init_ray(config: PPOConfig) -> None:
    from hybridrl.trainer.ppo.teachers import teacher_pool_cpus

    tr = config.trainer
    cpus = tr.nnodes * tr.n_gpus_per_node * tr.cpus_per_worker + teacher_pool_cpus(config)
    start_ray(cpus, config.ray_kwargs.ray_init)


def merge_runtime_env(ours: dict, user: dict) -> dict:
    """veRL's `ray_kwargs.ray_init.runtime_env` merged with hybridrl's: env_vars are merged (the
    user's win), every other field (working_dir, py_executable, pip, worker_process_setup_hook...)
    is the user's where the user sets it, else ours."""
    merged = {k: v for k, v in ours.items() if k != "env_vars"}
    merged.update({k: v for k, v in user.items() if k != "env_vars"})
    merged["env_vars"] = {
        **ours.get("env_vars", {}),
        **{k: str(v) for k, v in user.get("env_vars", {}).items()},
    }
    return merged


def start_ray(cpus_needed: float, ray_init=None) -> None:
    """Attach to `RAY_ADDRESS` (a cluster, or inside `ray job submit`) or start a local Ray with at
    least `cpus_needed` CPUs; either way the workers get the environment variables hybridrl needs.

    ray_init: `ray_kwargs.ray_init` (num_cpus: the local Ray's CPU count; runtime_env: merged
    into the job's runtime environment with `merge_runtime_env`)."""
    import math

    import ray

    if ray.is_initialized():
        if ray_init is not None and ray_init.runtime_env:
            print(
                "[hybridrl] warning: ray_kwargs.ray_init.runtime_env is not applied: Ray was initialized "
                "in this process before the run started. Pass it to that ray.init(runtime_env=...), or "
                "leave Ray to the run.",
                file=sys.stderr,
            )
        return
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    }
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    user_env = dict(ray_init.runtime_env) if ray_init is not None else {}
    ours: dict = {"env_vars": {**env, **plugins.worker_env()}}
    if plugins.worker_env():  # every worker process of the job imports model.external_lib when it starts
        ours["worker_process_setup_hook"] = plugins.SETUP_HOOK
    kwargs: dict = {"runtime_env": merge_runtime_env(ours, user_env), "log_to_driver": True}
    with own_signal_handlers():  # ray.init replaces the driver's SIGTERM handler
        if address:
            # Inside `ray job submit` the job may carry its own runtime_env: merge ours into it.
            os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
            ray.init(address=address, **kwargs)
        else:
            num_cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed))
            if ray_init is not None and ray_init.num_cpus is not None:
                num_cpus = ray_init.num_cpus
            loopback_only()
            # address="local": a new instance even when this machine runs a cluster (`ray start`,
            # ray.cluster_utils) whose address Ray would otherwise pick up from its temp folder
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                **kwargs,
            )


@contextlib.contextmanager
def own_signal_handlers():
    """Keep this process's SIGTERM / SIGUSR1 handlers across the block (main thread only).

    ``ray.init`` in a driver installs its own SIGTERM handler, which exits with status 1 and skips
    the cleanup and the save on preemption (``hybridrl.utils.shutdown``); the entry points' handlers
    are put back after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            if handler is not None:
                signal.signal(s, handler)


def loopback_only() -> None:
    """Make the local Ray about to start listen on 127.0.0.1 only (GCS, raylet, agents, workers).

    Ray turns a node address of 127.0.0.1 into the machine's network address unless it runs in its
    single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when ray is imported): both the
    variable (for Ray's own processes) and the constant it set in this process are switched.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def write_report(tracker) -> None:
    """The PNG of the run's curves, next to the file logger's metrics.jsonl (if any)."""

    log_dir = tracker.log_dir
    if log_dir and os.path.exists(os.path.join(log_dir, "metrics.jsonl")):
        print(f"[hybridrl] report: {make_report(log_dir)}")
