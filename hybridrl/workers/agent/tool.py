"""Tools the policy can call: a base class with veRL's life cycle, and plain decorated functions.

Life cycle of one tool in one trajectory (veRL's `BaseTool` contract):

    instance_id = await tool.create(instance_id=None, **create_kwargs)   # first call in a trajectory
    response, reward, metrics = await tool.execute(instance_id, parameters, **execute_kwargs)
    ...                                                                   # more calls
    reward = await tool.calc_reward(instance_id, **calc_reward_kwargs)   # when the trajectory ends
    await tool.release(instance_id, **release_kwargs)

`create_kwargs` etc. come from the row's `extra_info["tools_kwargs"][tool_name]` (veRL's dataset
convention). Each tool carries its OpenAI function schema, which the tool agent passes to the chat
template (`tools=`), so the model sees the tool descriptions the way an OpenAI-style chat API
would show them.

A plain function becomes a tool with `@function_tool`: its signature and docstring give the schema,
it is called in a daemon thread of its own (so a slow function never stalls generation, and one that
overruns `multi_turn.tool_timeout_s` is left behind, not waited on), and the string of its return
value is the tool response.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.workers.agent.tool_runner import run_sync_detached

__all__ = [
    "BaseTool",
    "FunctionTool",
    "ToolResponse",
    "function_tool",
    "is_function_tool",
    "validate_tool_schema",
]

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_FUNCTION_TOOL_ATTR = "__hybridrl_function_tool__"


@dataclass
class ToolResponse:
    """What a tool gives back to the conversation (text only in hybridrl)."""

    text: str = ""


def validate_tool_schema(schema: Any, where: str) -> dict[str, Any]:
    """Check an OpenAI function schema `{"type": "function", "function": {"name", ...}}`.

    Returns:
        The schema as a plain dict with `function.parameters` defaulted to an empty object.
    """
    if hasattr(schema, "items") and not isinstance(schema, dict):
        schema = dict(schema)
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict):
        raise ValueError(
            f"{where}: tool_schema must be an OpenAI function schema "
            '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}; '
            f"got {schema!r}"
        )
    fn = dict(schema["function"])
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: tool_schema.function.name must be a non-empty string; got {name!r}")
    fn.setdefault("description", "")
    fn.setdefault("parameters", {"type": "object", "properties": {}, "required": []})
    return {"type": schema.get("type", "function"), "function": fn}


class BaseTool:
    """A tool with per-trajectory state. Subclass and override `execute` (and the other hooks as
    needed); the default `create` / `calc_reward` / `release` keep a dict of instances.

    Args:
        config: the `config` mapping of the tool's yaml entry (free-form, tool-specific).
        tool_schema: the OpenAI function schema (a dict) of the tool.
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        self.config = dict(config or {})
        self.tool_schema = validate_tool_schema(tool_schema, type(self).__qualname__)
        self.name: str = self.tool_schema["function"]["name"]
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start this tool's state for one trajectory; returns its instance id."""
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        """Run one call; returns (response, step reward, metrics). Raising is allowed: the agent
        loop turns the exception into an error response the model sees."""
        raise NotImplementedError(f"{type(self).__qualname__}.execute is not implemented")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The tool's reward for the whole trajectory (0 by default)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)


def _param_schema(fn: Callable) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation if p.annotation is not inspect.Parameter.empty else str
        if isinstance(ann, str):  # `from __future__ import annotations`
            ann = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}.get(
                ann, str
            )
        props[name] = {"type": _JSON_TYPES.get(ann, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": props, "required": required}


@dataclass
class _FunctionSpec:
    fn: Callable
    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)


def function_tool(
    fn: Callable | None = None, *, name: str | None = None, description: str | None = None
) -> Callable:
    """Mark a plain function as a tool (usable bare, `@function_tool`, or with arguments).

    The schema's parameters come from the signature (int/float/str/bool/list/dict annotations;
    parameters without a default are required), the description from the docstring's first
    paragraph. The function may be sync (run in a worker thread) or async.
    """

    def mark(f: Callable) -> Callable:
        doc = inspect.getdoc(f) or ""
        spec = _FunctionSpec(
            fn=f,
            name=name or f.__name__,
            description=description if description is not None else doc.split("\n\n")[0].strip(),
            parameters=_param_schema(f),
        )
        setattr(f, _FUNCTION_TOOL_ATTR, spec)
        return f

    return mark(fn) if fn is not None else mark


def is_function_tool(obj: Any) -> bool:
    return callable(obj) and isinstance(getattr(obj, _FUNCTION_TOOL_ATTR, None), _FunctionSpec)


class FunctionTool(BaseTool):
    """A `@function_tool` function as a BaseTool (stateless: create/release are trivial)."""

    def __init__(self, fn: Callable) -> None:
        if not is_function_tool(fn):
            raise TypeError(f"FunctionTool needs a @function_tool function; got {fn!r}")
        spec: _FunctionSpec = getattr(fn, _FUNCTION_TOOL_ATTR)
        schema = {
            "type": "function",
            "function": {"name": spec.name, "description": spec.description, "parameters": spec.parameters},
        }
        super().__init__({}, schema)
        self.fn = spec.fn

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:
            result = await run_sync_detached(self.fn, **parameters)  # not waited on after a deadline
        return ToolResponse(text=str(result)), 0.0, {}
