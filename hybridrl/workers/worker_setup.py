"""What every role worker does first: join the process group, build its training engine from the registry.

Shared by the actor/rollout/ref worker (engine_workers.py), the critic worker (critic_worker.py) and
the reward-model worker (reward_model_worker.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridrl.config.roles import ModelConfig
from hybridrl.engine.base import EngineBuildSpec, TrainEngine, get_engine
from hybridrl.single_controller.dispatch import make_mesh_dispatch
from hybridrl.utils.device import init_process_group

__all__ = ["ON_ACTOR_MESH", "ON_CRITIC_MESH", "ON_ROLLOUT_MESH", "build_engine", "setup_process"]

# Training calls split over the FSDP mesh (every rank data-parallel), rollout calls over dp x tp.
ON_ACTOR_MESH = make_mesh_dispatch("actor")
ON_ROLLOUT_MESH = make_mesh_dispatch("rollout")
ON_CRITIC_MESH = make_mesh_dispatch("critic")
_PG_TIMEOUT_S = float(os.environ.get("HYBRIDRL_PG_TIMEOUT_S", 600))


def build_engine(
    role: str, model: ModelConfig, section: Any, optim: Any, key: str, model_key: str, worker: Any, mesh: str
) -> TrainEngine:
    """The role's training engine from the registry (`section.strategy`), on every rank."""
    spec = EngineBuildSpec(role, model, section, optim, key, model_key, worker.mesh_layout(mesh), worker.rank)
    return get_engine(section.strategy, f"{key}.strategy").engine_cls.build_role(spec)


def setup_process(num_threads: int | None, timeout_s: float | None = None) -> None:
    """Join the worker group's process group (once per process) and use the slot's CPU cores.

    timeout_s: collective timeout (`actor_rollout_ref.nccl_timeout`); default $HYBRIDRL_PG_TIMEOUT_S or 600.
    """
    if num_threads:
        torch.set_num_threads(num_threads)
    init_process_group(timeout_s=timeout_s or _PG_TIMEOUT_S)
