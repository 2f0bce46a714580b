"""`external_agent`: the agent loop of `rollout.mode=server`; an external agent drives the trajectory.

Each row of the replica's batch becomes a task on the rollout server (gateway.py). The agent takes it,
sends OpenAI requests, and finishes it; this loop answers each request with the replica's engine
(through the batching queue, so many trajectories share one engine batch) and records the
trajectory token-in, token-out, as `tool_agent` does (docs/agent.md):

    prompt ─► [answer of request 1: generated, mask 1] ─► [new tool / user messages of request 2:
              the chat template's ids of those messages, mask 0] ─► [answer of request 2, mask 1] ...

The trajectory's prompt is the task's messages rendered with the first request's `tools` (or the
dataset's prompt ids when it sends none); each later chat request must repeat the conversation so
far and add only tool or user messages (else 400); earlier turns are never re-tokenised.
`/v1/completions` takes token ids (or text, tokenised without special tokens): the first request's
prompt is the trajectory's prompt; each later prompt must extend the trajectory's ids so far, and
its new ids are mask 0. Every answer's token ids and log-probs are recorded as generated; the
budget `rollout.response_length` covers the whole trajectory (an answer that reaches it ends with
finish_reason "length" and marks the trajectory truncated).

The trajectory's reward: the agent's `reward` at finish (`agent_server.reward_source=agent`, put on
the last response token as `rm_scores`), else the trainer's reward function scores it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridrl.agent.loop import AgentLoopBase, AgentLoopOutput, register_agent_loop
from hybridrl.agent.parser import get_tool_parser
from hybridrl.agent.server.gateway import get_gateway
from hybridrl.agent.server.wire import (
    RequestError,
    chat_response,
    completion_response,
    error_body,
    message_text,
    parse_chat_request,
    parse_completion_request,
)
from hybridrl.agent.tokenization import ToolTurnRenderer, conversation_ids
from hybridrl.protocol import DataProto
from hybridrl.rollout.base import SamplingSpec, derive_seed

__all__ = ["ExternalAgentLoop", "attach_agent_rewards"]

logger = logging.getLogger(__name__)
_ANNOUNCED: set[str] = set()


@dataclass
class _State:
    """One trajectory: prompt ids, then ids / mask / log-probs of everything after the prompt."""

    prompt: list[int] | None = None
    kind: str | None = None  # "chat" or "completion": the first request's endpoint
    history: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    turns: int = 0
    env_turns: int = 0
    calls: int = 0
    bad_calls: int = 0
    truncated: bool = False
    reward: float | None = None


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | np.ndarray):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x if isinstance(x, str | int | float | bool | type(None)) else str(x)


@register_agent_loop("external_agent")
class ExternalAgentLoop(AgentLoopBase):
    """Serve one trajectory to an external agent over the rollout server (module docstring)."""

    def __init__(self, context, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        cfg = context.config
        self.server = cfg.agent_server
        self.parser = get_tool_parser(cfg.multi_turn.format)
        self.renderer = ToolTurnRenderer(context.tokenizer)
        self.model = str(getattr(context.tokenizer, "name_or_path", "") or "hybridrl-policy")
        self.gateway, self.url = get_gateway(self.server, self.model)
        self.replica = f"{os.uname().nodename}:{os.getpid()}"
        if self.url not in _ANNOUNCED:
            _ANNOUNCED.add(self.url)
            print(
                f"hybridrl rollout server: OpenAI-compatible endpoint at {self.url} (tasks: POST {self.url}/hybridrl/tasks)"
            )

    async def run(
        self, sampling: SamplingSpec, *, prompt_ids: list[int], seed: int, **row: Any
    ) -> AgentLoopOutput:
        tid = uuid.uuid4().hex
        raw = row.get("raw_prompt")
        st = _State()
        st.history = [dict(m) for m in raw] if raw is not None else []
        payload = {
            "messages": _jsonable(st.history) if raw is not None else None,
            "prompt_token_ids": list(prompt_ids),
            "extra_info": _jsonable(row.get("extra_info")),
            "sampling": {
                "temperature": 0.0 if sampling.greedy else sampling.temperature,
                "top_p": 1.0 if sampling.greedy else sampling.top_p,
            },  # fmt: skip
        }
        await self.gateway.add_task.remote(tid, self.replica, payload)
        abandoned = await self._serve(tid, st, list(prompt_ids), sampling, seed)
        prompt = st.prompt if st.prompt is not None else list(prompt_ids)
        metrics = {
            "assistant_turns": float(st.turns),
            "user_turns": float(st.env_turns),
            "tool_calls": float(st.calls),
            "tool_errors": float(st.bad_calls),
            "truncated": float(st.truncated or abandoned),
            "abandoned": float(abandoned),
        }
        lps = list(st.lps) if self.context.want_log_probs else None
        return AgentLoopOutput(prompt, st.ids, st.mask, lps, 1 + st.turns + st.env_turns, st.reward, metrics)

    async def _serve(
        self, tid: str, st: _State, task_ids: list[int], sampling: SamplingSpec, seed: int
    ) -> bool:
        """Answer the trajectory's requests until its finish; True when the agent went silent."""
        deadline = None
        try:
            while True:
                wait = (
                    self.server.claim_timeout_s if deadline is None else max(deadline - time.monotonic(), 0.0)
                )
                ev = await self.gateway.next_event.remote(tid, wait)
                if ev["kind"] == "timeout":
                    if ev["claimed"] or deadline is not None:
                        return True
                    raise TimeoutError(
                        f"no external agent took a rollout task within {self.server.claim_timeout_s:g}s "
                        f"(actor_rollout_ref.rollout.agent_server.claim_timeout_s): point the agent at {self.url} "
                        "(POST /v1/hybridrl/tasks, then /v1/chat/completions with user=<trajectory_id>)"
                    )
                if deadline is None:
                    deadline = time.monotonic() + self.server.trajectory_timeout_s
                status, body = await self._answer(ev, st, task_ids, sampling, seed)
                await self.gateway.reply.remote(ev["req_id"], status, body)
                if ev["kind"] == "finish" and status == 200:
                    return False
        finally:
            await self.gateway.drop.remote(tid)

    async def _answer(self, ev: dict, st: _State, task_ids, sampling, seed) -> tuple[int, dict]:
        try:
            if ev["kind"] == "finish":
                return 200, self._finish(st, ev["body"], task_ids)
            if ev["kind"] == "chat":
                return 200, await self._chat(st, ev["body"], task_ids, sampling, seed)
            return 200, await self._completion(st, ev["body"], sampling, seed)
        except RequestError as e:
            return e.status, error_body(e.status, e.message, e.param)
        except Exception as e:  # an engine or template failure: the agent sees it, the step goes on
            logger.exception("rollout server: request failed")
            return 500, error_body(500, f"{type(e).__name__}: {e}")

    def _finish(self, st: _State, body: dict, task_ids: list[int]) -> dict:
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise RequestError(400, f"reward must be a number or null, got {reward!r}", "reward")
        if reward is None and self.server.reward_source == "agent":
            raise RequestError(
                400,
                "actor_rollout_ref.rollout.agent_server.reward_source=agent: the finish needs a numeric reward",
                "reward",
            )
        st.reward = None if reward is None else float(reward)
        if st.prompt is None:
            st.prompt = list(task_ids)
        return {"trajectory_id": body.get("trajectory_id"), "status": "finished", "num_tokens": len(st.ids)}

    def _start_chat(self, st: _State, req, task_ids: list[int]) -> None:
        """The first chat request: its messages must be the task's; the prompt is rendered with its tools."""
        task = st.history
        if not task:
            raise RequestError(400, "this task has no messages (the trainer runs with data.return_raw_chat=false); "
                               "use /v1/completions with the task's prompt_token_ids", "messages")  # fmt: skip
        if not _same_prefix(req.messages, task) or len(req.messages) != len(task):
            raise RequestError(400, "the first request's messages must be the task's messages (as handed out by "
                               "POST /v1/hybridrl/tasks)", "messages")  # fmt: skip
        st.prompt = (
            conversation_ids(self.context.tokenizer, task, True, req.tools) if req.tools else list(task_ids)
        )
        st.kind = "chat"

    def _add_messages(self, st: _State, messages: list[dict]) -> bool:
        """Append the new tool / user messages of a later chat request (mask 0); False when cut by the budget."""
        if not _same_prefix(messages, st.history) or len(messages) <= len(st.history):
            raise RequestError(400, "messages must repeat the conversation so far (the task's messages and every "
                               "answer, in order) and add the new tool or user messages", "messages")  # fmt: skip
        new = messages[len(st.history) :]
        roles = {m["role"] for m in new}
        if len(roles) != 1 or not roles <= {"tool", "user"}:
            raise RequestError(400, f"the new messages must all be 'tool' or all 'user' messages, got roles {sorted(roles)}",
                               "messages")  # fmt: skip
        texts = [message_text(m.get("content"), "messages") for m in new]
        st.history += [{"role": m["role"], "content": t} for m, t in zip(new, texts)]
        return self._append_env(st, self.renderer.ids(texts, role=new[0]["role"]))

    def _append_env(self, st: _State, new_ids: list[int]) -> bool:
        room = self.context.response_length - len(st.ids)
        cut = list(new_ids)[: max(room, 0)]
        st.ids += cut
        st.mask += [0] * len(cut)
        st.lps += [0.0] * len(cut)
        st.env_turns += 1
        if len(new_ids) >= room:
            st.truncated = True
            return False
        return True

    async def _generate(
        self, st: _State, max_tokens: int | None, sampling, seed
    ) -> tuple[list[int], list[float], list[int]]:
        """One answer after the trajectory so far: (context ids, new ids, their log-probs)."""
        context = st.prompt + st.ids
        budget = self.context.response_length - len(st.ids)
        if st.truncated or budget <= 0:
            st.truncated = True
            return context, [], []
        n = min(max_tokens or budget, budget)
        gen = await self.context.engine.generate(context, sampling, derive_seed(seed, st.turns, 0), n, True)
        st.ids += gen.token_ids
        st.mask += [1] * len(gen.token_ids)
        st.lps += list(gen.log_probs)
        st.turns += 1
        if len(st.ids) >= self.context.response_length and not self.ended_with_eos(gen.token_ids):
            st.truncated = True
        return context, gen.token_ids, list(gen.log_probs)

    async def _chat(self, st: _State, body: Any, task_ids, sampling, seed) -> dict:
        req = parse_chat_request(body, sampling)
        if st.kind == "completion":
            raise RequestError(400, "this trajectory started on /v1/completions; keep using it")
        if st.prompt is None:
            self._start_chat(st, req, task_ids)
        else:
            self._add_messages(st, req.messages)
        context, ids, lps = await self._generate(st, req.max_tokens, sampling, seed)
        tok = self.context.tokenizer
        text = tok.decode(ids, skip_special_tokens=True)
        st.history.append({"role": "assistant", "content": text})
        content, calls = (text, [])
        if req.parse_tools:
            rest, parsed = self.parser.parse(text)
            bad = [c for c in parsed if c.error is not None]
            st.bad_calls += len(bad)
            content, calls = (text, []) if bad else (rest, parsed)
            st.calls += len(parsed)
        eos = self.ended_with_eos(ids)
        finish = ("tool_calls" if calls else "stop") if eos else "length"
        tokens = [tok.decode([t]) for t in ids] if req.logprobs else None
        return chat_response(self.model, content, calls, finish, context, ids, lps, tokens)

    async def _completion(self, st: _State, body: Any, sampling, seed) -> dict:
        req = parse_completion_request(body, sampling)
        tok = self.context.tokenizer
        ids = (
            req.prompt
            if isinstance(req.prompt, list)
            else tok(req.prompt, add_special_tokens=False)["input_ids"]
        )
        if st.kind == "chat":
            raise RequestError(400, "this trajectory started on /v1/chat/completions; keep using it")
        if st.prompt is None:
            st.prompt, st.kind = list(ids), "completion"
        else:
            so_far = st.prompt + st.ids
            if list(ids[: len(so_far)]) != so_far or len(ids) < len(so_far):
                raise RequestError(400, "the prompt must start with the trajectory's ids so far (the first prompt, "
                                   "then each answer's token_ids and what you added)", "prompt")  # fmt: skip
            if len(ids) > len(so_far):
                self._append_env(st, list(ids[len(so_far) :]))
        context, new, lps = await self._generate(st, req.max_tokens, sampling, seed)
        finish = "stop" if self.ended_with_eos(new) else "length"
        tokens = [tok.decode([t]) for t in new] if req.logprobs else None
        text = tok.decode(new, skip_special_tokens=True)
        return completion_response(self.model, text, finish, context, new, lps, tokens)


def _same_prefix(messages: list[dict], known: list[dict]) -> bool:
    """Whether `messages` starts with `known`: same roles; same text for every non-assistant message."""
    if len(messages) < len(known):
        return False
    for m, k in zip(messages, known):
        if m.get("role") != k.get("role"):
            return False
        if k["role"] != "assistant" and message_text(m.get("content"), "messages") != message_text(
            k.get("content"), "messages"
        ):
            return False
    return True


def attach_agent_rewards(out: DataProto, reward_source: str) -> None:
    """reward_source=agent: the agents' rewards (non-tensor `agent_reward`) as `rm_scores` (B, T), each
    on the row's last response token, which the reward manager then uses as they are (0 for a
    trajectory the agent abandoned)."""
    if reward_source != "agent":
        return
    resp = out.batch["responses"]
    T = resp.shape[1]
    valid = out.batch["attention_mask"][:, -T:]
    scores = torch.zeros(resp.shape, dtype=torch.float32)
    for i, r in enumerate(out.non_tensor_batch["agent_reward"]):
        last = max(int(valid[i].sum()) - 1, 0)
        scores[i, last] = 0.0 if r is None else float(r)
    out.batch["rm_scores"] = scores
