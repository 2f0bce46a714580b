"""Hanging tools become data, never a hang: a blocking call inside `async def execute`,
an overrunning sync `@function_tool`, and a `create` / `calc_reward` / `release` that never return,
on the real tool agent with the real HF engine and the built-in model (tool_timeout_s=0.5)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from hybridrl.agent.parser import ToolCallParser, parse_call_json, register_tool_parser
from hybridrl.agent.runner import AgentLoopRunner
from hybridrl.config.rollout import RolloutConfig
from hybridrl.protocol import DataProto
from hybridrl.tools.tool import BaseTool, FunctionTool, function_tool
from hybridrl.tools.tool_runner import tool_loop

# a tool message renders as a new user question, so the built-in model keeps answering turns
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|user|>' ~ message['content'] }}"
    "{% else %}{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Script:
    """The tool-call body of the next assistant turn (then none)."""

    bodies: list[str] = []


@register_tool_parser("faults_scripted")
class Scripted(ToolCallParser):
    def parse(self, text):
        return (text, [parse_call_json(Script.bodies.pop(0))]) if Script.bodies else (text, [])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    tok = AutoTokenizer.from_pretrained(get_builtin_model_path())
    tok.padding_side = "left"
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def hf_engine(tokenizer):
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.rollout.hf import HFRollout

    torch.set_num_threads(1)
    cfg = RolloutConfig(name="hf", dtype="float32", load_format="auto", response_length=64, prompt_length=16)
    return HFRollout(cfg, get_builtin_model_path(), tokenizer)


def make_runner(hf_engine, tokenizer, tools, response_length, **multi_turn):
    cfg = RolloutConfig(
        name="hf",
        dtype="float32",
        load_format="auto",
        response_length=response_length,
        prompt_length=16,
        temperature=1.0,
        multi_turn={"enable": True, **multi_turn},
        agent={"default_agent_loop": "tool_agent"},
    )
    hf_engine.config = cfg
    runner = AgentLoopRunner(hf_engine, cfg, tokenizer)
    runner.tools.update({t.name: t for t in tools})
    return runner


def prompts(tokenizer, questions):
    msgs = [[{"role": "user", "content": q}] for q in questions]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    mask = enc["attention_mask"]
    batch = {
        "input_ids": enc["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return DataProto.from_dict(
        batch, {"raw_prompt": np.array(msgs + [None], dtype=object)[:-1]}, {"seed_index": 3}
    )


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


def _run_one(hf_engine, tokenizer, tool, body):
    Script.bodies = [body]
    runner = make_runner(
        hf_engine, tokenizer, [tool], response_length=160, format="faults_scripted", tool_timeout_s=TIMEOUT
    )
    t0 = time.monotonic()
    out = runner.generate_sequences(prompts(tokenizer, ["12+34="]))
    return out, time.monotonic() - t0


def _tool_text(out, tokenizer):
    b = out.batch
    T = b["responses"].shape[1]
    ids = b["responses"][0][(b["attention_mask"][0, -T:] == 1) & (b["response_mask"][0] == 0)]
    return tokenizer.decode(ids)


def test_a_blocking_async_tool_times_out_and_the_tool_loop_is_replaced(hf_engine, tokenizer, caplog):
    before = tool_loop.abandoned
    out, took = _run_one(
        hf_engine, tokenizer, BlockingTool({}, _schema("block")), '{"name": "block", "arguments": {}}'
    )
    assert "Error:toolblocktimedoutafter0.5s" in "".join(_tool_text(out, tokenizer).split()).replace("'", "")
    assert out.non_tensor_batch["tool_timeouts"][0] == 1
    assert took < 20, took  # not the 30 s the tool blocks
    assert tool_loop.abandoned == before + 1
    assert "blocked the tools' event loop" in caplog.text and "tool 'block' execute" in caplog.text


def test_an_overrunning_sync_function_tool_is_not_waited_for(hf_engine, tokenizer):
    out, took = _run_one(
        hf_engine, tokenizer, FunctionTool(sleepy), '{"name": "sleepy", "arguments": {"seconds": 30}}'
    )
    assert "timedoutafter0.5s" in "".join(_tool_text(out, tokenizer).split())
    assert out.non_tensor_batch["tool_timeouts"][0] == 1
    assert took < 20, took  # asyncio.run of the step did not join the sleeping thread


@pytest.mark.parametrize("stage", ["create", "calc_reward", "release"])
def test_a_hanging_lifecycle_method_becomes_a_counted_timeout(hf_engine, tokenizer, stage, caplog):
    HangingLifecycle.hang = {stage}
    tool = HangingLifecycle({}, _schema("life"))
    out, took = _run_one(hf_engine, tokenizer, tool, '{"name": "life", "arguments": {}}')
    assert out.non_tensor_batch["tool_timeouts"][0] == 1 and took < 20, took
    if stage == "create":
        assert "timedoutafter0.5s" in "".join(_tool_text(out, tokenizer).split())
    else:
        assert f"tool 'life' {stage} timed out after 0.5s" in caplog.text


def _call_in_child(q) -> None:
    import asyncio as aio

    from hybridrl.tools.tool_runner import tool_loop as loop_in_child

    async def answer():
        return 42

    try:
        q.put(aio.run(loop_in_child.run(answer, timeout_s=5.0, what="forked child")))
    except Exception as e:  # noqa: BLE001 - the parent reports it
        q.put(f"{type(e).__name__}: {e}")


def test_tool_loop_of_a_forked_child_is_its_own():
    """The tests' rank processes are forked after the parent ran tools: the parent's loop thread does
    not exist in the child, so a call there must start a fresh loop, not wait for a dead one."""
    import asyncio as aio
    import multiprocessing as mp

    from hybridrl.tools.tool_runner import tool_loop as parent_loop

    async def warm():
        return 1

    assert aio.run(parent_loop.run(warm, timeout_s=5.0, what="parent")) == 1  # the parent's loop runs
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_call_in_child, args=(q,))
    p.start()
    p.join(30)
    assert q.get(timeout=5) == 42
