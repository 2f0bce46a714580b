"""Choices backed by a registry, checked against that registry at the config stage.

`load_config` imports the user's `model.external_lib` modules before it checks anything, so a
name those modules register (`register_rollout`, `register_engine`, `register_adv_est`,
`register_policy_loss`, `register_kl_estimator`, `register_loss_agg`, `register_reward_manager`)
is accepted here, and a wrong name is reported with every registered name. The agent loop and
the tool-call parser are checked in `plugin_checks` (after the tool, interaction and agent-loop
files, which may register them, are imported).
"""

from __future__ import annotations

from typing import Any

from hybridrl import algos
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_registered", "validate_registered_choices"]

HINT = "Register it in a module named by actor_rollout_ref.model.external_lib, or fix the name"


def check_registered(key: str, value: Any, known, what: str) -> None:
    """ConfigError naming `key`, the registered names and how to add one, when `value` is not among them."""
    known = sorted(known)
    if value not in known:
        raise ConfigError(f"{key}={value!r} is not a registered {what}; registered: {known}. {HINT}")


def validate_registered_choices(config: Any) -> None:
    """Every registry-backed choice of a PPO config (raises ConfigError, see the module docstring)."""
    from hybridrl.reward.manager import reward_manager_names
    from hybridrl.rollout.base import list_rollouts

    arr, algo = config.actor_rollout_ref, config.algorithm
    actor = arr.actor
    check_registered(
        "algorithm.adv_estimator", algo.adv_estimator, algos.list_adv_estimators(), "advantage estimator"
    )
    check_registered(
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        actor.policy_loss.loss_mode,
        algos.list_policy_losses(),
        "policy loss",
    )
    check_registered("actor_rollout_ref.rollout.name", arr.rollout.name, list_rollouts(), "rollout engine")
    aggs = algos.list_loss_agg_modes()
    check_registered("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, aggs, "loss aggregation")
    if algos.estimator_needs_critic(algo.adv_estimator):
        check_registered("critic.loss_agg_mode", config.critic.loss_agg_mode, aggs, "loss aggregation")
    kls = algos.list_kl_estimators()
    if actor.use_kl_loss:
        check_registered("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, kls, "KL estimator")
    if algo.use_kl_in_reward:
        check_registered("algorithm.kl_penalty", algo.kl_penalty, kls, "KL estimator")
    if config.reward_manager.source != "importlib":
        rm = config.reward_model.reward_manager
        check_registered("reward_model.reward_manager", rm, reward_manager_names(), "reward manager")
    _check_engines(config)


def _check_engines(config: Any) -> None:
    """`*.strategy` of the trained roles names a registered training engine (`register_engine`)."""
    from hybridrl.engine.base import all_spellings

    sections = [
        ("actor_rollout_ref.actor", config.actor_rollout_ref.actor),
        ("actor_rollout_ref.ref", config.actor_rollout_ref.ref),
    ]
    if algos.estimator_needs_critic(config.algorithm.adv_estimator):
        sections.append(("critic", config.critic))
    for key, section in sections:
        check_registered(f"{key}.strategy", section.strategy, all_spellings(), "training engine")
