"""The OpenAI wire format of the rollout server: request checks and response bodies (pure functions).

Supported request fields (anything else is refused with 400, naming the field):

- chat (`/v1/chat/completions`): `model`, `messages`, `tools`, `tool_choice` (`auto` | `none`),
  `parallel_tool_calls`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `n` (1),
  `stream` (false), `logprobs`, `top_logprobs` (0), `user` (the trajectory id, see gateway.py).
- completions (`/v1/completions`): `model`, `prompt` (a string or a list of token ids), `max_tokens`,
  `temperature`, `top_p`, `n` (1), `stream` (false), `logprobs` (0/1/null: the sampled token's
  log-prob), `echo` (false), `user`.

Sampling is the trainer's (`actor_rollout_ref.rollout.temperature` / `top_p` / `top_k`, and
`val_kwargs` for validation trajectories): the recorded log-probs must be the behaviour policy's.
A request may repeat those values or leave them out; another value is refused with 400.

Responses follow OpenAI's shapes, plus (as vLLM's `return_token_ids`) `prompt_token_ids` at the top
and `token_ids` in each choice: the exact ids the trainer records.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hybridrl.utils import openai_wire
from hybridrl.utils.openai_wire import error_body

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "RequestError",
    "chat_response",
    "completion_response",
    "error_body",
    "message_text",
    "parse_chat_request",
    "parse_completion_request",
]

CHAT_FIELDS = openai_wire.CHAT_FIELDS | {"tools", "tool_choice", "parallel_tool_calls", "top_logprobs"}
COMPLETION_FIELDS = openai_wire.COMPLETION_FIELDS | {"echo"}
ROLES = ("system", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the server refuses: HTTP `status` and an OpenAI error body naming `param`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ChatRequest:
    """A checked chat request. messages: OpenAI messages; max_tokens: None = the trajectory's budget."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    max_tokens: int | None
    logprobs: bool


@dataclass
class CompletionRequest:
    """A checked completion request: prompt ids (a string prompt is tokenised by the caller)."""

    prompt: str | list[int]
    max_tokens: int | None
    logprobs: bool


def _unknown(body: dict, allowed: frozenset[str]) -> None:
    extra = openai_wire.unsupported_fields(body, allowed)
    if extra:
        raise RequestError(
            400, f"unsupported field(s) {extra}; the rollout server accepts {sorted(allowed)}", extra[0]
        )


def _check_common(body: dict, sampling: Any) -> None:
    """n, stream and the sampling fields (they must agree with the trainer's sampling)."""
    if body.get("n", 1) not in (1, None):
        raise RequestError(400, "n must be 1 (one trajectory per request; ask for more tasks instead)", "n")
    if body.get("stream"):
        raise RequestError(
            400, "stream=true is not supported by the rollout server; use stream=false", "stream"
        )
    want_t = 0.0 if sampling.greedy else float(sampling.temperature)
    t = body.get("temperature")
    if t is not None and not (isinstance(t, int | float) and abs(float(t) - want_t) < 1e-6):
        raise RequestError(
            400,
            f"temperature={t!r} differs from the trainer's sampling (temperature {want_t:g}; set by "
            "actor_rollout_ref.rollout.temperature, val_kwargs for validation); omit it or send that value",
            "temperature",
        )
    want_p = 1.0 if sampling.greedy else float(sampling.top_p)
    p = body.get("top_p")
    if p is not None and not (isinstance(p, int | float) and abs(float(p) - want_p) < 1e-6):
        raise RequestError(
            400,
            f"top_p={p!r} differs from the trainer's top_p {want_p:g}; omit it or send that value",
            "top_p",
        )


def _max_tokens(body: dict, *keys: str) -> int | None:
    for key in keys:
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise RequestError(400, f"{key} must be a positive integer, got {v!r}", key)
        return v
    return None


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, f"{where}.content must be a string or a list of text parts", where)


def parse_chat_request(body: Any, sampling: Any) -> ChatRequest:
    """Check a `/v1/chat/completions` body (RequestError 400 naming the field)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _unknown(body, CHAT_FIELDS)
    _check_common(body, sampling)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}] needs a role in {ROLES}", f"messages[{i}].role")
        message_text(m.get("content"), f"messages[{i}]")
    if body.get("logprobs") and body.get("top_logprobs"):
        raise RequestError(
            400,
            "top_logprobs > 0 is not supported (the sampled token's log-prob is returned)",
            "top_logprobs",
        )
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(
            400, f"tool_choice={choice!r} is not supported; use 'auto' or 'none'", "tool_choice"
        )
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "tools must be a list of {type: function, function: {...}} objects", "tools")
    return ChatRequest(
        messages=msgs,
        tools=tools or None,
        parse_tools=choice != "none",
        max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
        logprobs=bool(body.get("logprobs")),
    )


def parse_completion_request(body: Any, sampling: Any) -> CompletionRequest:
    """Check a `/v1/completions` body (RequestError 400 naming the field)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _unknown(body, COMPLETION_FIELDS)
    _check_common(body, sampling)
    if body.get("echo"):
        raise RequestError(400, "echo=true is not supported", "echo")
    prompt = body.get("prompt")
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
    if not (ok_ids or (isinstance(prompt, str) and prompt)):
        raise RequestError(
            400, "prompt must be a non-empty string or a list of token ids (one prompt)", "prompt"
        )
    lp = body.get("logprobs")
    if lp not in (None, 0, 1, True, False):
        raise RequestError(
            400, f"logprobs={lp!r}: only the sampled token's log-prob is returned; use 0 or 1", "logprobs"
        )
    return CompletionRequest(prompt, _max_tokens(body, "max_tokens"), bool(lp))


def _usage(n_prompt: int, n_new: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}


def chat_response(
    model: str,
    text: str,
    calls: list[Any],
    finish_reason: str,
    prompt_ids: list[int],
    token_ids: list[int],
    log_probs: list[float],
    tokens: list[str] | None,
) -> dict[str, Any]:
    """A `chat.completion` object. calls: parsed ToolCalls (name, arguments); tokens: the decoded
    token strings when log-probs were asked for, else None."""
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:16]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text if (text or not tool_calls) else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }
    choice["logprobs"] = (
        {
            "content": [
                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(tokens, log_probs)
            ]
        }
        if tokens is not None
        else None
    )
    return _envelope("chatcmpl", "chat.completion", model, choice, prompt_ids, token_ids)


def completion_response(
    model: str,
    text: str,
    finish_reason: str,
    prompt_ids: list[int],
    token_ids: list[int],
    log_probs: list[float],
    tokens: list[str] | None,
) -> dict[str, Any]:
    """A `text_completion` object (logprobs in the legacy shape when asked for)."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }
    choice["logprobs"] = (
        {"tokens": tokens, "token_logprobs": log_probs, "top_logprobs": None, "text_offset": None}
        if tokens is not None
        else None
    )
    return _envelope("cmpl", "text_completion", model, choice, prompt_ids, token_ids)


def _envelope(
    id_prefix: str, kind: str, model: str, choice: dict[str, Any], prompt_ids: list[int], token_ids: list[int]
) -> dict[str, Any]:
    """The response object around one choice (OpenAI's fields, plus the prompt's token ids)."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(len(prompt_ids), len(token_ids)),
        "prompt_token_ids": prompt_ids,
    }
