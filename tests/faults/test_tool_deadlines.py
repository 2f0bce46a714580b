"""Hanging tools become data, never a hang (issue 30): a blocking call inside `async def execute`,
an overrunning sync `@function_tool`, and a `create` / `calc_reward` / `release` that never return,
on the real tool agent with the real HF engine and the built-in model (tool_timeout_s=0.5)."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridrl.workers.agent.tool import BaseTool, FunctionTool, function_tool
from hybridrl.workers.agent.tool_runner import tool_loop
from tests.workers.agent.test_tool_agent import Script, hf_engine, make_runner, prompts, tokenizer  # noqa: F401

TIMEOUT = 0.5


def _schema(name):
    return {"type": "function", "function": {"name": name}}


class BlockingTool(BaseTool):
    """`async def execute` that blocks its thread (time.sleep, not await asyncio.sleep)."""

    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(30)
        return "never", 0.0, {}


class HangingLifecycle(BaseTool):
    """execute answers; create / calc_reward / release hang (awaiting forever) as configured."""

    hang: set[str] = set()

    async def _maybe_hang(self, stage):
        if stage in self.hang:
            await asyncio.sleep(3600)

    async def create(self, instance_id=None, **kwargs):
        await self._maybe_hang("create")
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        return "11+22=", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        await self._maybe_hang("calc_reward")
        return 1.0

    async def release(self, instance_id, **kwargs):
        await self._maybe_hang("release")


@function_tool
def sleepy(seconds: float) -> str:
    """Sleeps (a sync tool overrunning its deadline)."""
    time.sleep(seconds)
    return "done"


def _run_one(hf_engine, tokenizer, tool, body):  # noqa: F811
    Script.bodies = [body]
    runner = make_runner(
        hf_engine, tokenizer, [tool], response_length=160, format="test_scripted", tool_timeout_s=TIMEOUT
    )
    t0 = time.monotonic()
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    return out, time.monotonic() - t0


def _tool_text(out, tokenizer):  # noqa: F811
    b = out.batch
    T = b["responses"].shape[1]
    ids = b["responses"][0][(b["attention_mask"][0, -T:] == 1) & (b["response_mask"][0] == 0)]
    return tokenizer.decode(ids)


def test_a_blocking_async_tool_times_out_and_the_tool_loop_is_replaced(hf_engine, tokenizer, caplog):  # noqa: F811
    before = tool_loop.abandoned
    out, took = _run_one(
        hf_engine, tokenizer, BlockingTool({}, _schema("block")), '{"name": "block", "arguments": {}}'
    )
    assert "Error:toolblocktimedoutafter0.5s" in "".join(_tool_text(out, tokenizer).split()).replace("'", "")
    assert out.non_tensor_batch["tool_timeouts"][0] == 1
    assert took < 20, took  # not the 30 s the tool blocks
    assert tool_loop.abandoned == before + 1
    assert "blocked the tools' event loop" in caplog.text and "tool 'block' execute" in caplog.text


def test_an_overrunning_sync_function_tool_is_not_waited_for(hf_engine, tokenizer):  # noqa: F811
    out, took = _run_one(
        hf_engine, tokenizer, FunctionTool(sleepy), '{"name": "sleepy", "arguments": {"seconds": 30}}'
    )
    assert "timedoutafter0.5s" in "".join(_tool_text(out, tokenizer).split())
    assert out.non_tensor_batch["tool_timeouts"][0] == 1
    assert took < 20, took  # asyncio.run of the step did not join the sleeping thread


@pytest.mark.parametrize("stage", ["create", "calc_reward", "release"])
def test_a_hanging_lifecycle_method_becomes_a_counted_timeout(hf_engine, tokenizer, stage, caplog):  # noqa: F811
    HangingLifecycle.hang = {stage}
    tool = HangingLifecycle({}, _schema("life"))
    out, took = _run_one(hf_engine, tokenizer, tool, '{"name": "life", "arguments": {}}')
    assert out.non_tensor_batch["tool_timeouts"][0] == 1 and took < 20, took
    if stage == "create":
        assert "timedoutafter0.5s" in "".join(_tool_text(out, tokenizer).split())
    else:
        assert f"tool 'life' {stage} timed out after 0.5s" in caplog.text
