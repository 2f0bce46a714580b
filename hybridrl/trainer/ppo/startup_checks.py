"""Start-up checks of values that would fail (or do nothing) only after Ray and the workers started.

Each raises a ConfigError naming the key and the fix, before Ray starts (issue 30's validation
sweep; more checks live in config.py, the dataset loader and the model resolver).
"""

from __future__ import annotations

from typing import Any

from hybridrl import algos
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_startup_values"]


def _at_least_one(key: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r} must be an integer >= 1 ({what}); e.g. {key}=1")


def check_startup_values(config: Any) -> None:
    """Counts that must be positive: the PPO epochs and the training epochs."""
    arr = config.actor_rollout_ref
    _at_least_one(
        "actor_rollout_ref.actor.ppo_epochs", arr.actor.ppo_epochs, "passes over each batch per step"
    )
    if algos.estimator_needs_critic(config.algorithm.adv_estimator):
        _at_least_one("critic.ppo_epochs", config.critic.ppo_epochs, "passes over each batch per step")
    if config.trainer.total_training_steps is None:
        _at_least_one("trainer.total_epochs", config.trainer.total_epochs, "passes over the training data")
