"""The user's own modules (`model.external_lib`): imported on the driver and in every worker process.

A package of the user's registers plug-ins by name when it is imported (`register_adv_est`,
`register_policy_loss`, `register_rollout`, `register_engine`, `register_reward_manager`,
`register_agent_loop`, ...). Naming it in `actor_rollout_ref.model.external_lib`,
`critic.model.external_lib` or `reward_model.model.external_lib` (one module or a list) makes it
reach every process of a run:

* the driver imports it in the config stage, before any choice is checked against its registry
  (`import_external_libs`), so a registered name is accepted and a wrong one is reported with the
  registered names;
* the driver records the modules (`worker_env`, the `HYBRIDRL_EXTERNAL_LIBS` variable) in the Ray
  job's runtime environment and in every actor it starts; a Ray worker process imports them when
  it starts (Ray's `worker_process_setup_hook`, `setup_worker_process`), before it builds any
  actor, and every hybridrl worker checks them again in its constructor
  (`import_worker_libs`), so a module a worker cannot import fails that worker's start with the
  key and the module named;
* process pools that hybridrl starts itself (the prime reward manager's) run `import_worker_libs`
  as their initializer.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterable
from typing import Any

from hybridrl.utils.config_loader import ConfigError

__all__ = [
    "ENV_VAR",
    "ExternalLibError",
    "SETUP_HOOK",
    "external_lib_entries",
    "import_external_libs",
    "import_worker_libs",
    "module_names",
    "setup_worker_process",
    "worker_env",
]

ENV_VAR = "HYBRIDRL_EXTERNAL_LIBS"
SETUP_HOOK = "hybridrl.utils.plugins.setup_worker_process"
# The model sections whose `external_lib` a run imports, by config key.
MODEL_KEYS = ("actor_rollout_ref.model", "critic.model", "reward_model.model")

_imported: dict[str, str] = {}  # module -> the key that named it (this process, in import order)


class ExternalLibError(ConfigError, ImportError):
    """A module named by `external_lib` could not be imported (a ConfigError and an ImportError)."""


def module_names(value: Any, key: str = "model.external_lib") -> list[str]:
    """`external_lib` as a list of module names: None / "" -> [], "a" -> ["a"], ["a", "b"] -> both.

    Raises:
        ConfigError: a value that is neither a string nor a list of strings.
    """
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (bytes, dict)) and not hasattr(value, "keys"):
        names = list(value)
        if all(isinstance(n, str) and n for n in names):
            return names
    raise ConfigError(
        f"{key}={value!r}: give one module name (external_lib=my_pkg) or a list of them "
        "(external_lib=[my_pkg,my_pkg.more])"
    )


def _get(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if node is None:
            return None
        node = (
            node.get(part) if isinstance(node, dict) or hasattr(node, "keys") else getattr(node, part, None)
        )
    return node


def external_lib_entries(config: Any, keys: Iterable[str] = MODEL_KEYS) -> list[tuple[str, str]]:
    """[(key, module)] of every `<section>.external_lib` of `config` (a typed config, a DictConfig or
    a dict), the first key naming a module kept."""
    seen: dict[str, str] = {}
    for section in keys:
        key = f"{section}.external_lib"
        for name in module_names(_get(config, key), key):
            seen.setdefault(name, key)
    return [(key, name) for name, key in seen.items()]


def _import_one(key: str, name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001  (user code: any error while importing it)
        where = f"in process {os.getpid()}"
        raise ExternalLibError(
            f"{key}={name!r}: module {name!r} could not be imported {where} ({type(e).__name__}: {e}); "
            "install it, put its folder on PYTHONPATH (every Ray node needs it), or fix the name"
        ) from e
    _imported.setdefault(name, key)


def import_external_libs(entries: Iterable[tuple[str, str]]) -> list[str]:
    """Import each (key, module) in this process; the modules are then handed to the workers
    this process starts (`worker_env`). Returns the module names.

    Raises:
        ConfigError: naming the key and the module that failed, and the import's error.
    """
    names = []
    for key, name in entries:
        _import_one(key, name)
        names.append(name)
    return names


def worker_env() -> dict[str, str]:
    """The env vars that hand this process's imported `external_lib` modules to a worker process
    it starts ({} when there are none)."""
    if not _imported:
        return {}
    return {ENV_VAR: json.dumps([[key, name] for name, key in _imported.items()])}


def _env_entries() -> list[tuple[str, str]]:
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return []
    return [(str(key), str(name)) for key, name in json.loads(raw)]


def import_worker_libs() -> None:
    """In a worker process: import the modules the driver handed over (`worker_env`); raises the
    ConfigError of `import_external_libs` when one cannot be imported here."""
    import_external_libs(_env_entries())


def setup_worker_process() -> None:
    """Ray's `worker_process_setup_hook`: import the handed-over modules when a worker process
    starts. An error is kept, not raised (Ray would only end the process): the worker's
    constructor raises it, named, through `import_worker_libs`."""
    for key, name in _env_entries():
        try:
            _import_one(key, name)
        except ConfigError:
            continue
