"""Whether the user set a key, read from the config node and the command line's keys.

Shared by the newest-layout translation (verl_layout.py) and the VeOmni translation
(veomni.py).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["key_given", "node_value"]


def key_given(key: str, explicit_keys: set[str] | None, node: DictConfig, defaults: DictConfig) -> bool:
    """Whether the user set hybridrl's `key` (or a key under it); explicit_keys None (a composed
    config, every key counts as set): whether its value differs from the schema's default."""
    if explicit_keys is None:
        return node_value(node, key) != node_value(defaults, key)
    return any(e == key or e.startswith(key + ".") for e in explicit_keys)


def node_value(node: DictConfig, key: str) -> Any:
    """The plain value at `key` of `node` (None when absent)."""
    value = OmegaConf.select(node, key, default=None)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
