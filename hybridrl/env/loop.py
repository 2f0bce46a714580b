"""`env_agent`: the agent loop that plays a row's environment (hybridrl.env.base).

Token-in, token-out like the tool agent: the prompt is the row's prompt ids (or, when `reset`
returns messages or a first user message, their chat-template rendering; or the token ids it
returns), each assistant turn is generated (mask 1) and handed to the environment as an `Action`
(its text and its token ids), each observation is appended as a user turn rendered by the chat
template, or as the token ids the environment returned (mask 0; ids outside the vocabulary are a
malformed step). The loop ends when the environment says done, at `multi_turn.max_assistant_turns`
(when set), or when the response budget runs out.

The environment runs in a process of its own (hybridrl.env.host) with a deadline per call:
`timeout_s` (default 30 s; `start_timeout_s`, default 120 s, for starting the process and building
the environment), constructor arguments set in `rollout.agent.agent_loop_config_path`
(`- {name: env_agent, _target_: hybridrl.env.loop.EnvAgentLoop, timeout_s: 10}`). A fault (it
raised, passed the deadline, returned malformed output, or could not start) ends the trajectory:
the sample's reward is 0, the error is logged, and the step metrics count it (`env/errors`,
`env/timeouts`, `env/malformed`).

Outputs: `reward_score` = the sum of the step rewards (0 after a fault), `turn_scores` = the step
rewards; the runner adds the column `env_reward`, and the reward manager shows both to the score
function in the row's `extra_info` as `env_reward` / `env_turn_rewards` (the `hybridrl/env` data
source's scorer returns them).
"""

from __future__ import annotations

import logging
from typing import Any

from hybridrl.agent.loop import AgentLoopBase, AgentLoopOutput, register_agent_loop
from hybridrl.agent.tokenization import ToolTurnRenderer, conversation_ids
from hybridrl.env.base import ENV_DATA_SOURCE, Action, get_environment_class
from hybridrl.env.host import EnvironmentFault, EpisodeProcess, is_token_ids
from hybridrl.rollout.base import SamplingSpec

logger = logging.getLogger(__name__)

__all__ = ["EnvAgentLoop", "ENV_DATA_SOURCE"]

DEFAULT_TIMEOUT_S = 30.0


def row_env(row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    name = row.get("env_name") or extra.get("env_name")
    if not isinstance(name, str):
        raise ValueError(
            "a row with agent_name=env_agent needs extra_info.env_name (a registered environment); "
            f"got {name!r}. Add it in the data preprocessing."
        )
    kwargs = extra.get("env_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"extra_info.env_kwargs must be a mapping of constructor arguments; got {kwargs!r}")
    return name, dict(kwargs)


@register_agent_loop("env_agent")
class EnvAgentLoop(AgentLoopBase):
    """Plays one episode of the row's environment (see the module docstring)."""

    def __init__(self, context, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        self.mt = context.config.multi_turn
        self.renderer = ToolTurnRenderer(context.tokenizer)
        self.timeout_s = float(kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.start_timeout_s = float(kwargs.get("start_timeout_s", 120.0))
        if not self.timeout_s > 0:
            raise ValueError(f"env_agent timeout_s must be > 0, got {self.timeout_s}")

    async def run(
        self, sampling: SamplingSpec, *, prompt_ids: list[int], seed: int, **row: Any
    ) -> AgentLoopOutput:
        name, kwargs = row_env(row)
        env_cls = get_environment_class(name)
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] | None = [] if self.context.want_log_probs else None
        rewards: list[float] = []
        counts = {"env_errors": 0.0, "env_timeouts": 0.0, "env_malformed": 0.0}
        turns, truncated, prompt = 0, False, list(prompt_ids)
        episode = None
        try:
            episode = await EpisodeProcess.start(env_cls, kwargs, name, self.timeout_s, self.start_timeout_s)
            obs = await episode.reset(_plain_row(row))
            prompt = self._prompt(prompt, row.get("raw_prompt"), obs, name)
            while True:
                budget = self.context.response_length - len(ids)
                if budget <= 0:
                    truncated = True
                    break
                gen = await self.generate(prompt + ids, sampling, seed, turns, budget)
                _append(ids, mask, lps, gen.token_ids, 1, gen.log_probs)
                turns += 1
                if not self.ended_with_eos(gen.token_ids):
                    truncated = True
                    break
                text = self.context.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                obs, reward, done, _info = await episode.step(Action(text, gen.token_ids))
                rewards.append(reward)
                if done or (self.mt.max_assistant_turns and turns >= self.mt.max_assistant_turns):
                    break
                new_ids = (
                    self._vocab_ids(obs, name)
                    if isinstance(obs, list)
                    else self.renderer.ids([obs], role="user")
                )
                room = self.context.response_length - len(ids)
                _append(ids, mask, lps, new_ids[:room], 0, None)
                if len(new_ids) >= room:
                    truncated = True
                    break
        except EnvironmentFault as e:
            counts[{"timeout": "env_timeouts", "malformed": "env_malformed"}.get(e.kind, "env_errors")] = 1.0
            logger.warning("environment %r fault (%s); this sample is scored 0: %s", name, e.kind, e)
            rewards = []
        finally:
            if episode is not None:
                await episode.close()
        total = float(sum(rewards))
        metrics = {
            "assistant_turns": float(turns),
            "truncated": float(truncated),
            "env_reward": total,
            **counts,
        }
        out = AgentLoopOutput(prompt, ids, mask, lps, 1 + 2 * turns, total, metrics)
        out.extra_fields["turn_scores"] = list(rewards)
        out.extra_fields["env_reward"] = total
        return out

    def _vocab_ids(self, ids: list[int], name: str) -> list[int]:
        """An environment's token ids, checked against the tokenizer's vocabulary."""
        vocab = len(self.context.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EnvironmentFault(
                "malformed",
                f"environment {name!r} returned token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}",
            )
        return list(ids)

    def _prompt(self, prompt_ids: list[int], raw_prompt: Any, obs: Any, name: str) -> list[int]:
        """The dataset's prompt (obs None), the reset's token ids, or the chat rendering of its
        conversation."""
        if obs is None:
            return list(prompt_ids)
        if is_token_ids(obs):
            return self._vocab_ids(obs, name)
        messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)
        if isinstance(obs, str) and raw_prompt is not None:
            messages = [m for m in raw_prompt if m.get("role") == "system"] + messages
        return conversation_ids(self.context.tokenizer, messages, True, None)


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns an environment may read (plain Python values; numpy arrays as lists)."""
    out = {}
    for k, v in row.items():
        if k == "multi_modal_inputs":
            continue
        out[k] = v.tolist() if hasattr(v, "tolist") else v
    return out


def _append(ids, mask, lps, new_ids, flag: int, new_lps) -> None:
    ids += list(new_ids)
    mask += [flag] * len(new_ids)
    if lps is not None:
        lps += list(new_lps) if new_lps is not None else [0.0] * len(new_ids)
