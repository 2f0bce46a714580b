"""Run an asynchronous PPO config: compose it, start Ray for both pools, build the trainer, fit."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from hybridrl.trainer.async_ppo.config import AsyncPPOConfig, load_async_config, n_rollout_workers
from hybridrl.trainer.async_ppo.trainer import build_async_trainer
from hybridrl.trainer.ppo.launch import fit_and_report, start_ray
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.shutdown import sigterm_raises

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
    if config.trainer.max_restarts:
        raise ConfigError(
            f"trainer.max_restarts={config.trainer.max_restarts}: restarting after a dead worker is done by "
            "main_ppo only; main_async drops dead rollout workers and goes on (docs/async.md). Set "
            "trainer.max_restarts=0, or resume a stopped run from its checkpoint (trainer.resume_mode=auto)"
        )
    init_ray(config)
    with sigterm_raises():  # SIGTERM runs the cleanup (tracker, workers) instead of ending at once
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
