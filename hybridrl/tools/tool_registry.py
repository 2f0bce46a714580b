"""veRL's tool registry (`verl.tools.tool_registry`) under hybridrl's import path.

`initialize_tools_from_config(path)` builds the tools of a tool config file, yaml or json (veRL's
`tools: [{class_name, config: {type: native, ...}, tool_schema}]`; `tool_schema` may be left out
when the class declares it in `get_openai_tool_schema()`); `load_all_tools` adds a
`function_tool_path` file's tools and refuses two tools with one name.
"""

from __future__ import annotations

from hybridrl.tools.tool import BaseTool
from hybridrl.tools.tool_loading import import_object, load_tools, load_tools_from_yaml

__all__ = ["get_tool_class", "initialize_tools_from_config", "load_all_tools"]


def get_tool_class(cls_name: str) -> type:
    """The class at the import path `cls_name`."""
    return import_object(cls_name, "tool class_name")


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    return load_tools_from_yaml(tools_config_file)


def load_all_tools(tool_config_path: str | None, function_tool_path: str | None) -> list[BaseTool]:
    return list(load_tools(tool_config_path, function_tool_path).values())
