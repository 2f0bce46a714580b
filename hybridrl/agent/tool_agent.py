"""`tool_agent`: generate, parse tool calls, run the tools, append their responses, repeat.

One trajectory (T = rollout.response_length tokens in all, across turns)::

    prompt -> [assistant turn (mask 1)] -> tool calls? -> [tool turn (mask 0)] -> [assistant turn] ...

With `multi_turn.interaction_config_path`, an assistant turn that calls no tool is answered by
the row's interaction (interaction.py): a user turn (mask 0) follows, its score goes to the row's
`turn_scores`, and the interaction's `should_terminate_sequence` ends the trajectory.

It stops when an assistant turn calls no tool (and there is no interaction), at
`multi_turn.max_assistant_turns` assistant turns or `max_user_turns` tool / user turns, or when the
budget T is used up (a tool or user turn that does not fit is cut to the budget and the
trajectory is marked truncated; the cut tokens are mask 0).
At most `max_parallel_calls` calls of a turn run (concurrently); each response is cut to
`max_tool_response_length` characters on `tool_response_truncate_side`.

With a vision-language model (`context.vision`, agent/vision.py) a tool may return images and
videos (veRL's `ToolResponse.image` / `.video`): they enter the tool turn as image / video tokens
(mask 0) and their pixel inputs join the trajectory's, so the next assistant turn sees them; a
text model's run answers such a response with an error text.

Failures are data: a call with bad JSON, an unknown tool name, a tool that raises or takes longer
than `multi_turn.tool_timeout_s` gets an "Error: ..." text as its response, and is counted in the
trajectory's metrics (`tool_errors`, `tool_timeouts`). Nothing of that ends the step. Every tool
method (`create`, `execute`, `calc_reward`, `release`) has that deadline and runs on the tools' own
event loop (tool_runner.py), so even a blocking call inside `async def execute` cannot hold
generation; a `calc_reward` / `release` that fails or times out is logged and counted. The
interaction's calls run on the same loop with `multi_turn.interaction_timeout_s`: one past it ends
the trajectory (counted in `interaction_timeouts`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridrl.agent.interaction import row_interaction_kwargs
from hybridrl.agent.loop import AgentLoopBase, AgentLoopOutput, register_agent_loop
from hybridrl.agent.parser import ToolCall, get_tool_parser
from hybridrl.agent.tokenization import ToolTurnRenderer, check_tokenization, conversation_ids
from hybridrl.agent.trace import set_span_outputs, span
from hybridrl.agent.vision import merge_inputs
from hybridrl.rollout.base import SamplingSpec
from hybridrl.tools.tool import ToolResponse, create_arguments, schema_dict
from hybridrl.tools.tool_runner import tool_loop

__all__ = ["ToolAgentLoop", "TrajectoryTools", "truncate_text"]

logger = logging.getLogger(__name__)
INTERACTION_TIMEOUT_KEY = "actor_rollout_ref.rollout.multi_turn.interaction_timeout_s"
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


def decode_media(name: str, images: list[Any], videos: list[Any]) -> tuple[list[Any], list[Any]]:
    """A tool's images as RGB PIL images and its videos as frame lists (any form a dataset's
    `images` / `videos` column takes).

    Raises:
        ValueError: an image or video that does not decode, naming the tool and the item.
    """
    from hybridrl.data.image_decode import decode_image
    from hybridrl.data.video import decode_video

    where = f"tool {name!r} response"
    return (
        [decode_image(im, f"{where} image {k}") for k, im in enumerate(images)],
        [decode_video(v, f"{where} video {k}") for k, v in enumerate(videos)],
    )


class TrajectoryTools:
    """The tools of one trajectory: created on first use, released at the end, with counters.

    Args:
        tools: the run's tools by name.
        tools_kwargs: the row's `extra_info["tools_kwargs"]` ({name: {create_kwargs, execute_kwargs,
            calc_reward_kwargs, release_kwargs}}).
        timeout_s: seconds one call may take.
    """

    def __init__(
        self,
        tools: dict[str, Any],
        tools_kwargs: dict[str, Any] | None,
        timeout_s: float,
        images: bool = False,
    ) -> None:
        self.tools = tools
        self.images = images  # a vision-language run: tool images are taken
        self.kwargs = dict(tools_kwargs or {})
        self.timeout_s = timeout_s
        self.instances: dict[str, str] = {}
        self.calls = self.errors = self.timeouts = 0
        self.step_reward = 0.0

    def _kw(self, name: str, stage: str) -> dict[str, Any]:
        return dict((self.kwargs.get(name) or {}).get(stage) or {})

    async def _run(self, method: Any, name: str, stage: str, *args: Any, **kwargs: Any) -> Any:
        """``await method(*args, **kwargs)`` on the tools' own loop, for at most ``timeout_s``."""
        return await tool_loop.run(
            lambda: method(*args, **kwargs), timeout_s=self.timeout_s, what=f"tool {name!r} {stage}"
        )

    async def call(self, call: ToolCall) -> str:
        """Run one parsed call; returns the tool response text (an error text on failure)."""
        return (await self.call_response(call)).text or ""

    async def call_response(self, call: ToolCall) -> ToolResponse:
        """Run one parsed call; returns its text (an error text on failure) and, in a
        vision-language run, its images."""
        with span(f"tool/{call.name}", arguments=call.arguments, parse_error=call.error) as s:
            response = await self._call(call)
            if isinstance(response, str):
                response = ToolResponse(text=response)
            set_span_outputs(s, response=response.text, images=len(response.image or []))
        return response

    async def _call(self, call: ToolCall) -> str | ToolResponse:
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
                created = await self._run(
                    tool.create,
                    call.name,
                    "create",
                    None,
                    **create_arguments(tool, self._kw(call.name, "create_kwargs")),
                )
                self.instances[call.name] = created[0] if isinstance(created, tuple) else created
            kw = self._kw(call.name, "execute_kwargs")
            result = await self._run(
                tool.execute, call.name, "execute", self.instances[call.name], call.arguments, **kw
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
        if not isinstance(response, ToolResponse):
            return str(response)
        if (response.image or response.video) and not self.images:
            self.errors += 1
            what = "videos" if response.video else "images"
            return (
                f"Error: tool {call.name!r} returned {what}; this agent loop passes text only (tool "
                f"{what} need a vision-language model run)"
            )
        if response.image or response.video:
            try:  # decoded here, so a broken image is the model's data, not a crash of the step
                images, videos = decode_media(call.name, response.image or [], response.video or [])
            except Exception as e:
                self.errors += 1
                return f"Error: tool {call.name!r} returned media that does not decode: {e}"
            return ToolResponse(text=response.text or "", image=images, video=videos)
        return response.text or ""

    async def finish(self) -> float | None:
        """calc_reward and release every created tool; the summed reward (None if no tool ran)."""
        if not self.instances:
            return None
        total = 0.0
        for name, instance_id in self.instances.items():
            tool = self.tools[name]
            for stage in ("calc_reward", "release"):
                try:
                    value = await self._run(
                        getattr(tool, stage), name, stage, instance_id, **self._kw(name, f"{stage}_kwargs")
                    )
                except asyncio.TimeoutError:
                    self.timeouts += 1
                    logger.warning(
                        "tool %r %s timed out after %gs (multi_turn.tool_timeout_s)",
                        name,
                        stage,
                        self.timeout_s,
                    )
                    continue
                except Exception as e:
                    self.errors += stage == "calc_reward"
                    logger.warning("tool %r %s raised %s: %s", name, stage, type(e).__name__, e)
                    continue
                if stage == "calc_reward":
                    total += float(value)
        return total


@dataclass
class _Trajectory:
    """The growing state of one trajectory (ids / mask / log-probs of everything after the prompt)."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    lps: list[float] | None = None
    messages: list[dict] = field(default_factory=list)
    turns: dict[str, int] = field(default_factory=lambda: {"assistant": 0, "user": 0})
    truncated: bool = False
    interaction_turns: int = 0
    turn_scores: list[float] = field(default_factory=list)
    mm: dict[str, Any] | None = None  # a VLM run: the pixel inputs of the prompt's and the tools' images
    tool_images: int = 0
    tool_videos: int = 0
    vision_stop: bool = False


class UserSession:
    """The row's interaction (extra_info.interaction_kwargs.name) for one trajectory.

    Every call of the interaction runs on the tools' own event loop (tool_runner.py) with the
    deadline `multi_turn.interaction_timeout_s`: a call past it ends the trajectory (no more user
    turns), is counted in `timeouts` and logged with the key; nothing of that ends the step.
    """

    def __init__(self, interaction: Any, instance_id: str | None, kwargs: dict[str, Any], timeout_s: float):
        self.interaction, self.instance_id, self.kwargs = interaction, instance_id, kwargs
        self.timeout_s, self.timeouts = timeout_s, 0

    async def _run(self, stage: str, make: Any) -> tuple[bool, Any]:
        """(True, value) of the interaction call ``make()``, or (False, None) past the deadline."""
        name = getattr(self.interaction, "name", type(self.interaction).__name__)
        try:
            return True, await tool_loop.run(
                make, timeout_s=self.timeout_s, what=f"interaction {name!r} {stage}"
            )
        except asyncio.TimeoutError:
            self.timeouts += 1
            logger.warning(
                "interaction %r %s did not return within %gs (%s=%g): the trajectory ends here",
                name,
                stage,
                self.timeout_s,
                INTERACTION_TIMEOUT_KEY,
                self.timeout_s,
            )
            return False, None

    @classmethod
    async def start(cls, interactions: dict[str, Any], row: dict[str, Any], timeout_s: float) -> UserSession:
        kwargs = row_interaction_kwargs(row, interactions)
        session = cls(interactions[kwargs["name"]], None, kwargs, timeout_s)
        ok, instance_id = await session._run(
            "start_interaction", lambda: session.interaction.start_interaction(str(uuid.uuid4()), **kwargs)
        )
        session.instance_id = instance_id if ok else None
        return session

    async def respond(self, messages: list[dict], st: _Trajectory) -> tuple[bool, str] | None:
        """(should_terminate, user text) after `messages`, or None when the interaction timed out
        (now or at its start); the turn score goes to st.turn_scores."""
        if self.instance_id is None:
            return None
        ok, out = await self._run(
            "generate_response",
            lambda: self.interaction.generate_response(self.instance_id, messages, **self.kwargs),
        )
        if not ok:
            return None
        done, text, score, _ = out
        st.interaction_turns += 1
        if score is not None:
            st.turn_scores.append(float(score))
        return bool(done), str(text)

    async def finish(self) -> None:
        if self.instance_id is None:
            return
        try:
            await self._run(
                "finalize_interaction", lambda: self.interaction.finalize_interaction(self.instance_id)
            )
        except Exception as e:
            logger.warning(
                "interaction %r finalize raised %s: %s", self.interaction.name, type(e).__name__, e
            )


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn generation with tool calls (see the module docstring)."""

    def __init__(self, context, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        self.mt = context.config.multi_turn
        self.parser = get_tool_parser(self.mt.format)
        self.renderer = ToolTurnRenderer(context.tokenizer)
        self.schemas = [schema_dict(t.get_openai_tool_schema()) for t in context.tools.values()]
        self.vision = getattr(context, "vision", None)

    def _prompt(self, prompt_ids: list[int], raw_prompt: Any, has_images: bool = False) -> list[int]:
        """veRL: with `raw_prompt` (data.return_raw_chat) and tools, the prompt is rendered with the
        tool schemas (`tools=`); else (and for a prompt with images, whose ids the processor made)
        the dataset's prompt ids are used as they are."""
        if raw_prompt is None or not self.schemas or has_images:
            return list(prompt_ids)
        return conversation_ids(self.context.tokenizer, list(raw_prompt), True, self.schemas)

    async def run(
        self, sampling: SamplingSpec, *, prompt_ids: list[int], seed: int, **row: Any
    ) -> AgentLoopOutput:
        ctx, mt = self.context, self.mt
        raw_prompt = row.get("raw_prompt")
        mm = dict(row.get("multi_modal_inputs") or {}) if self.vision is not None else None
        prompt = self._prompt(prompt_ids, raw_prompt, bool(mm))
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        tools = TrajectoryTools(
            ctx.tools,
            row.get("tools_kwargs") or extra.get("tools_kwargs"),
            mt.tool_timeout_s,
            images=self.vision is not None,
        )
        user = (
            await UserSession.start(ctx.interactions, row, mt.interaction_timeout_s)
            if ctx.interactions
            else None
        )
        st = _Trajectory(lps=[] if ctx.want_log_probs else None, mm=mm)
        try:
            while await self._assistant_turn(st, prompt, sampling, seed):
                _, calls = self.parser.parse(st.messages[-1]["content"])
                if calls:
                    calls = calls[: mt.max_parallel_calls]
                    results = await asyncio.gather(*(tools.call_response(c) for c in calls))
                    texts = [
                        truncate_text(
                            r.text or "", mt.max_tool_response_length, mt.tool_response_truncate_side
                        )
                        for r in results
                    ]
                    media = [(r.image or [], r.video or []) for r in results]
                    more = self._env_turn(st, texts, "tool", media)
                elif user is not None:
                    answer = await user.respond(list(raw_prompt or []) + st.messages, st)
                    if answer is None:  # the interaction timed out: the trajectory ends
                        break
                    more = self._env_turn(st, [answer[1]], "user") and not answer[0]
                else:
                    break
                if not more:
                    break
        finally:
            reward = await tools.finish()
            if user is not None:
                await user.finish()
        metrics = {
            "assistant_turns": float(st.turns["assistant"]),
            "user_turns": float(st.turns["user"]),
            "interaction_turns": float(st.interaction_turns),
            "tool_calls": float(tools.calls),
            "tool_errors": float(tools.errors),
            "tool_timeouts": float(tools.timeouts),
            "interaction_timeouts": float(user.timeouts if user is not None else 0),
            "truncated": float(st.truncated),
            "tool_step_reward": tools.step_reward,
        }
        if self.vision is not None:
            metrics.update(
                tool_images=float(st.tool_images),
                tool_videos=float(st.tool_videos),
                vision_token_stops=float(st.vision_stop),
            )
        if not any(k.startswith("pixel_values") for k in st.mm or {}):  # its re-rendering has no pixels
            metrics.update(self._sanity(prompt, st.ids, raw_prompt, st.messages, st.truncated))
        turns = 1 + st.turns["assistant"] + st.turns["user"]
        out = AgentLoopOutput(prompt, st.ids, st.mask, st.lps, turns, reward, metrics)
        out.extra_fields["turn_scores"] = list(st.turn_scores)
        if self.vision is not None:
            out.extra_fields["multi_modal_inputs"] = self.vision.row_inputs(st.mm, st.ids, st.mask)
        return out

    async def _assistant_turn(self, st: _Trajectory, prompt, sampling: SamplingSpec, seed: int) -> bool:
        """Generate one assistant turn; False when the trajectory ends after it (budget, limits)."""
        ctx, mt = self.context, self.mt
        budget = ctx.response_length - len(st.ids)
        if budget <= 0:
            st.truncated = True
            return False
        gen = await self.generate(prompt + st.ids, sampling, seed, st.turns["assistant"], budget, st.mm)
        self._append(st.ids, st.mask, st.lps, gen.token_ids, 1, gen.log_probs)
        st.turns["assistant"] += 1
        text = ctx.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        st.messages.append({"role": "assistant", "content": text})
        if not self.ended_with_eos(gen.token_ids):
            st.truncated = True  # cut by the budget mid-turn
            return False
        if self.vision is not None and self.vision.sampled_placeholder(gen.token_ids):
            st.vision_stop = True  # fed back, a sampled <|image_pad|> would be an image without pixels
            return False
        if mt.max_assistant_turns and st.turns["assistant"] >= mt.max_assistant_turns:
            return False
        return not (mt.max_user_turns and st.turns["user"] >= mt.max_user_turns)

    def _env_turn(
        self, st: _Trajectory, texts: list[str], role: str, media: list[tuple[list, list]] | None = None
    ) -> bool:
        """Append tool responses / an interaction's user turn (mask 0); False when cut by the budget.

        `media`: each response's (images, videos). With tool images or videos (a VLM run) the
        turn's vision tokens are expanded and its pixel inputs join the trajectory's; a turn with
        them that does not fit is left out whole (an image cut short would not match its pixels; no
        later token would see it anyway)."""
        st.messages += [{"role": role, "content": t} for t in texts]
        st.turns["user"] += 1
        room = self.context.response_length - len(st.ids)
        if self.vision is not None and any(ims or vids for ims, vids in media or []):
            images, videos = [list(m[0]) for m in media], [list(m[1]) for m in media]
            new_ids, new_mm = self.vision.tool_turn(self.renderer, texts, images, role, videos)
            if len(new_ids) >= room:
                st.truncated = True
                return False
            self._append(st.ids, st.mask, st.lps, new_ids, 0, None)
            st.mm = merge_inputs(st.mm, new_mm)
            st.tool_images += sum(len(i) for i in images)
            st.tool_videos += sum(len(v) for v in videos)
            return True
        new_ids = self.renderer.ids(texts, role=role)
        self._append(st.ids, st.mask, st.lps, new_ids[:room], 0, None)
        if len(new_ids) >= room:
            st.truncated = True
            return False
        return True

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
        ends_with_tool = bool(messages) and messages[-1]["role"] in ("tool", "user")
        whole = conversation_ids(tok, list(raw_prompt) + messages, ends_with_tool, self.schemas)
        ok = check_tokenization(tok, prompt + ids, whole, mode)
        if not ok:
            logger.warning(
                "tokenization_sanity_check_mode=%s: turn-by-turn ids differ from the whole-conversation "
                "tokenisation (training uses the turn-by-turn ids, as generated)",
                mode,
            )
        return {"tokenization_mismatch": float(not ok)}
