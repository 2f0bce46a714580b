"""Typed configuration of multi-turn rollouts: `actor_rollout_ref.rollout.multi_turn.*` and
`actor_rollout_ref.rollout.agent.*`.

Key names and defaults follow veRL's rollout config, so veRL command lines carry over:

* `multi_turn.enable`: route generation through the agent loops (also implied when the batch
  carries an `agent_name` column).
* `multi_turn.max_assistant_turns` / `max_user_turns`: stop a trajectory after that many
  assistant turns / tool-response turns (null: only the length budget stops it).
* `multi_turn.max_parallel_calls`: tool calls executed per assistant turn (the first N parsed).
* `multi_turn.max_tool_response_length` / `tool_response_truncate_side` (left | right | middle):
  a tool response longer than this many characters is cut on that side.
* `multi_turn.tool_config_path`: veRL's tool yaml (`tools: [{class_name, config, tool_schema}]`).
* `multi_turn.interaction_config_path`: veRL's interaction yaml (`interaction: [{name, class_name,
  config}]`): a simulated user answers assistant turns that call no tool (interaction.py).
* `multi_turn.format`: the tool-call format the policy writes (`hermes`: `<tool_call>{json}</tool_call>`).
* `multi_turn.tokenization_sanity_check_mode`: `strict` | `ignore_strippable` | `disable`:
  compare the turn-by-turn token ids with a whole-conversation tokenisation.

hybridrl additions (not in veRL, documented in docs/agent.md):

* `multi_turn.function_tool_path`: a Python file whose `@function_tool` functions become tools.
* `multi_turn.tool_timeout_s`: seconds a tool call may take before it counts as a timeout.
* `multi_turn.interaction_timeout_s`: seconds one interaction call (`start_interaction`,
  `generate_response`, `finalize_interaction`) may take; past it the trajectory ends (counted in
  `interaction_timeouts`, a warning names the key).
* `agent.max_concurrent_trajectories`: trajectories in flight per rollout replica.
* `agent.batch_wait_ms`: how long the batching queue waits for more requests once one arrives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

KEY = "actor_rollout_ref.rollout"
TRUNCATE_SIDES = ("left", "right", "middle")
SANITY_MODES = ("strict", "ignore_strippable", "disable")


@dataclass
class MultiTurnConfig:
    """`actor_rollout_ref.rollout.multi_turn`: tools and turn limits of the tool agent."""

    enable: bool = False  # route generation through the agent loops (tools, turns)
    max_assistant_turns: int | None = None  # stop a trajectory after N assistant turns (null: no limit)
    max_user_turns: int | None = None  # stop after N tool-response / user turns (null: no limit)
    max_parallel_calls: int = 1  # tool calls executed per assistant turn (the first N)
    max_tool_response_length: int = 256  # a longer tool response (characters) is cut
    tool_response_truncate_side: str = "middle"  # where it is cut: left, right or middle
    tool_config_path: str | None = None  # veRL's tool yaml
    interaction_config_path: str | None = None  # veRL's interaction yaml (a simulated user)
    function_tool_path: str | None = None  # a Python file whose @function_tool functions become tools
    tool_timeout_s: float = 30.0  # seconds a tool call may take before it counts as a timeout
    interaction_timeout_s: float = 60.0
    format: str = "hermes"  # tool-call format the policy writes (hermes)
    tokenization_sanity_check_mode: str = "strict"  # strict, ignore_strippable or disable


@dataclass
class AgentConfig:
    """`actor_rollout_ref.rollout.agent`: which agent loop runs a row, and concurrency."""

    default_agent_loop: str = "single_turn_agent"  # agent loop of rows without an agent_name column
    agent_loop_config_path: str | None = None  # yaml list of {name, _target_} agent loops
    max_concurrent_trajectories: int = 256  # trajectories in flight per rollout replica
    batch_wait_ms: float = 2.0  # how long the batching queue waits for more requests


def _check(ok: bool, key: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{KEY}.{key}={value!r} is invalid: {want}.")


def validate_multi_turn_config(cfg: MultiTurnConfig) -> None:
    """Fail at start-up, naming the key and the fix."""
    for key in ("max_assistant_turns", "max_user_turns"):
        v = getattr(cfg, key)
        _check(v is None or v >= 1, f"multi_turn.{key}", v, "use a positive number or null (no limit)")
    _check(cfg.max_parallel_calls >= 1, "multi_turn.max_parallel_calls", cfg.max_parallel_calls, "use >= 1")
    _check(
        cfg.max_tool_response_length >= 1,
        "multi_turn.max_tool_response_length",
        cfg.max_tool_response_length,
        "use >= 1 (characters)",
    )
    _check(
        cfg.tool_response_truncate_side in TRUNCATE_SIDES,
        "multi_turn.tool_response_truncate_side",
        cfg.tool_response_truncate_side,
        f"use one of {TRUNCATE_SIDES}",
    )
    for key in ("tool_timeout_s", "interaction_timeout_s"):
        v = getattr(cfg, key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        _check(ok, f"multi_turn.{key}", v, "use seconds > 0")
    _check(
        cfg.tokenization_sanity_check_mode in SANITY_MODES,
        "multi_turn.tokenization_sanity_check_mode",
        cfg.tokenization_sanity_check_mode,
        f"use one of {SANITY_MODES}",
    )
    for key in ("tool_config_path", "interaction_config_path", "function_tool_path"):
        path = getattr(cfg, key)
        _check(
            path is None or os.path.isfile(os.path.expanduser(path)),
            f"multi_turn.{key}",
            path,
            "no such file; point it at an existing file or leave it null",
        )


def validate_agent_config(cfg: AgentConfig) -> None:
    _check(
        isinstance(cfg.default_agent_loop, str) and bool(cfg.default_agent_loop),
        "agent.default_agent_loop",
        cfg.default_agent_loop,
        "name a registered agent loop (single_turn_agent, tool_agent, or one from agent_loop_config_path)",
    )
    _check(
        cfg.max_concurrent_trajectories >= 1,
        "agent.max_concurrent_trajectories",
        cfg.max_concurrent_trajectories,
        "use >= 1",
    )
    _check(cfg.batch_wait_ms >= 0, "agent.batch_wait_ms", cfg.batch_wait_ms, "use milliseconds >= 0")
    path = cfg.agent_loop_config_path
    _check(
        path is None or os.path.isfile(os.path.expanduser(path)),
        "agent.agent_loop_config_path",
        path,
        "no such file; point it at a yaml list of {name, _target_} entries or leave it null",
    )
