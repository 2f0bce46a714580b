"""veRL's function tools (`verl.tools.function_tool`) under hybridrl's import path.

`@function_tool`, `@function_tool("name")` or `@function_tool(schema={...})` registers a plain
function as a tool, as veRL does: the OpenAI schema is inferred by transformers'
`get_json_schema` (so the function needs a Google-style docstring with an `Args:` block and a type
hint on every parameter; transformers says which is missing), or taken from `schema=` (a dict or an
OpenAIFunctionToolSchema). Registered functions are found by `multi_turn.function_tool_path` like
hybridrl's own `@function_tool`; their return value may be a ToolResponse, a string, a dict (sent
as JSON) or a (response, reward, metrics) tuple (hybridrl.tools.tool.normalize_tool_return).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from hybridrl.tools.tool import (
    FunctionTool,
    mark_function_tool,
    normalize_tool_return,
    schema_dict,
    validate_tool_schema,
)

__all__ = [
    "FUNCTION_TOOL_REGISTRY",
    "FunctionTool",
    "ToolResponse",
    "function_tool",
    "get_function_tool",
    "load_function_tools_from_path",
    "normalize_function_tool_return",
]

FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}
normalize_function_tool_return = normalize_tool_return


def _inferred_schema(fn: Callable, name: str) -> dict[str, Any]:
    variadic = [
        n for n, p in inspect.signature(fn).parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if variadic:
        raise ValueError(
            f"@function_tool {name!r} ({fn.__module__}.{fn.__qualname__}) has variadic parameters {variadic}, "
            "which an OpenAI tool schema cannot express; name every parameter"
        )
    from transformers.utils import get_json_schema

    raw = get_json_schema(fn)
    raw["function"]["name"] = name
    return raw


def _origin(fn: Callable) -> tuple[str, str]:
    """Where a function is defined: the same file loaded again (function_tool_path is executed by
    every loader) re-registers its tools instead of colliding with itself."""
    code = getattr(fn, "__code__", None)
    return (code.co_filename if code else fn.__module__), fn.__qualname__


def _register(fn: Callable, name: str | None, schema: Any) -> Callable:
    name = name or fn.__name__
    where = f"@function_tool {name!r}"
    built = validate_tool_schema(
        schema_dict(schema) if schema is not None else _inferred_schema(fn, name), where
    )
    OpenAIFunctionToolSchema.model_validate(built)  # veRL's shape, checked as veRL checks it
    mark_function_tool(fn, built)
    name = built["function"]["name"]
    existing = FUNCTION_TOOL_REGISTRY.get(name)
    if existing is not None and _origin(existing.fn) != _origin(fn):
        raise ValueError(
            f"function tool {name!r} is already registered to {existing.fn.__module__}."
            f"{existing.fn.__qualname__}; rename one of them"
        )
    FUNCTION_TOOL_REGISTRY[name] = FunctionTool(fn)
    return fn


def function_tool(name: str | Callable | None = None, *, schema: Any = None) -> Callable:
    """Register a function as a tool: bare, with a name (`@function_tool("search")`), or with a
    whole schema (`schema=`); returns the function unchanged."""
    if callable(name):
        return _register(name, None, schema)
    return lambda fn: _register(fn, name, schema)


def get_function_tool(name: str) -> FunctionTool:
    """The registered tool `name`; KeyError naming the config key that loads tool files."""
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(
            f"function tool {name!r} is not registered; list the file that defines it in "
            "actor_rollout_ref.rollout.multi_turn.function_tool_path"
        )
    return FUNCTION_TOOL_REGISTRY[name]


def load_function_tools_from_path(path: str) -> list[FunctionTool]:
    """Execute the Python file `path` and return the tools it defines (veRL's name)."""
    from hybridrl.tools.tool_loading import load_function_tools

    return load_function_tools(path)
