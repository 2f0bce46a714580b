"""The one structured-config loader behind every entry point (PPO, async PPO, SFT, generation, eval).

A config is a typed dataclass tree (the schema). Loading merges, in order, the schema, an optional
shipped yaml and the user's values (a dict / DictConfig, or Hydra-style `key=value` strings), then
resolves `${...}` interpolations and returns the dataclass instance. A key the schema lacks fails
at once with `ConfigError`, naming the key and the closest known keys ("did you mean ...?"); a value
of the wrong type fails naming the key. `check_override_keys` does the same for a command line
before Hydra sees it (Hydra alone would only say "not in struct").
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Print a hybridrl warning to stderr, once per process and message."""
    if message not in WARNED:
        WARNED.add(message)
        print(f"hybridrl: {message}", file=sys.stderr)


class ConfigError(ValueError):
    """A config problem found at start-up; the message names the key and the fix."""


@functools.cache
def schema_node(schema_cls: type) -> DictConfig:
    """`OmegaConf.structured(schema_cls)`, built once per class (~0.5 s for PPOConfig on a loaded
    2-core CPU, and the start-up needed it three times). Shared: read it, merge onto it
    (`OmegaConf.merge` copies its first argument), never change it in place."""
    return OmegaConf.structured(schema_cls)


def all_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of `node`, parents before children (e.g. ["data", "data.train_files", ...])."""
    out = []
    for k in node:
        full = f"{prefix}{k}"
        out.append(full)
        v = None if OmegaConf.is_missing(node, k) else node[k]
        if isinstance(v, DictConfig):
            out.extend(all_keys(v, full + "."))
    return out


def suggest(key: str, known: list[str]) -> str:
    """ " Did you mean a, b?" for the closest known keys, or "" when none is close."""
    close = difflib.get_close_matches(key, known, n=3)
    return f" Did you mean {', '.join(close)}?" if close else ""


def merge_onto(schema: DictConfig, user: Any, source: str, every_key: str) -> DictConfig:
    """`schema` <- `user`; an unknown key or a badly typed value raises ConfigError.

    Args:
        source: where the values come from, for the message ("your overrides", "sft_trainer.yaml").
        every_key: where the user finds every key, for the message (a yaml path or a doc).
    """
    try:
        return OmegaConf.merge(schema, user)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = str(getattr(e, "full_key", None) or e)
        raise ConfigError(
            f"unknown config key '{key}' ({source}).{suggest(key, all_keys(schema))} "
            f"Every key is listed in {every_key}."
        ) from None
    except ValidationError as e:
        raise ConfigError(f"bad value for config key '{getattr(e, 'full_key', '?')}': {e.msg}") from None


def as_node(cfg: DictConfig | dict | list[str] | None) -> DictConfig:
    """The user's values as a DictConfig: a dict/DictConfig as is, a list as `key=value` strings."""
    if isinstance(cfg, (list, tuple, ListConfig)):
        return OmegaConf.from_dotlist([str(c).lstrip("+") for c in cfg])
    return OmegaConf.create(cfg if cfg is not None else {})


def load_structured(
    schema_cls: type,
    cfg: DictConfig | dict | list[str] | None,
    every_key: str,
    yaml_path: str | Path | None = None,
) -> Any:
    """schema <- yaml (if given) <- `cfg`, resolved; returns an instance of `schema_cls`.

    Raises:
        ConfigError: an unknown key or a value of the wrong type, naming the key.
    """
    merged = schema_node(schema_cls)
    if yaml_path is not None:
        yaml = OmegaConf.load(yaml_path)
        yaml.pop("hydra", None)
        yaml.pop("defaults", None)
        merged = merge_onto(merged, yaml, Path(yaml_path).name, every_key)
    merged = merge_onto(merged, as_node(cfg), "your overrides", every_key)
    OmegaConf.resolve(merged)
    return OmegaConf.to_object(merged)


def _under_open_node(node: DictConfig, key: str, known: list[str]) -> bool:
    """True when a parent of `key` is a free-form field (a dict or Any), e.g. model.override_config.x."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if parent in known:
            value = OmegaConf.select(node, parent)
            return not isinstance(value, DictConfig) or OmegaConf.get_type(value) is dict
    return False


def check_override_keys(
    argv: list[str], schema_cls: type, every_key: str, also_known: Callable[[str], bool] | None = None
) -> None:
    """Fail on a command-line `key=value` whose key the schema lacks, suggesting close keys.

    Hydra's own options (`hydra.*`, `--...`) and `~key` deletions are left to Hydra; keys for
    which `also_known(key)` is true (veRL's newest layout, mapped by the config stage) pass.
    """
    node = schema_node(schema_cls)
    known = all_keys(node)
    for arg in argv:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        if key.startswith("hydra.") or key in known or _under_open_node(node, key, known):
            continue
        if also_known is not None and also_known(key):
            continue
        raise ConfigError(
            f"unknown config key '{key}' on the command line.{suggest(key, known)} Every key is listed in {every_key}."
        )
