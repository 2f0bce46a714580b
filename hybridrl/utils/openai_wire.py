"""The parts of OpenAI's HTTP API that hybridrl's two OpenAI-compatible servers share.

The agent loop's rollout server (`hybridrl.agent.server`) and the generative reward model's router
(`hybridrl.reward.genrm_router`) accept the request fields below, each adding the few it supports
beyond them, and answer a refused request with OpenAI's error object.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "error_body", "unsupported_fields"]

# the request fields both servers accept (`/v1/chat/completions`, `/v1/completions`)
CHAT_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
     "logprobs", "user"}
)  # fmt: skip
COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "user"}
)  # fmt: skip


def unsupported_fields(body: dict, allowed: frozenset[str] | set[str]) -> list[str]:
    """The fields of a request body that `allowed` does not name, sorted."""
    return sorted(set(body) - set(allowed))


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
