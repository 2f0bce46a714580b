"""Tool-call parsers: the text of one assistant turn -> (content, tool calls). Chosen by
`actor_rollout_ref.rollout.multi_turn.format`; register more with `@register_tool_parser(name)`.

`hermes` (Qwen2.5 / Hermes chat templates)::

    I will compute it. <tool_call>{"name": "calc", "arguments": {"expr": "123*45"}}</tool_call>

Each `<tool_call>...</tool_call>` block holds one JSON object with `name` (string) and
`arguments` (an object, or a JSON string of one). A block that is not valid JSON, lacks a
name, or is left unclosed is returned as a ToolCall with `error` set, never dropped silently:
the agent loop answers it with an error message the model sees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HermesToolParser", "ToolCall", "ToolCallParser", "get_tool_parser", "register_tool_parser"]


@dataclass
class ToolCall:
    """One parsed call. `error` is set (and `arguments` may be None) when the call is malformed."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str = ""
    error: str | None = None


class ToolCallParser:
    """Base class: `parse(text) -> (text without the calls, calls in order)`."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


_PARSERS: dict[str, type[ToolCallParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Class decorator: make a parser available as `multi_turn.format=<name>`."""

    def deco(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        if name in _PARSERS and _PARSERS[name] is not cls:
            raise ValueError(
                f"tool-call format {name!r} is already registered to {_PARSERS[name].__qualname__}"
            )
        _PARSERS[name] = cls
        return cls

    return deco


def get_tool_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise ValueError(
            f"unknown actor_rollout_ref.rollout.multi_turn.format={name!r}; known: {sorted(_PARSERS)}. "
            "Register one with hybridrl.agent.parser.register_tool_parser."
        )
    return _PARSERS[name]()


def parse_call_json(body: str) -> ToolCall:
    """One JSON call body -> ToolCall (error set when malformed)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, body, f"the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(None, None, body, 'the tool call needs {"name": <string>, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(obj["name"], None, body, f"the arguments are not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], None, body, "the arguments must be a JSON object")
    return ToolCall(obj["name"], args, body)


@register_tool_parser("hermes")
class HermesToolParser(ToolCallParser):
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [parse_call_json(m.group(1).strip()) for m in self._block.finditer(text)]
        rest = self._block.sub("", text)
        if self.open_tag in rest:  # an opened, never closed call (e.g. cut by the length limit)
            tail = rest[rest.index(self.open_tag) :]
            calls.append(ToolCall(None, None, tail, f"the tool call is not closed with {self.close_tag}"))
            rest = rest[: rest.index(self.open_tag)]
        return rest.strip(), calls
