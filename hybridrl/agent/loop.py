"""Agent loops: one coroutine drives one trajectory against the rollout engine.

    class MyAgent(AgentLoopBase):
        async def run(self, sampling, *, prompt_ids, seed, **row) -> AgentLoopOutput: ...

`run` gets the row's prompt ids, its sampling seed and every non-tensor column of the row
(`extra_info`, `raw_prompt`, `agent_name`, ...), and returns an AgentLoopOutput. Token-in,
token-out: the response is built by appending ids turn by turn (generated ids with mask 1, tool /
user / template ids with mask 0); earlier turns are never re-tokenised.

Registry (the plug point): `@register_agent_loop("name")`; built in `single_turn_agent` (today's
single-turn generation) and `tool_agent` (hybridrl.agent.tool_agent). A row picks its
loop with its `agent_name` column, else `rollout.agent.default_agent_loop`. Loops from
`rollout.agent.agent_loop_config_path` (veRL's format: a yaml list of `{name, _target_, ...}`; the
other keys are constructor kwargs) are registered at start-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.agent.engine import BatchingEngine, TokenGeneration
from hybridrl.agent.trace import set_span_outputs, span
from hybridrl.rollout.base import SamplingSpec, derive_seed

__all__ = [
    "AgentContext",
    "AgentLoopBase",
    "AgentLoopOutput",
    "SingleTurnAgentLoop",
    "get_agent_loop_class",
    "list_agent_loops",
    "load_agent_loop_config",
    "register_agent_loop",
]


@dataclass
class AgentLoopOutput:
    """One trajectory. L = len(response_ids) <= rollout.response_length.

    Attributes:
        prompt_ids: the prompt the trajectory started from.
        response_ids: (L,) every token after the prompt: generated turns, tool responses, templates.
        response_mask: (L,) 1 where the policy generated the token, 0 elsewhere.
        response_logprobs: (L,) rollout log-prob of each generated token (0 on mask-0), or None.
        num_turns: messages in the conversation, the prompt included (veRL's convention).
        reward_score: an optional trajectory reward (e.g. from tools' calc_reward).
        metrics: per-trajectory numbers (tool calls, errors, timeouts, truncation, ...).
        extra_fields: per-trajectory data that becomes a non-tensor column (e.g. `turn_scores`,
            the interaction's score of each user turn).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None
    num_turns: int
    reward_score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.response_mask) != n or (
            self.response_logprobs is not None and len(self.response_logprobs) != n
        ):
            raise ValueError(
                f"AgentLoopOutput: response_ids ({n}), response_mask ({len(self.response_mask)}) and "
                f"response_logprobs ({None if self.response_logprobs is None else len(self.response_logprobs)}) "
                "must have one entry per token"
            )


@dataclass
class AgentContext:
    """What every agent loop of one rollout replica shares.

    Attributes:
        config: the rollout section (RolloutConfig; multi_turn / agent sub-sections included).
        tokenizer: the policy tokenizer.
        engine: the batching front of the replica's rollout engine.
        tools: the run's tools by name.
        eos_token_ids: ids that end an assistant turn.
        want_log_probs: whether rollout log-probs are recorded (rollout.calculate_log_probs).
        interactions: the run's interactions by name (multi_turn.interaction_config_path).
        tracer: the replica's RolloutTracer (rollout.trace.*), or None.
        vision: a vision-language model's agent/vision.VisionTurns (tool images, pixel inputs of
            each request), or None for a text model.
    """

    config: Any
    tokenizer: Any
    engine: BatchingEngine
    tools: dict[str, Any]
    eos_token_ids: list[int]
    want_log_probs: bool
    interactions: dict[str, Any] = field(default_factory=dict)
    tracer: Any = None
    vision: Any = None

    @property
    def response_length(self) -> int:
        return int(self.config.response_length)


class AgentLoopBase:
    """Base class of agent loops. Subclasses implement `run`.

    Args:
        context: the replica's shared AgentContext.
        **kwargs: extra constructor arguments from agent_loop_config_path.
    """

    def __init__(self, context: AgentContext, **kwargs: Any) -> None:
        self.context = context
        self.kwargs = kwargs

    async def generate(
        self,
        ids: list[int],
        sampling: SamplingSpec,
        seed: int,
        turn: int,
        max_new_tokens: int,
        multi_modal_inputs: dict[str, Any] | None = None,
    ) -> TokenGeneration:
        """One assistant turn after `ids` (queued with the other trajectories' requests; a span
        of the trajectory's trace when rollout.trace is on). A VLM's `multi_modal_inputs` hold the
        pixel inputs of the images whose tokens `ids` holds, in order."""
        with span("generate", turn=turn, prompt_length=len(ids), max_new_tokens=max_new_tokens) as s:
            gen = await self.context.engine.generate(
                ids,
                sampling,
                derive_seed(seed, turn, 0),
                max_new_tokens,
                self.context.want_log_probs,
                multi_modal_inputs=multi_modal_inputs,
            )
            tracer = self.context.tracer
            set_span_outputs(s, token_ids=gen.token_ids, **(tracer.text(gen.token_ids) if tracer else {}))
        return gen

    def ended_with_eos(self, token_ids: list[int]) -> bool:
        return bool(token_ids) and token_ids[-1] in self.context.eos_token_ids

    async def run(
        self, sampling: SamplingSpec, *, prompt_ids: list[int], seed: int, **row: Any
    ) -> AgentLoopOutput:
        raise NotImplementedError(f"{type(self).__qualname__}.run is not implemented")


_LOOPS: dict[str, Callable[..., AgentLoopBase]] = {}
_LAZY_LOOPS = {
    "tool_agent": "hybridrl.agent.tool_agent",
    "external_agent": "hybridrl.agent.server.external_loop",
    "env_agent": "hybridrl.env.loop",
}


def register_agent_loop(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: rows with `agent_name == name` run this loop."""

    def deco(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise TypeError(f"register_agent_loop({name!r}): {cls!r} is not an AgentLoopBase subclass")
        known = _LOOPS.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"agent loop {name!r} is already registered to {known!r}; pick another name")
        _LOOPS[name] = cls
        return cls

    return deco


def list_agent_loops() -> list[str]:
    return sorted(set(_LOOPS) | set(_LAZY_LOOPS))


def get_agent_loop_class(name: str) -> Callable[..., AgentLoopBase]:
    """The loop factory registered as `name` (a class, or a class with config kwargs bound)."""
    if name not in _LOOPS and name in _LAZY_LOOPS:
        import importlib

        importlib.import_module(_LAZY_LOOPS[name])
    if name not in _LOOPS:
        raise ValueError(
            f"unknown agent loop {name!r} (a row's agent_name or actor_rollout_ref.rollout.agent."
            f"default_agent_loop); known: {list_agent_loops()}. Register one with @register_agent_loop "
            "or list it in rollout.agent.agent_loop_config_path."
        )
    return _LOOPS[name]


def load_agent_loop_config(path: str) -> list[str]:
    """Register the loops of a veRL-format agent-loop yaml; returns their names."""
    from omegaconf import OmegaConf

    from hybridrl.tools.tool_loading import import_object

    key = f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path!r}"
    entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(entries, list):
        raise ValueError(f"{key}: the yaml must be a list of {{name, _target_}} entries")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or "_target_" not in entry:
            raise ValueError(f"{key}: entry {i} needs `name` and `_target_` (import path of the class)")
        kwargs = {k: v for k, v in entry.items() if k not in ("name", "_target_")}
        cls = import_object(entry["_target_"], f"{key}, entry {i}")
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise TypeError(f"{key}: {entry['_target_']!r} is not an AgentLoopBase subclass")
        name = str(entry["name"])
        known = _LOOPS.get(name)
        factory = functools.partial(cls, **kwargs) if kwargs else cls
        if known is not None and known is not cls and not _same_factory(known, factory):
            raise ValueError(f"{key}: agent loop {name!r} is already registered to {known!r}")
        _LOOPS[name] = factory
        names.append(name)
    return names


def _same_factory(a: Any, b: Any) -> bool:
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func is b.func and a.keywords == b.keywords
    return a is b


@register_agent_loop("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One generation of up to response_length tokens: the behaviour of plain rollout."""

    async def run(
        self, sampling: SamplingSpec, *, prompt_ids: list[int], seed: int, **row: Any
    ) -> AgentLoopOutput:
        gen = await self.generate(
            prompt_ids, sampling, seed, 0, self.context.response_length, row.get("multi_modal_inputs")
        )
        n = len(gen.token_ids)
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=gen.token_ids,
            response_mask=[1] * n,
            response_logprobs=gen.log_probs,
            num_turns=2,
            metrics={"truncated": float(not self.ended_with_eos(gen.token_ids))},
        )
