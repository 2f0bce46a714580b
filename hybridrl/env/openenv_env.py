"""`openenv`: play an OpenEnv environment (PyPI `openenv-core`) through its own client.

An OpenEnv environment is a server (its `Environment` class behind openenv-core's `create_app`, run
with uvicorn, from a Docker image, or a Hugging Face Space) that keeps one environment instance per
WebSocket session. Each episode of a row with `extra_info.env_name: openenv` opens one session with
openenv-core's `GenericEnvClient` (in the episode's own process, hybridrl.env.host), so the
environment's own code computes every observation, reward and `done`:

    reset(row)   -> client.reset(**reset_kwargs); the observation becomes the first user message
                    (or, with `first_message: row`, the row's own prompt is kept)
    step(action) -> client.step({action_field: the assistant's text}); the observation's
                    `observation_field` is the next user message; reward None counts as 0

Constructor arguments (`extra_info.env_kwargs`):

| argument | default | meaning |
|---|---|---|
| `base_url` | required | the server, e.g. `http://127.0.0.1:8000` |
| `action_field` | `message` | the action's text field (the environment's Action model) |
| `observation_field` | null | the observation field shown to the policy; null: the whole observation as JSON |
| `first_message` | `observation` | `observation` (reset's observation) or `row` (the row's prompt) |
| `reset_kwargs` | `{}` | keyword arguments of `reset` (a seed, a task id, ...) |
| `message_timeout_s` | 60 | the client's timeout per message |

The server must allow as many concurrent sessions as episodes run at once (`create_app(...,
max_concurrent_envs=N)`; its environment class must then set `SUPPORTS_CONCURRENT_SESSIONS`);
a session the server refuses ends that episode as an environment error (reward 0, counted in
`env/errors`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

from hybridrl.env.base import Environment, register_environment

__all__ = ["OpenEnvEnvironment"]


try:  # imported with this module, so the episodes' fork server imports it once (hybridrl.env.host)
    from openenv.core.generic_client import GenericEnvClient
except ImportError:  # pragma: no cover - depends on the extra
    GenericEnvClient = None


async def _call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a client method of either openenv-core API: the async client (0.2.3 and newer) is awaited,
    the blocking one (0.2.1-0.2.2) runs in a thread so the episode's event loop keeps turning."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    out = await asyncio.to_thread(method, *args, **kwargs)
    return await out if inspect.isawaitable(out) else out


def _client_class():
    if GenericEnvClient is None:
        raise ImportError(
            "the `openenv` environment needs openenv-core: pip install 'hybridrl[envs]' (or openenv-core)"
        )
    return GenericEnvClient


@register_environment("openenv")
class OpenEnvEnvironment(Environment):
    """One episode of an OpenEnv server's environment (see the module docstring)."""

    def __init__(
        self,
        base_url: str | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        first_message: str = "observation",
        reset_kwargs: dict[str, Any] | None = None,
        message_timeout_s: float = 60.0,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"openenv: unknown env_kwargs {sorted(unknown)}; known: base_url, action_field, "
                "observation_field, first_message, reset_kwargs, message_timeout_s"
            )
        if not base_url:
            raise ValueError(
                "openenv: env_kwargs.base_url is required (the OpenEnv server, e.g. http://127.0.0.1:8000)"
            )
        if first_message not in ("observation", "row"):
            raise ValueError(f"openenv: first_message must be 'observation' or 'row', got {first_message!r}")
        self.base_url, self.action_field, self.observation_field = base_url, action_field, observation_field
        self.first_message, self.reset_kwargs = first_message, dict(reset_kwargs or {})
        self.message_timeout_s = float(message_timeout_s)
        self.client = None

    def observation_text(self, observation: Any) -> str:
        """The text the policy sees: the observation's `observation_field`, or the observation as JSON."""
        if not isinstance(observation, dict):
            return str(observation)
        if self.observation_field is None:
            return json.dumps(observation, sort_keys=True, default=str)
        if self.observation_field not in observation:
            raise KeyError(
                f"openenv: the observation has no field {self.observation_field!r} (env_kwargs.observation_field); "
                f"it has {sorted(observation)}"
            )
        return str(observation[self.observation_field])

    async def reset(self, row: dict[str, Any]) -> str | None:
        client_cls = _client_class()
        self.client = client_cls(base_url=self.base_url, message_timeout_s=self.message_timeout_s)
        await _call(self.client.connect)
        result = await _call(self.client.reset, **self.reset_kwargs)
        return None if self.first_message == "row" else self.observation_text(result.observation)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        result = await _call(self.client.step, {self.action_field: action})
        reward = 0.0 if result.reward is None else float(result.reward)
        return self.observation_text(result.observation), reward, bool(result.done), {}

    async def close(self) -> None:
        if self.client is not None:
            await _call(self.client.close)
            self.client = None
