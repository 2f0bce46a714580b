"""Building the tools of a run: veRL's tool yaml (`multi_turn.tool_config_path`) and a Python file
of `@function_tool` functions (`multi_turn.function_tool_path`).

veRL's yaml format, accepted unchanged::

    tools:
      - class_name: "my_pkg.my_tools.SearchTool"     # a BaseTool subclass, by import path
        config: {type: native, timeout: 5}            # free-form, given to the tool
        tool_schema:                                  # OpenAI function schema
          type: function
          function: {name: search, description: ..., parameters: {...}}

Class names of veRL's own example tools (`verl.tools.gsm8k_tool.Gsm8kTool`) resolve to hybridrl's
equivalents when veRL is not installed, so veRL's example tool configs load as they are.
`config.type: mcp` (veRL's MCP tools) is refused with a message: hybridrl has no MCP client.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from hybridrl.tools.tool import BaseTool, FunctionTool, is_function_tool, validate_tool_schema

__all__ = [
    "VERL_TOOL_ALIASES",
    "import_object",
    "load_function_tools",
    "load_tools",
    "load_tools_from_yaml",
    "tool_entries",
]

VERL_TOOL_ALIASES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "hybridrl.agent.builtin_tools.Gsm8kTool",
}


def import_object(path: str, key: str, aliases: dict[str, str] | None = None) -> Any:
    """`pkg.module.Name` -> the object; errors name the config key and the import path.

    `aliases` (default VERL_TOOL_ALIASES) maps veRL's import paths to hybridrl's equivalents,
    used when the veRL path cannot be imported."""
    module_name, _, attr = str(path).rpartition(".")
    if not module_name:
        raise ValueError(f"{key}: {path!r} is not an import path like 'my_pkg.module.ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        alias = (VERL_TOOL_ALIASES if aliases is None else aliases).get(path)
        if alias is not None:
            return import_object(alias, key, aliases)
        raise ImportError(f"{key}: cannot import {module_name!r} for {path!r}: {e}") from e
    if not hasattr(module, attr):
        raise ImportError(f"{key}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _read_yaml(path: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(os.path.expanduser(path)), resolve=True)


def _schema_of(schema: Any, where: str) -> Any:
    """The entry's tool_schema as veRL hands it to the class (an OpenAIFunctionToolSchema, readable
    as a dict too); None when absent (the class then declares it in get_openai_tool_schema)."""
    if schema is None:
        return None
    from pydantic import ValidationError

    from hybridrl.tools.schemas import OpenAIFunctionToolSchema

    try:
        return OpenAIFunctionToolSchema.model_validate(validate_tool_schema(schema, where))
    except ValidationError as e:
        raise ValueError(f"{where}: tool_schema is not an OpenAI function schema: {e}") from None


def tool_entries(path: str) -> list[tuple[type[BaseTool], dict[str, Any], Any]]:
    """(class, config, tool_schema) of each entry of a veRL-format tool config, checked (the class
    imports and is a BaseTool, the schema is an OpenAI function schema) but not constructed."""
    key = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
    data = _read_yaml(path)
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(
            f"{key}={path!r}: the yaml needs a top-level `tools:` list (veRL's tool config format)"
        )
    out = []
    for i, entry in enumerate(entries):
        where = f"{key}={path!r}, tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(
                f"{where}: each entry needs class_name, config and (or a class-declared) tool_schema"
            )
        config = dict(entry.get("config") or {})
        kind = str(config.get("type", "native")).lower()
        if kind == "mcp":
            raise ValueError(f"{where}: MCP tools (config.type: mcp) are not supported; write a BaseTool")
        if kind != "native":
            raise ValueError(f"{where}: config.type={kind!r}; the tool types are native (a BaseTool class)")
        cls = import_object(entry["class_name"], where)
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise TypeError(f"{where}: {entry['class_name']!r} is not a hybridrl BaseTool subclass")
        schema = _schema_of(entry.get("tool_schema"), where)
        if schema is None and cls.get_openai_tool_schema is BaseTool.get_openai_tool_schema:
            raise ValueError(
                f"{where}: no tool_schema; give `tool_schema` in the entry or override get_openai_tool_schema() "
                f"in {entry['class_name']}"
            )
        out.append((cls, config, schema))
    return out


def load_tools_from_yaml(path: str) -> list[BaseTool]:
    """The tools of a veRL-format tool config (yaml or json), in file order."""
    return [cls(config, schema) for cls, config, schema in tool_entries(path)]


def load_function_tools(path: str) -> list[BaseTool]:
    """Every `@function_tool` function defined at the top level of the Python file `path`."""
    key = "actor_rollout_ref.rollout.multi_turn.function_tool_path"
    full = os.path.abspath(os.path.expanduser(path))
    spec = importlib.util.spec_from_file_location(f"hybridrl_function_tools_{abs(hash(full))}", full)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}={path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tools = [FunctionTool(obj) for obj in vars(module).values() if is_function_tool(obj)]
    if not tools:
        raise ValueError(f"{key}={path!r} defines no @function_tool function")
    return tools


def load_tools(tool_config_path: str | None, function_tool_path: str | None) -> dict[str, BaseTool]:
    """All tools of a run by name; two tools with one name are refused."""
    tools: list[BaseTool] = []
    if tool_config_path:
        tools += load_tools_from_yaml(tool_config_path)
    if function_tool_path:
        tools += load_function_tools(function_tool_path)
    by_name: dict[str, BaseTool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ValueError(
                f"two tools are named {tool.name!r} (multi_turn.tool_config_path / function_tool_path); "
                "tool names must be unique"
            )
        by_name[tool.name] = tool
    return by_name
