"""AgentLoopRunner: a batch of prompts -> one agent-loop trajectory per row -> the rollout batch.

It holds what one rollout replica's agent loops share (tools, parser, the batching engine) and
implements the rollout contract of hybridrl.rollout.base with one difference:
`response_mask` is 1 only on tokens the policy generated, while `attention_mask` covers every
token of the trajectory (tool responses and templates included). The actor's loss, the KL terms
and the advantages all use `response_mask`, so they see the policy's tokens only; the forward
passes use `attention_mask`, so the model conditions on the whole conversation.

Over-sampling (veRL's `rollout.over_sample_rate`, training batches only): once
(1 - over_sample_rate) x B trajectories have finished, the others are aborted (their queued engine
requests dropped, their coroutines cancelled; tools are still released) and come back as empty
responses with every mask 0 (`agent/aborted/mean` counts them), to cut the long tail.

Routing: row r runs the loop named by its `agent_name` column, else
`rollout.agent.default_agent_loop`. At most `rollout.agent.max_concurrent_trajectories` run at
once (their generation requests share the engine through the batching queue).

Extra outputs: non-tensor per-row `num_turns`, `tool_calls`, `tool_errors`, `tool_timeouts`,
`agent_truncated`, `agent_reward` (None without one), `turn_scores` (the interaction's score of
each user turn, a list per row), `multi_modal_inputs` (a VLM run: each row's prompt and tool
images' pixel inputs, agent/vision.py), and meta_info["metrics"] summaries.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import torch

from hybridrl.agent.engine import BatchingEngine, RequestLimits
from hybridrl.agent.interaction import load_interactions
from hybridrl.agent.loop import (
    AgentContext,
    AgentLoopOutput,
    get_agent_loop_class,
    load_agent_loop_config,
)
from hybridrl.agent.trace import RolloutTracer
from hybridrl.agent.vision import VisionTurns
from hybridrl.protocol import DataProto
from hybridrl.rollout.base import SamplingSpec, derive_seed, resolve_sampling
from hybridrl.tools.tool_loading import load_tools

__all__ = ["AgentLoopRunner", "agent_loops_configured", "agent_step_metrics", "uses_agent_loops"]

ENV_FAULTS = ("env_errors", "env_timeouts", "env_malformed")  # per-row counts of hybridrl.env faults
ROW_METRICS = ("num_turns", "tool_calls", "tool_errors", "tool_timeouts", "agent_truncated")


def agent_loops_configured(config: Any) -> bool:
    """Whether the rollout section (RolloutConfig) turns the agent loops on for every batch.

    veRL's `rollout.mode=async` generates through its agent loops (single_turn_agent by default),
    so it does here too; so does `sglang_rollout_mode=server` (veRL's request-level server path:
    here the batching queue with the rollout.server.* limits)."""
    agent = config.agent
    return bool(
        getattr(config, "mode", "sync") in ("async", "server")
        or getattr(config, "sglang_rollout_mode", "engine") == "server"
        or config.multi_turn.enable
        or agent.default_agent_loop != "single_turn_agent"
        or agent.agent_loop_config_path
    )


def uses_agent_loops(config: Any, prompts: DataProto) -> bool:
    """Whether this batch goes through the agent loops (else the plain single-turn path): the
    config turns them on, or the rows name an `agent_name`."""
    return agent_loops_configured(config) or "agent_name" in prompts.non_tensor_batch


def request_limits(config: Any) -> RequestLimits:
    """veRL's `sglang_rollout_mode=server` options as limits of the request queue (engine mode:
    none). hybridrl's engines stay in-process; the server's request timeout, retries and
    connection limit apply to each generation request of the agent loops."""
    if config.sglang_rollout_mode != "server":
        return RequestLimits()
    sv = config.server
    return RequestLimits(
        timeout_s=float(sv.timeout),
        max_attempts=int(sv.max_attempts),
        retry_delay_s=float(sv.retry_delay),
        max_in_flight=int(sv.max_connections),
    )


def _run_coroutine(coro) -> Any:
    """asyncio.run, also from a thread that already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    # No deadline: the coroutine is the agent loops of this worker call (tools, interactions and
    # requests have their own timeouts); the driver's wait on this call bounds the rest.
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class AgentLoopRunner:
    """Runs the agent loops of one rollout replica.

    Args:
        rollout: the replica's BaseRollout (HF / vLLM); with rollout TP > 1, the TP leader's
            TPLeaderRollout (hybridrl.agent.tp_relay), the other TP ranks replay its calls.
        config: the rollout section (RolloutConfig).
        tokenizer: the policy tokenizer.
    """

    def __init__(self, rollout: Any, config: Any, tokenizer: Any) -> None:
        self.rollout = rollout
        self.config = config
        self.tokenizer = tokenizer
        if config.agent.agent_loop_config_path:
            load_agent_loop_config(config.agent.agent_loop_config_path)
        get_agent_loop_class(config.agent.default_agent_loop)  # fail at start-up on a bad name
        mt = config.multi_turn
        self.tools = load_tools(mt.tool_config_path, mt.function_tool_path)
        interactions = load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {}
        self.engine = BatchingEngine(
            rollout, config.max_num_seqs, config.agent.batch_wait_ms / 1000.0, request_limits(config)
        )
        self.context = AgentContext(
            config=config,
            tokenizer=tokenizer,
            engine=self.engine,
            tools=self.tools,
            eos_token_ids=list(rollout.eos_token_ids),
            want_log_probs=bool(config.calculate_log_probs),
            interactions=interactions,
            tracer=RolloutTracer(config.trace, tokenizer, config.seed) if config.trace.backend else None,
            vision=VisionTurns.for_model(getattr(rollout, "model_path", None)),
        )
        self._loops: dict[str, Any] = {}
        self.num_calls = 0

    def _loop(self, name: str) -> Any:
        if name not in self._loops:
            self._loops[name] = get_agent_loop_class(name)(self.context)
        return self._loops[name]

    def _sampling(self, meta: dict) -> SamplingSpec:
        force_greedy = bool(meta.get("greedy", False)) or meta.get("do_sample", True) is False
        spec = resolve_sampling(self.config, bool(meta.get("validate", False)), force_greedy)
        if meta.get("greedy", False):
            spec = SamplingSpec(greedy=True, temperature=1.0, top_k=-1, top_p=1.0)
        return spec

    def _row_kwargs(self, prompts: DataProto, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in prompts.non_tensor_batch.items()}

    def agent_names(self, prompts: DataProto) -> list[str]:
        if getattr(self.config, "mode", "sync") == "server":  # external agents drive every row
            return ["external_agent"] * len(prompts)
        default = self.config.agent.default_agent_loop
        col = prompts.non_tensor_batch.get("agent_name")
        names = [default if col is None or col[i] in (None, "") else str(col[i]) for i in range(len(prompts))]
        for name in dict.fromkeys(names):
            get_agent_loop_class(name)
        return names

    async def _run_all(
        self, prompts: DataProto, sampling: SamplingSpec, seeds: list[int], needed: int
    ) -> list[AgentLoopOutput]:
        """Every row's trajectory; once `needed` have finished the others are aborted (empty)."""
        ids, mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].bool().cpu()
        names = self.agent_names(prompts)
        gate = asyncio.Semaphore(self.config.agent.max_concurrent_trajectories)
        rows = [self._row_kwargs(prompts, i) for i in range(len(prompts))]
        trace_tags = self._trace_tags(prompts, rows)

        async def one(i: int) -> AgentLoopOutput:
            async with gate:
                prompt = ids[i][mask[i]].tolist()
                run = self._loop(names[i]).run(sampling, prompt_ids=prompt, seed=seeds[i], **rows[i])
                if i not in trace_tags:
                    return await run
                with self.context.tracer.trajectory(trace_tags[i], prompt) as finish:
                    out = await run
                    finish(out)
                return out

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        if needed >= len(tasks):
            return list(await asyncio.gather(*tasks))
        done = 0
        for fut in asyncio.as_completed(tasks):
            await fut  # a failing trajectory fails the step, as without over-sampling
            done += 1
            if done >= needed:
                break
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        want_lp = self.context.want_log_probs
        return [
            t.result() if not t.cancelled() else aborted_output(ids[i][mask[i]].tolist(), want_lp)
            for i, t in enumerate(tasks)
        ]

    def _trace_tags(self, prompts: DataProto, rows: list[dict]) -> dict[int, dict[str, Any]]:
        """Tags of the rows to trace (rollout.trace.*): step, sample_index, rollout_n, validate."""
        tracer = self.context.tracer
        if tracer is None:
            return {}
        samples = tracer.sample_ids(rows)
        seen: dict[str, int] = {}
        tags = {}
        chosen = tracer.selected_rows(samples, self.num_calls)
        for i, sample in enumerate(samples):
            seen[sample] = seen.get(sample, -1) + 1
            if i in chosen:
                tags[i] = {
                    "step": prompts.meta_info.get("global_steps", self.num_calls),
                    "sample_index": sample,
                    "rollout_n": seen[sample],
                    "validate": bool(prompts.meta_info.get("validate", False)),
                }
        return tags

    def _needed(self, prompts: DataProto) -> int:
        """Trajectories to wait for: all, or (1 - over_sample_rate) of a training batch (veRL)."""
        rate = float(self.config.over_sample_rate)
        if rate <= 0 or prompts.meta_info.get("validate", False):
            return len(prompts)
        return max(1, int(len(prompts) * (1.0 - rate)))

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One trajectory per row; the output follows the rollout contract (module docstring)."""
        meta = prompts.meta_info
        call = int(meta.get("seed_index", self.num_calls))
        self.num_calls += 1
        dp = getattr(self.rollout, "dp_rank", 0)
        seeds = [derive_seed(self.config.seed, call, r, dp) for r in range(len(prompts))]
        self.engine.reset_metrics()
        t0 = time.perf_counter()
        coro = self._run_all(prompts, self._sampling(meta), seeds, self._needed(prompts))
        outputs = _run_coroutine(coro) if len(prompts) else []
        elapsed = time.perf_counter() - t0
        out = build_agent_output(prompts, outputs, self.rollout.pad_token_id, self.config.response_length)
        if getattr(self.config, "mode", "sync") == "server" and len(prompts):
            from hybridrl.agent.server.external_loop import attach_agent_rewards

            attach_agent_rewards(out, self.config.agent_server.reward_source)
        metrics = {"timing_s/generate_sequences": elapsed, **self.engine.metrics()}
        n_tokens = int(out.batch["response_mask"].sum()) if len(prompts) else 0
        metrics["rollout/num_response_tokens"] = n_tokens
        metrics["rollout/tokens_per_s"] = n_tokens / max(elapsed, 1e-9)
        out.meta_info["metrics"] = {**out.meta_info.get("metrics", {}), **metrics}
        return out

    def close(self) -> None:
        self.engine.close()


def aborted_output(prompt_ids: list[int], want_log_probs: bool) -> AgentLoopOutput:
    """The row of a trajectory aborted by over_sample_rate: the prompt, an empty response (every
    mask 0, so it adds nothing to the loss), marked `aborted` in the metrics."""
    return AgentLoopOutput(
        list(prompt_ids), [], [], [] if want_log_probs else None, num_turns=1, metrics={"aborted": 1.0}
    )


def build_agent_output(
    prompts: DataProto, outputs: list[AgentLoopOutput], pad_token_id: int, response_length: int
) -> DataProto:
    """Trajectories -> the rollout batch (B rows, P = max prompt length, T = response_length).

    Returns:
        DataProto with prompts (B, P) left-padded, responses / response_mask (B, T) right-padded,
        input_ids / attention_mask / position_ids (B, P+T), rollout_log_probs (B, T) when the
        trajectories carry log-probs, the input's non-tensor columns plus the ROW_METRICS columns.
    """
    bsz = len(outputs)
    p_len = max([prompts.batch["input_ids"].shape[1]] + [len(o.prompt_ids) for o in outputs])
    prompt_ids = torch.full((bsz, p_len), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((bsz, p_len), dtype=torch.long)
    responses = torch.full((bsz, response_length), pad_token_id, dtype=torch.long)
    resp_valid = torch.zeros((bsz, response_length), dtype=torch.long)
    resp_mask = torch.zeros((bsz, response_length), dtype=torch.long)
    want_lp = bool(outputs) and all(o.response_logprobs is not None for o in outputs)
    log_probs = torch.zeros((bsz, response_length), dtype=torch.float32)
    for i, o in enumerate(outputs):
        n, p = len(o.response_ids), len(o.prompt_ids)
        if n > response_length:
            raise ValueError(
                f"agent loop returned {n} response tokens for row {i}, more than {response_length}"
            )
        prompt_ids[i, p_len - p :] = torch.as_tensor(o.prompt_ids, dtype=torch.long)
        prompt_mask[i, p_len - p :] = 1
        if n:
            responses[i, :n] = torch.as_tensor(o.response_ids, dtype=torch.long)
            resp_valid[i, :n] = 1
            resp_mask[i, :n] = torch.as_tensor(o.response_mask, dtype=torch.long)
            if want_lp:
                log_probs[i, :n] = torch.as_tensor(o.response_logprobs, dtype=torch.float32)
    pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    delta = torch.arange(1, response_length + 1, dtype=pos.dtype)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": resp_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, resp_valid], dim=1),
        "position_ids": torch.cat([pos, pos[:, -1:] + delta], dim=1),
    }
    if want_lp:
        tensors["rollout_log_probs"] = log_probs * resp_mask
    non_tensor = dict(prompts.non_tensor_batch)
    non_tensor["num_turns"] = np.array([o.num_turns for o in outputs], dtype=object)
    for key, metric in (
        ("tool_calls", "tool_calls"),
        ("tool_errors", "tool_errors"),
        ("tool_timeouts", "tool_timeouts"),
    ):
        non_tensor[key] = np.array([int(o.metrics.get(metric, 0)) for o in outputs], dtype=object)
    non_tensor["agent_truncated"] = np.array(
        [int(o.metrics.get("truncated", 0)) for o in outputs], dtype=object
    )
    non_tensor["agent_reward"] = np.array([o.reward_score for o in outputs], dtype=object)
    turn_scores = np.empty(bsz, dtype=object)  # lists of different lengths: one object per row
    for i, o in enumerate(outputs):
        turn_scores[i] = list(o.extra_fields.get("turn_scores", []))
    non_tensor["turn_scores"] = turn_scores
    if any("env_reward" in o.extra_fields for o in outputs):  # environments' rewards (hybridrl.env)
        non_tensor["env_reward"] = np.array([o.extra_fields.get("env_reward") for o in outputs], dtype=object)
        for key in ENV_FAULTS:
            non_tensor[key] = np.array([int(o.metrics.get(key, 0)) for o in outputs], dtype=object)
    if any("multi_modal_inputs" in o.extra_fields for o in outputs):  # a VLM run: prompt + tool images
        mm = np.empty(bsz, dtype=object)
        prompt_mm = prompts.non_tensor_batch.get("multi_modal_inputs")
        for i, o in enumerate(outputs):
            mm[i] = o.extra_fields.get("multi_modal_inputs", prompt_mm[i] if prompt_mm is not None else {})
        non_tensor["multi_modal_inputs"] = mm
    meta = dict(prompts.meta_info)
    meta["metrics"] = {**meta.get("metrics", {}), **summarize(outputs)}
    return DataProto.from_dict(tensors, non_tensor, meta)


def summarize(outputs: list[AgentLoopOutput]) -> dict[str, float]:
    """Batch summaries of the trajectories' metrics (sums of counts, means per trajectory)."""
    if not outputs:
        return {}
    keys = sorted({k for o in outputs for k in o.metrics})
    out = {}
    for k in keys:
        vals = [float(o.metrics.get(k, 0.0)) for o in outputs]
        out[f"agent/{k}/mean"] = sum(vals) / len(vals)
    return out


def agent_step_metrics(batch: DataProto) -> dict[str, float]:
    """Trainer-side metrics of a rollout batch that went through the agent loops ({} otherwise):
    num_turns/{mean,min,max}, tool/calls_per_traj, tool/errors, tool/timeouts (counts over the
    batch), tool/error_rate ((errors + timeouts) / calls), agent/truncated_ratio."""
    nt = batch.non_tensor_batch
    if "num_turns" not in nt or "tool_calls" not in nt:
        return {}
    env = {f"env/{k[4:]}": float(np.asarray(nt[k], dtype=np.float64).sum()) for k in ENV_FAULTS if k in nt}
    turns = np.asarray(nt["num_turns"], dtype=np.float64)
    calls = float(np.asarray(nt["tool_calls"], dtype=np.float64).sum())
    errors = float(np.asarray(nt["tool_errors"], dtype=np.float64).sum())
    timeouts = float(np.asarray(nt["tool_timeouts"], dtype=np.float64).sum())
    return {
        "num_turns/mean": float(turns.mean()),
        "num_turns/min": float(turns.min()),
        "num_turns/max": float(turns.max()),
        "tool/calls_per_traj": calls / max(len(turns), 1),
        "tool/errors": errors,
        "tool/timeouts": timeouts,
        "tool/error_rate": (errors + timeouts) / max(calls, 1.0),
        "agent/truncated_ratio": float(np.asarray(nt["agent_truncated"], dtype=np.float64).mean()),
        **env,  # environment faults over the batch: env/errors, env/timeouts, env/malformed
    }
