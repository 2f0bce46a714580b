"""`actor_rollout_ref.rollout.agent_server`: the rollout server of `rollout.mode=server` (hybridrl).

- `host`, `port`: where the OpenAI-compatible endpoint listens (`http://host:port/v1`; port 0
  picks a free port, printed at start-up).
- `max_in_flight`: generation requests (chat + completions) being served at once over all replicas;
  one more is answered 429 (back-pressure; the client retries).
- `reward_source`: `task` (the trainer's reward function scores each trajectory, as for the
  built-in agents) or `agent` (the agent reports the reward when it finishes the trajectory;
  a finish without one is refused with 400).
- `claim_timeout_s`: seconds a trajectory may wait for an agent to take it; then the step fails
  with a message saying where to point the agent.
- `trajectory_timeout_s`: seconds an agent may take for a claimed trajectory (between its first
  request and its finish); then the trajectory ends with what was generated, marked truncated
  (`agent_server/abandoned`).
- `request_timeout_s`: seconds the server waits for a replica's answer to one request (504 then).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AgentServerConfig", "REWARD_SOURCES", "validate_agent_server_config"]

REWARD_SOURCES = ("task", "agent")
_KEY = "actor_rollout_ref.rollout.agent_server"


@dataclass
class AgentServerConfig:
    """See the module docstring."""

    host: str = "127.0.0.1"  # address the OpenAI-compatible endpoint listens on
    port: int = 8000
    max_in_flight: int = 256
    reward_source: str = "task"
    claim_timeout_s: float = 600.0
    trajectory_timeout_s: float = 600.0
    request_timeout_s: float = 120.0


def _check(ok: bool, key: str, value, want: str) -> None:
    if not ok:
        raise ValueError(f"{_KEY}.{key}={value!r} is invalid: {want}.")


def validate_agent_server_config(cfg: AgentServerConfig) -> None:
    """Fail at start-up, naming the key and the fix."""
    _check(0 <= cfg.port <= 65535, "port", cfg.port, "use a TCP port in [0, 65535] (0 picks a free one)")
    _check(bool(cfg.host), "host", cfg.host, "use a host name or address, e.g. 127.0.0.1 or 0.0.0.0")
    _check(cfg.max_in_flight >= 1, "max_in_flight", cfg.max_in_flight, "use >= 1")
    _check(
        cfg.reward_source in REWARD_SOURCES,
        "reward_source",
        cfg.reward_source,
        f"use one of {REWARD_SOURCES}",
    )
    for key in ("claim_timeout_s", "trajectory_timeout_s", "request_timeout_s"):
        _check(getattr(cfg, key) > 0, key, getattr(cfg, key), "use seconds > 0")
