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
overruns `multi_turn.tool_timeout_s` is left behind, not waited on), and its return value is the
tool response (`normalize_tool_return`: a ToolResponse, a string, a dict as JSON, or a
(response, reward, metrics) tuple, as veRL's function tools).

veRL's newest tool API under the same module names is `hybridrl.tools` (base_tool, schemas,
function_tool, tool_registry): a veRL tool changes only its import line.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.tools.tool_runner import run_sync_detached

__all__ = [
    "BaseTool",
    "FunctionTool",
    "create_arguments",
    "ToolResponse",
    "function_tool",
    "is_function_tool",
    "mark_function_tool",
    "normalize_tool_return",
    "schema_dict",
    "validate_tool_schema",
]

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_FUNCTION_TOOL_ATTR = "__hybridrl_function_tool__"


@dataclass
class ToolResponse:
    """What a tool gives back to the conversation (veRL's fields: text, and lists of images / videos
    for vision-language models)."""

    text: str | None = ""
    image: list[Any] | None = None
    video: list[Any] | None = None

    def __post_init__(self) -> None:
        for name in ("image", "video"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise ValueError(
                    f"ToolResponse.{name} must be a list, got {type(value).__name__}; wrap a single one: "
                    f"ToolResponse({name}=[x])"
                )

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


def schema_dict(schema: Any) -> Any:
    """A tool schema as a plain dict (pydantic models from hybridrl.tools.schemas are dumped)."""
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_none=True)
    if hasattr(schema, "items") and not isinstance(schema, dict):
        return dict(schema)
    return schema


def _coerce_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=value if isinstance(value, str) else str(value))


def normalize_tool_return(ret: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
    """A function tool's return value -> (response, reward, metrics), veRL's accepted shapes.

    ToolResponse / str / dict (as JSON) / anything else (its str) -> (that, 0.0, {});
    (response,), (response, reward), (response, reward, metrics) with None meaning 0.0 / {}.
    A tuple of any other length is a TypeError (almost always a bug in the tool).
    """
    if not isinstance(ret, tuple):
        return _coerce_response(ret), 0.0, {}
    if not 1 <= len(ret) <= 3:
        raise TypeError(
            f"a tool's return tuple must be (response,), (response, reward) or (response, reward, metrics); "
            f"got {len(ret)} items: {ret!r}"
        )
    reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
    metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
    return _coerce_response(ret[0]), reward, metrics


def validate_tool_schema(schema: Any, where: str) -> dict[str, Any]:
    """Check an OpenAI function schema `{"type": "function", "function": {"name", ...}}`.

    Returns:
        The schema as a plain dict with `function.parameters` defaulted to an empty object.
    """
    schema = schema_dict(schema)
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
        tool_schema: the OpenAI function schema of the tool: a dict, or veRL's
            `OpenAIFunctionToolSchema` (hybridrl.tools.schemas); None takes the one the subclass's
            `get_openai_tool_schema()` declares (veRL's tools without a yaml `tool_schema`).
    """

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        where = type(self).__qualname__
        if tool_schema is None:
            if type(self).get_openai_tool_schema is BaseTool.get_openai_tool_schema:
                raise ValueError(
                    f"{where}: no tool_schema; give `tool_schema` in the tool yaml entry or override "
                    "get_openai_tool_schema() in the class"
                )
            tool_schema = self.get_openai_tool_schema()
        self.schema = validate_tool_schema(tool_schema, where)  # the plain dict the chat template gets
        # veRL's pydantic schema stays as given (its tools read `self.tool_schema.function.name`)
        self.tool_schema = tool_schema if hasattr(tool_schema, "model_dump") else self.schema
        self.name: str = self.schema["function"]["name"]
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> Any:
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


def create_arguments(tool: BaseTool, create_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `tool.create` gets for the row's `create_kwargs`.

    hybridrl (and veRL before its agent-loop rewrite) spreads them (`create(ground_truth=...)`);
    veRL's newest loop passes them whole (`create(create_kwargs={...})`). A `create` that takes
    `**kwargs` gets both spellings, so tools written for either read their arguments; one that
    names a `create_kwargs` parameter gets them whole; otherwise they are spread (an argument the
    tool does not take is its TypeError, which the agent loop turns into an error response).
    """
    params = inspect.signature(tool.create).parameters
    whole = {"create_kwargs": dict(create_kwargs)}
    if "create_kwargs" in create_kwargs:
        return dict(create_kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return {**create_kwargs, **whole}
    return whole if "create_kwargs" in params else dict(create_kwargs)


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
    schema: dict[str, Any] | None = None  # a whole OpenAI schema given by the decorator (veRL's schema=)


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


def mark_function_tool(fn: Callable, schema: dict[str, Any]) -> Callable:
    """Mark `fn` as a tool with a whole (validated) OpenAI schema; returns `fn`."""
    f = schema["function"]
    spec = _FunctionSpec(fn, f["name"], f.get("description", ""), f["parameters"], schema=schema)
    setattr(fn, _FUNCTION_TOOL_ATTR, spec)
    return fn


def is_function_tool(obj: Any) -> bool:
    return callable(obj) and isinstance(getattr(obj, _FUNCTION_TOOL_ATTR, None), _FunctionSpec)


class FunctionTool(BaseTool):
    """A `@function_tool` function as a BaseTool (stateless: create/release are trivial)."""

    def __init__(self, fn: Callable) -> None:
        if not is_function_tool(fn):
            raise TypeError(f"FunctionTool needs a @function_tool function; got {fn!r}")
        spec: _FunctionSpec = getattr(fn, _FUNCTION_TOOL_ATTR)
        schema = spec.schema or {
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
        return normalize_tool_return(result)
