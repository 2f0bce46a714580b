"""An AReaL experiment file (its gsm8k GRPO example's keys) as hybridrl overrides.

`python -m hybridrl.trainer.main_async --config areal.yaml [key=value ...]` reads the file as
AReaL's own launcher does: overrides whose first part is a section of the file (`actor.path=...`,
`gconfig.n_samples=8`) change the file before its `${...}` links are resolved; the rest are
hybridrl keys and apply after the translation, on top of it.

Every leaf of the file is one of (the table `areal_rules.RULES`, docs/async.md "AReaL config files"):
- translated: it becomes one or more hybridrl keys (`gconfig.n_samples` -> `rollout.n`, ...);
- no-op: Ray makes it moot (service discovery, scheduler specs, per-section copies of the run's
  name); the value is checked where a value could change what runs, and the list is printed once,
  with the reason for each;
- refused: a feature hybridrl does not have; accepted only at the value that leaves it off, any
  other value is a ConfigError with the reason.
A key the table does not know is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from hybridrl.compat.areal_rules import RULES, fmt, rule_for
from hybridrl.utils.config_loader import ConfigError

__all__ = ["leaves", "load_areal_file", "split_config_flag"]


def leaves(cfg: DictConfig, prefix: str = "") -> dict[str, Any]:
    """Every leaf `a.b.c` of the file (a list, or a section covered by one table entry, is one leaf)."""
    out: dict[str, Any] = {}
    for k in cfg.keys():
        key = f"{prefix}{k}"
        node = cfg._get_node(k)
        if isinstance(node, DictConfig) and not node._is_none() and key not in RULES:
            out.update(leaves(node, f"{key}."))
        else:
            value = OmegaConf.select(cfg, str(k)) if not isinstance(node, (DictConfig, ListConfig)) else node
            out[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return out


def split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(`--config PATH` / `--config=PATH`, the other arguments)."""
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config needs a file: --config areal.yaml")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def _printed_once(lines: list[str], _seen: set = set()) -> None:  # noqa: B006 (once per process)
    text = "\n  ".join(lines)
    if text not in _seen:
        _seen.add(text)
        print("[hybridrl.async] AReaL config file:\n  " + text)


def load_areal_file(path: str, overrides: list[str]) -> list[str]:
    """The hybridrl overrides of an AReaL experiment file, followed by the caller's own keys.

    Args:
        path: the AReaL yaml file.
        overrides: command-line `key=value`s; those whose first part is a section (or top-level key)
            of the file change the file before its links resolve, the others pass through last.

    Returns:
        hybridrl `key=value` overrides: the file's translation, then the remaining overrides.

    Raises:
        ConfigError: a key the table does not know, a refused feature turned on, a no-op key whose
            value would change what runs, or a value that cannot be translated; the message names the key.
    """
    if not Path(path).is_file():
        raise ConfigError(f"--config {path}: no such file")
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"--config {path}: not a mapping of AReaL keys")
    top = set(raw.keys())
    mine = [o for o in overrides if "=" in o and o.lstrip("+").split("=", 1)[0].split(".")[0] in top]
    rest = [o for o in overrides if o not in mine]
    if mine:
        raw = OmegaConf.merge(raw, OmegaConf.from_dotlist([o.lstrip("+") for o in mine]))
    try:
        OmegaConf.resolve(raw)
    except Exception as e:  # an interpolation naming a missing key
        raise ConfigError(f"--config {path}: {e}") from None
    out: list[str] = []
    moot: list[tuple[str, str]] = []
    for key, value in leaves(raw).items():
        for item in _read(key, value, raw, moot):
            if item not in out:
                out.append(item)
    reasons: dict[str, list[str]] = {}
    for key, why in moot:
        reasons.setdefault(why, []).append(key)
    _printed_once(
        [f"{path}: {len(out)} hybridrl keys translated; read and left (no-op):"]
        + [f"  {', '.join(keys)}: {why}" for why, keys in reasons.items()]
    )
    return out + rest


def _read(key: str, value: Any, cfg: DictConfig, moot: list[tuple[str, str]]) -> list[str]:
    matches = rule_for(key)
    if not matches:
        raise ConfigError(
            f"{key} (AReaL config file): not a key hybridrl translates; docs/async.md lists the AReaL keys it reads"
        )
    _, rule = matches[0]
    try:
        if rule.check is not None:
            rule.check(value, cfg)
        if rule.kind == "refused":
            if value not in rule.off:
                off = next((o for o in rule.off if o is not None), None)
                raise ConfigError(f"not supported here: {rule.why}. Leave it at {fmt(off)}")
            return []
        if rule.kind == "no-op":
            moot.append((key, rule.why))
            return []
        return rule.translate(value, cfg)
    except ConfigError as e:
        raise ConfigError(f"{key}={fmt(value)} (AReaL config file): {e}") from None
