"""Start-up checks of user code a run plugs in, on the driver before Ray starts.

The rollout workers load tools, interactions and agent loops when they first generate, i.e. after
Ray, the workers and the models started; a wrong class name or schema used to fail there. These
checks import the same things on the driver first (``prepare_run``, after the tokenizer, so that
``model.external_lib`` is imported as on the workers) and fail with a ConfigError naming the key:

* ``rollout.agent.agent_loop_config_path``: each entry imports and is an AgentLoopBase;
  ``rollout.agent.default_agent_loop`` and every ``agent_name`` in the train/val files name a
  registered loop;
* ``rollout.multi_turn.tool_config_path``: the yaml's classes import and are BaseTools, their
  schemas are OpenAI function schemas (the tools are not constructed here);
  ``multi_turn.function_tool_path`` defines ``@function_tool`` functions;
* ``rollout.multi_turn.interaction_config_path``: the classes import and are BaseInteractions;
* ``rollout.multi_turn.format``: a registered tool-call parser, checked after the modules above
  are imported (user code registers parsers there with ``register_tool_parser``);
* ``custom_reward_function``: a signature that cannot take what the reward manager passes is
  reported naming ``custom_reward_function.name`` / ``path`` (``wrap_reward_errors``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_plugins", "wrap_reward_errors"]

ROLLOUT = "actor_rollout_ref.rollout"


def _config_error(err: Exception, key: str) -> ConfigError:
    text = str(err)
    return ConfigError(text if key in text else f"{key}: {text}")


def _agent_loops_in_play(r: Any) -> bool:
    mt, ag = r.multi_turn, r.agent
    return bool(
        mt.enable
        or mt.tool_config_path
        or mt.function_tool_path
        or mt.interaction_config_path
        or ag.agent_loop_config_path
        or ag.default_agent_loop != "single_turn_agent"
        or mt.format != "hermes"
        or getattr(r, "mode", "sync") == "server"
    )


def check_plugins(config: Any) -> None:
    """Import and check every plug-in the rollout workers will load (see the module docstring)."""
    r = config.actor_rollout_ref.rollout
    names = _agent_names(config)
    if not (_agent_loops_in_play(r) or names):
        return
    _check_agent_loops(r, names)
    _check_tools(r.multi_turn)
    mt = r.multi_turn
    if mt.interaction_config_path:
        from hybridrl.agent.interaction import interaction_entries

        try:
            interaction_entries(mt.interaction_config_path)
        except Exception as e:  # noqa: BLE001  (user code and yaml: any error while loading them)
            raise _config_error(e, f"{ROLLOUT}.multi_turn.interaction_config_path") from None
    from hybridrl.agent.parser import get_tool_parser

    try:
        get_tool_parser(mt.format)
    except ValueError as e:
        raise ConfigError(
            f"{e} The driver checked after importing the tool, interaction and agent-loop classes and "
            "model.external_lib: register the parser in one of those modules, or fix the name"
        ) from None


def _check_agent_loops(r: Any, names: list[str]) -> None:
    from hybridrl.agent.loop import get_agent_loop_class, load_agent_loop_config

    path = r.agent.agent_loop_config_path
    if path:
        try:
            load_agent_loop_config(os.path.expanduser(path))
        except Exception as e:  # noqa: BLE001  (user code and yaml: any error while loading them)
            raise _config_error(e, f"{ROLLOUT}.agent.agent_loop_config_path") from None
    key = f"{ROLLOUT}.agent.default_agent_loop"
    for name, where in [(r.agent.default_agent_loop, key), *((n, "a row's agent_name") for n in names)]:
        try:
            get_agent_loop_class(name)
        except ValueError as e:
            raise ConfigError(f"{where}={name!r}: {e}") from None


def _check_tools(mt: Any) -> None:
    from hybridrl.tools.tool_loading import load_function_tools, tool_entries

    for key, path, check in (
        ("tool_config_path", mt.tool_config_path, tool_entries),
        ("function_tool_path", mt.function_tool_path, load_function_tools),
    ):
        if not path:
            continue
        try:
            check(path)
        except Exception as e:  # noqa: BLE001  (user code: any error while importing it)
            raise _config_error(e, f"{ROLLOUT}.multi_turn.{key}") from None


def _agent_names(config: Any) -> list[str]:
    """The distinct non-empty `agent_name` values of the train/val parquet files (a column read)."""
    d = config.data
    if d.custom_cls.path:
        return []
    found: dict[str, None] = {}
    for files in (d.train_files, d.val_files):
        for path in [files] if isinstance(files, (str, os.PathLike)) else list(files or []):
            path = os.path.expanduser(os.fspath(path))
            if not (path.endswith(".parquet") and os.path.isfile(path)):
                continue
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
                if "agent_name" not in pf.schema_arrow.names:
                    continue
                values = pf.read(columns=["agent_name"]).column("agent_name").unique().to_pylist()
            except Exception:  # noqa: BLE001  (an unreadable file: the dataset loader names it)
                continue
            found.update(dict.fromkeys(str(v) for v in values if v not in (None, "")))
    return list(found)


def wrap_reward_errors(config: Any, build: Callable[[], Any]) -> Any:
    """``build()`` (the reward managers); a TypeError about the custom reward function's signature
    becomes a ConfigError naming `custom_reward_function.name` and `path`."""
    try:
        return build()
    except TypeError as e:
        crf = config.custom_reward_function
        if not crf.path or "custom_reward_function" in str(e):
            raise
        raise ConfigError(
            f"custom_reward_function.name={crf.name!r} in custom_reward_function.path={crf.path!r} "
            f"(reward_model.reward_manager={config.reward_model.reward_manager!r}): {e}"
        ) from None
