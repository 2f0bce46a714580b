"""The roles of a run and the worker class of each: veRL's `role_worker_mapping`.

`run_ppo(config, role_worker_mapping={Role.ActorRollout: MyWorker}, trainer_cls=MyTrainer)`
(hybridrl.trainer.main_ppo) starts the user's worker classes in place of the built-in ones. Each
class must subclass the built-in class of its role, so that it takes the same constructor
arguments; it adds `@register` methods that the user's trainer calls on the role's view
(`self.workers.actor_rollout.<method>(...)`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from hybridrl.utils.config_loader import ConfigError

__all__ = ["Role", "check_trainer_cls", "mapped_class"]


class Role(enum.Enum):
    """A role that a worker class plays (the keys of `role_worker_mapping`).

    ActorRollout: the colocated actor (+ rollout, + reference) worker; ActorRolloutRef is the same
    role under veRL's other name (the reference policy always lives in the actor's process here).
    Critic, RewardModel: the critic and the reward-model workers. Rollout: main_async's
    rollout-only workers (the rollout pool).
    """

    ActorRollout = "actor_rollout"
    ActorRolloutRef = "actor_rollout_ref"
    Critic = "critic"
    RewardModel = "reward_model"
    Rollout = "rollout"


_SAME = {Role.ActorRolloutRef: Role.ActorRollout}


def _normalized(mapping: Mapping[Any, type] | None) -> dict[Role, type]:
    out: dict[Role, type] = {}
    for key, cls in (mapping or {}).items():
        try:
            role = key if isinstance(key, Role) else Role(str(key))
        except ValueError:
            raise ConfigError(
                f"role_worker_mapping: unknown role {key!r}; use one of {[r.name for r in Role]} (hybridrl.trainer.ppo.roles.Role)"
            ) from None
        role = _SAME.get(role, role)
        if role in out and out[role] is not cls:
            raise ConfigError(
                f"role_worker_mapping maps {role.name} twice ({out[role].__name__}, {cls.__name__})"
            )
        out[role] = cls
    return out


def mapped_class(mapping: Mapping[Any, type] | None, role: Role, default: type) -> type:
    """The class `mapping` gives `role` (checked to subclass `default`), else `default`.

    Raises:
        ConfigError: the class is not a subclass of the built-in class of its role.
    """
    cls = _normalized(mapping).get(_SAME.get(role, role), default)
    if not (isinstance(cls, type) and issubclass(cls, default)):
        raise ConfigError(
            f"role_worker_mapping[Role.{role.name}]={cls!r} must be a subclass of {default.__module__}."
            f"{default.__qualname__} (it is started with that class's constructor arguments)"
        )
    return cls


def check_trainer_cls(trainer_cls: type, base: type) -> type:
    """`trainer_cls` when it subclasses `base` (RayPPOTrainer / AsyncPPOTrainer); ConfigError otherwise."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, base)):
        raise ConfigError(
            f"trainer_cls={trainer_cls!r} must be a subclass of {base.__module__}.{base.__qualname__}"
        )
    return trainer_cls
