"""`model_engine=<name>`: veRL's newest switch of the training engine of every trained role at once.

veRL's newest ppo_trainer.yaml has a `model_engine` defaults group (`dp`, `megatron`, ...) that picks
the actor, reference and critic sections of that engine. Here the same key sets the `strategy` of
the three roles to the registered engine (engine/base.py: `dp` is FSDP2, alias `fsdp`);
`*.strategy=...` and `--config-name ppo_megatron_trainer` keep working. A role whose strategy the
user set to another engine is refused with a message (never silently overridden).
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridrl.utils.config_loader import ConfigError

__all__ = ["apply_model_engine"]

_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
_DEFAULT_STRATEGY = "fsdp"


def _section(config, key: str):
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _normalize_strategies(config) -> None:
    """veRL's engine names as a role strategy (`strategy=dp`) become hybridrl's spelling (`fsdp`)."""
    from hybridrl.engine.base import get_engine

    for key in _ROLES:
        section = _section(config, key)
        try:
            entry = get_engine(section.strategy, f"{key}.strategy")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if section.strategy == entry.name and entry.aliases:
            section.strategy = entry.aliases[0]


def apply_model_engine(config, explicit_keys: Iterable[str] | None = None) -> None:
    """Give actor, ref and critic the engine `config.model_engine` names (None: leave them).

    Args:
        explicit_keys: keys the user set (None: a strategy other than the default counts as set).

    Raises:
        ConfigError: an unknown engine name, or a role the user put on another engine.
    """
    from hybridrl.engine.base import canonical_engine_name, get_engine

    _normalize_strategies(config)
    name = getattr(config, "model_engine", None)
    if name is None:
        return
    try:
        entry = get_engine(str(name), "model_engine")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    strategy = entry.aliases[0] if entry.aliases else entry.name  # hybridrl's spelling ("fsdp", "megatron")
    explicit = set(explicit_keys) if explicit_keys is not None else None
    for key in _ROLES:
        section = _section(config, key)
        if canonical_engine_name(section.strategy, f"{key}.strategy") == entry.name:
            continue
        typed = (
            (f"{key}.strategy" in explicit) if explicit is not None else section.strategy != _DEFAULT_STRATEGY
        )
        if typed:
            raise ConfigError(
                f"model_engine={name} but {key}.strategy={section.strategy}: model_engine sets the engine of the "
                f"actor, reference and critic; drop one of the two, or set {key}.strategy={strategy}"
            )
        section.strategy = strategy
