"""Run an asynchronous PPO config: compose it, start Ray for both pools, build the trainer, fit."""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

from hybridrl.async_rollout.records import RolloutWorkersLostError
from hybridrl.trainer.async_ppo.config import AsyncPPOConfig, load_async_config, n_rollout_workers
from hybridrl.trainer.async_ppo.trainer import build_async_trainer
from hybridrl.trainer.ppo.launch import fit_and_report, run_folder_lock, start_ray
from hybridrl.trainer.ppo.restarts import RESTARTABLE, run_with_restarts
from hybridrl.utils.shutdown import preemption_saves

# Applied before the user's overrides: one core for the trainer, one for the rollout worker.
ASYNC_DEFAULTS = [
    "trainer.cpus_per_worker=1",
    "trainer.experiment_name=builtin_async_grpo",
]


def compose_async_config(overrides: list[str] | None = None) -> DictConfig:
    """ppo_trainer.yaml + ASYNC_DEFAULTS + `overrides` (Hydra syntax; async_training.* keys too)."""
    from hydra import compose, initialize_config_module

    overrides = list(overrides or [])
    is_async = [o for o in overrides if o.lstrip("+").startswith("async_training.")]
    rest = [o for o in overrides if o not in is_async]
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[*ASYNC_DEFAULTS, *rest])
    OmegaConf.set_struct(cfg, False)
    if is_async:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o.lstrip("+") for o in is_async]))
    return cfg


def run_async(
    cfg: DictConfig | dict | None = None, *, role_worker_mapping=None, trainer_cls=None
) -> dict[str, float]:
    """Load and validate the config, start Ray and both worker pools, train; returns final val metrics.

    role_worker_mapping / trainer_cls: the user's worker classes by role (trainer/ppo/roles.py) and
    a subclass of AsyncPPOTrainer, as in main_ppo.run_ppo."""
    return run_async_config(load_async_config(cfg), role_worker_mapping, trainer_cls)


def run_async_config(config: AsyncPPOConfig, role_worker_mapping=None, trainer_cls=None) -> dict[str, float]:
    """Train `config`: save on preemption, one writer per run folder, and `trainer.max_restarts`
    restarts after a dead or hung training worker, a lost node, or the loss of every rollout worker
    (a rollout worker that dies alone is dropped and the run goes on with the others)."""
    attempt = functools.partial(_attempt, role_worker_mapping=role_worker_mapping, trainer_cls=trainer_cls)
    # SIGTERM / SIGUSR1: the step is finished or abandoned, saved, and the cleanup (tracker, workers) runs
    with preemption_saves(config.trainer.preemption_grace_s), run_folder_lock(config):
        return run_with_restarts(config, attempt, restartable=(*RESTARTABLE, RolloutWorkersLostError))


def _attempt(config: AsyncPPOConfig, role_worker_mapping=None, trainer_cls=None) -> dict[str, float]:
    init_ray(config)
    trainer = build_async_trainer(config, role_worker_mapping, trainer_cls)
    return fit_and_report(trainer, trainer.async_workers, config)


def init_ray(config: AsyncPPOConfig) -> None:
    """Start a local Ray with enough CPUs for both pools (or attach to RAY_ADDRESS)."""
    from hybridrl.trainer.ppo.teachers import teacher_pool_cpus

    tr, at = config.trainer, config.async_training
    start_ray(
        tr.nnodes * tr.n_gpus_per_node * tr.cpus_per_worker
        + n_rollout_workers(config) * at.rollout_cpus_per_worker
        + teacher_pool_cpus(config),
        config.ray_kwargs.ray_init,
    )
