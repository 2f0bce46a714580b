"""`tool_agent`: generate, parse tool calls, run the tools, append their responses, repeat.

One trajectory (T = rollout.response_length tokens in all, across turns)::

    prompt -> [assistant turn (mask 1)] -> tool calls? -> [tool turn (mask 0)] -> [assistant turn] ...

It stops when an assistant turn calls no tool, at `multi_turn.max_assistant_turns` assistant
turns or `max_user_turns` tool turns, or when the budget T is used up (a tool turn that does not
fit is cut to the budget and the trajectory is marked truncated; the cut tokens are mask 0).
At most `max_parallel_calls` calls of a turn run (concurrently); each response is cut to
`max_tool_response_length` characters on `tool_response_truncate_side`.

Failures are data: a call with bad JSON, an unknown tool name, a tool that raises or takes longer
than `multi_turn.tool_timeout_s` gets an "Error: ..." text as its response, and is counted in the
trajectory's metrics (`tool_errors`, `tool_timeouts`). Nothing of that ends the step.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hybridrl.workers.agent.loop import AgentLoopBase, AgentLoopOutput, register_agent_loop
from hybridrl.workers.agent.parser import ToolCall, get_tool_parser
from hybridrl.workers.agent.tokenization import ToolTurnRenderer, check_tokenization, conversation_ids
from hybridrl.workers.agent.tool import ToolResponse
from hybridrl.workers.rollout.base import SamplingSpec

__all__ = ["ToolAgentLoop", "TrajectoryTools", "truncate_text"]

logger = logging.getLogger(__name__)
_TRUNC = "...(truncated)"


def truncate_text(text: str, max_len: int, side: str) -> str:
    """Cut `text` to `max_len` characters on `side`, marking the cut (veRL's convention)."""
    if len(text) <= max_len:
        return text
    if side == "left":  # keep the start
        return text[:max_len] + _TRUNC
    if side == "right":  # keep the end
        return "(truncated)..." + text[-max_len:]
    half = max_len // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (max_len - half) :]


class TrajectoryTools:
    """The tools of one trajectory: created on first use, released at the end, with counters.

    Args:
        tools: the run's tools by name.
        tools_kwargs: the row's `extra_info["tools_kwargs"]` ({name: {create_kwargs, execute_kwargs,
            calc_reward_kwargs, release_kwargs}}).
        timeout_s: seconds one call may take.
    """

    def __init__(self, tools: dict[str, Any], tools_kwargs: dict[str, Any] | None, timeout_s: float) -> None:
        self.tools = tools
        self.kwargs = dict(tools_kwargs or {})
        self.timeout_s = timeout_s
        self.instances: dict[str, str] = {}
        self.calls = self.errors = self.timeouts = 0
        self.step_reward = 0.0

    def _kw(self, name: str, stage: str) -> dict[str, Any]:
        return dict((self.kwargs.get(name) or {}).get(stage) or {})

    async def call(self, call: ToolCall) -> str:
        """Run one parsed call; returns the tool response text (an error text on failure)."""
        self.calls += 1
        if call.error is not None:
            self.errors += 1
            return f"Error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            self.errors += 1
            return f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(self.tools)) or 'none'}"
        try:
            if call.name not in self.instances:
                created = await tool.create(None, **self._kw(call.name, "create_kwargs"))
                self.instances[call.name] = created[0] if isinstance(created, tuple) else created
            result = await asyncio.wait_for(
                tool.execute(
                    self.instances[call.name], call.arguments, **self._kw(call.name, "execute_kwargs")
                ),
                timeout=self.timeout_s,
            )
        except asyncio.TimeoutError:
            self.timeouts += 1
            return f"Error: tool {call.name!r} timed out after {self.timeout_s:g}s"
        except Exception as e:  # a failing tool is data for the model, not a crash of the step
            self.errors += 1
            return f"Error: tool {call.name!r} raised {type(e).__name__}: {e}"
        response, reward = result, 0.0
        if isinstance(result, tuple):
            response = result[0]
            reward = float(result[1]) if len(result) > 1 and result[1] is not None else 0.0
        self.step_reward += reward
        return response.text if isinstance(response, ToolResponse) else str(response)

    async def finish(self) -> float | None:
        """calc_reward and release every created tool; the summed reward (None if no tool ran)."""
        if not self.instances:
            return None
        total = 0.0
        for name, instance_id in self.instances.items():
            tool = self.tools[name]
            try:
                total += float(await tool.calc_reward(instance_id, **self._kw(name, "calc_reward_kwargs")))
            except Exception as e:
                self.errors += 1
                logger.warning("tool %r calc_reward raised %s: %s", name, type(e).__name__, e)
            try:
                await tool.release(instance_id, **self._kw(name, "release_kwargs"))
            except Exception as e:
                logger.warning("tool %r release raised %s: %s", name, type(e).__name__, e)
        return total


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn generation with tool calls (see the module docstring)."""

    def __init__(self, context, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        self.mt = context.config.multi_turn
        self.parser = get_tool_parser(self.mt.format)
        self.renderer = ToolTurnRenderer(context.tokenizer)
        self.schemas = [t.get_openai_tool_schema() for t in context.tools.values()]

    def _prompt(self, prompt_ids: list[int], raw_prompt: Any) -> list[int]:
        """veRL: with `raw_prompt` (data.return_raw_chat) and tools, the prompt is rendered with the
        tool schemas (`tools=`); else the dataset's prompt ids are used as they are."""
        if raw_prompt is None or not self.schemas:
            return list(prompt_ids)
        return conversation_ids(self.context.tokenizer, list(raw_prompt), True, self.schemas)

    async def run(
        self, sampling: SamplingSpec, *, prompt_ids: list[int], seed: int, **row: Any
    ) -> AgentLoopOutput:
        ctx, mt = self.context, self.mt
        raw_prompt = row.get("raw_prompt")
        prompt = self._prompt(prompt_ids, raw_prompt)
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        tools = TrajectoryTools(
            ctx.tools, row.get("tools_kwargs") or extra.get("tools_kwargs"), mt.tool_timeout_s
        )
        ids, mask, lps = [], [], [] if ctx.want_log_probs else None
        messages: list[dict] = []
        turns = {"assistant": 0, "user": 0}
        truncated = False
        try:
            while True:
                budget = ctx.response_length - len(ids)
                if budget <= 0:
                    truncated = True
                    break
                gen = await self.generate(prompt + ids, sampling, seed, turns["assistant"], budget)
                self._append(ids, mask, lps, gen.token_ids, 1, gen.log_probs)
                turns["assistant"] += 1
                text = ctx.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                if not self.ended_with_eos(gen.token_ids):
                    truncated = True  # cut by the budget mid-turn
                    break
                if mt.max_assistant_turns and turns["assistant"] >= mt.max_assistant_turns:
                    break
                if mt.max_user_turns and turns["user"] >= mt.max_user_turns:
                    break
                _, calls = self.parser.parse(text)
                if not calls:
                    break
                results = await asyncio.gather(*(tools.call(c) for c in calls[: mt.max_parallel_calls]))
                texts = [
                    truncate_text(r, mt.max_tool_response_length, mt.tool_response_truncate_side)
                    for r in results
                ]
                messages += [{"role": "tool", "content": t} for t in texts]
                tool_ids = self.renderer.ids(texts)
                turns["user"] += 1
                room = ctx.response_length - len(ids)
                self._append(ids, mask, lps, tool_ids[:room], 0, None)
                if len(tool_ids) >= room:
                    truncated = True
                    break
        finally:
            reward = await tools.finish()
        metrics = {
            "assistant_turns": float(turns["assistant"]),
            "user_turns": float(turns["user"]),
            "tool_calls": float(tools.calls),
            "tool_errors": float(tools.errors),
            "tool_timeouts": float(tools.timeouts),
            "truncated": float(truncated),
            "tool_step_reward": tools.step_reward,
        }
        metrics.update(self._sanity(prompt, ids, raw_prompt, messages, truncated))
        return AgentLoopOutput(
            prompt, ids, mask, lps, 1 + turns["assistant"] + turns["user"], reward, metrics
        )

    @staticmethod
    def _append(ids, mask, lps, new_ids, flag: int, new_lps) -> None:
        ids += list(new_ids)
        mask += [flag] * len(new_ids)
        if lps is not None:
            lps += list(new_lps) if new_lps is not None else [0.0] * len(new_ids)

    def _sanity(self, prompt, ids, raw_prompt, messages, truncated) -> dict[str, float]:
        mode = self.mt.tokenization_sanity_check_mode
        if mode == "disable" or raw_prompt is None or truncated:
            return {}
        tok = self.context.tokenizer
        ends_with_tool = bool(messages) and messages[-1]["role"] == "tool"
        whole = conversation_ids(tok, list(raw_prompt) + messages, ends_with_tool, self.schemas)
        ok = check_tokenization(tok, prompt + ids, whole, mode)
        if not ok:
            logger.warning(
                "tokenization_sanity_check_mode=%s: turn-by-turn ids differ from the whole-conversation "
                "tokenisation (training uses the turn-by-turn ids, as generated)",
                mode,
            )
        return {"tokenization_mismatch": float(not ok)}
