"""Unit tests of the agent pieces without a model: parser, tools and their loading, config, registry."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from hybridrl.agent.builtin_tools import CalculatorTool, Gsm8kTool, evaluate_expression
from hybridrl.agent.loop import (
    AgentLoopBase,
    get_agent_loop_class,
    list_agent_loops,
    load_agent_loop_config,
)
from hybridrl.agent.parser import get_tool_parser
from hybridrl.agent.tool_agent import TrajectoryTools, truncate_text
from hybridrl.config.agent import AgentConfig, MultiTurnConfig
from hybridrl.config.rollout import RolloutConfig
from hybridrl.data import agent_task
from hybridrl.tools.tool import FunctionTool, function_tool
from hybridrl.tools.tool_loading import load_function_tools, load_tools, load_tools_from_yaml

VERL_GSM8K_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_hermes_parses_calls_and_reports_malformed_ones():
    p = get_tool_parser("hermes")
    text = 'ok <tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call> and'
    content, calls = p.parse(text)
    assert content == "ok  and" and len(calls) == 1
    assert calls[0].name == "calc" and calls[0].arguments == {"expr": "1+2"} and calls[0].error is None
    # arguments given as a JSON string (OpenAI style)
    _, calls = p.parse('<tool_call>{"name":"f","arguments":"{\\"x\\": 1}"}</tool_call>')
    assert calls[0].arguments == {"x": 1}
    _, calls = p.parse('<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{"name":"f"')
    assert [c.error is not None for c in calls] == [True, True, True]
    assert "not valid JSON" in calls[0].error and "needs" in calls[1].error and "not closed" in calls[2].error
    assert p.parse("#### 5")[1] == []
    with pytest.raises(ValueError, match="unknown actor_rollout_ref.rollout.multi_turn.format"):
        get_tool_parser("nope")


@pytest.mark.parametrize(
    "side,expected",
    [("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"), ("middle", "ab...(truncated)...ij")],
)
def test_truncate_text_sides(side, expected):
    assert truncate_text("abcdefghij", 4, side) == expected
    assert truncate_text("abc", 4, side) == "abc"


def test_calculator_is_safe_and_exact():
    assert evaluate_expression("123*45") == "5535"
    assert evaluate_expression("(7 - 10) * 2") == "-6"
    assert evaluate_expression("7/2") == "3.5"
    for bad in ("__import__('os')", "2**100", "a+1", ""):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate_expression(bad)
    with pytest.raises(ZeroDivisionError):
        evaluate_expression("1/0")


def test_verl_tool_yaml_loads_unchanged(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_GSM8K_YAML)
    (tool,) = load_tools_from_yaml(str(path))
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"
    assert tool.get_openai_tool_schema()["function"]["parameters"]["required"] == ["answer"]

    async def life_cycle():
        iid = await tool.create(None, ground_truth="72")
        resp, step_reward, _ = await tool.execute(iid, {"answer": "72"})
        reward = await tool.calc_reward(iid)
        await tool.release(iid)
        return resp.text, step_reward, reward

    text, step_reward, reward = asyncio.run(life_cycle())
    assert reward == 1.0 and step_reward == 0.0 and "reward=1.0" in text


def test_tool_yaml_errors_name_the_cause(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: no_such_pkg.Tool\n    tool_schema: {function: {name: x}}\n")
    with pytest.raises(ImportError, match="no_such_pkg"):
        load_tools_from_yaml(str(bad))
    bad.write_text("foo: 1\n")
    with pytest.raises(ValueError, match="top-level `tools:` list"):
        load_tools_from_yaml(str(bad))
    bad.write_text("tools:\n  - class_name: x.Y\n    config: {type: mcp}\n")
    with pytest.raises(ValueError, match="MCP"):
        load_tools_from_yaml(str(bad))


def test_function_tools_from_a_file(tmp_path):
    src = tmp_path / "my_tools.py"
    src.write_text(
        textwrap.dedent(
            '''
            from hybridrl.tools.tool import function_tool

            @function_tool
            def add(a: int, b: int = 0) -> int:
                """Add two integers.

                More text."""
                return a + b

            def not_a_tool():
                return 1
            '''
        )
    )
    (tool,) = load_function_tools(str(src))
    fn = tool.get_openai_tool_schema()["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert fn["parameters"]["required"] == ["a"]
    resp, _, _ = asyncio.run(tool.execute("i", {"a": 2, "b": 3}))
    assert resp.text == "5"
    with pytest.raises(ValueError, match="unique"):
        yaml_path = tmp_path / "t.yaml"
        yaml_path.write_text(
            "tools:\n  - class_name: hybridrl.agent.builtin_tools.CalculatorTool\n"
            "    tool_schema: {type: function, function: {name: add}}\n"
        )
        load_tools(str(yaml_path), str(src))


def test_trajectory_tools_turn_failures_into_error_responses():
    @function_tool
    def boom(x: int) -> int:
        raise RuntimeError("kaput")

    @function_tool
    async def slow() -> str:
        await asyncio.sleep(5)
        return "late"

    tools = {t.name: t for t in (CalculatorTool(), FunctionTool(boom), FunctionTool(slow))}
    parse = get_tool_parser("hermes").parse

    async def go():
        tt = TrajectoryTools(tools, None, timeout_s=0.2)
        texts = []
        for body in (
            '{"name": "calc", "arguments": {"expr": "2*3"}}',
            "{bad json",
            '{"name": "nope", "arguments": {}}',
            '{"name": "boom", "arguments": {"x": 1}}',
            '{"name": "slow", "arguments": {}}',
            '{"name": "calc", "arguments": {"expr": "1/0"}}',
        ):
            (call,) = parse(f"<tool_call>{body}</tool_call>")[1]
            texts.append(await tt.call(call))
        await tt.finish()
        return tt, texts

    tt, texts = asyncio.run(go())
    assert texts[0] == "6"
    assert texts[1].startswith("Error: the tool call is not valid JSON")
    assert texts[2].startswith("Error: unknown tool 'nope'; available tools: boom, calc, slow")
    assert texts[3] == "Error: tool 'boom' raised RuntimeError: kaput"
    assert texts[4] == "Error: tool 'slow' timed out after 0.2s"
    assert texts[5].startswith("Error: tool 'calc' raised ZeroDivisionError")
    assert (tt.calls, tt.errors, tt.timeouts) == (6, 4, 1)


def test_multi_turn_config_validation(tmp_path):
    with pytest.raises(ValueError, match="multi_turn.tool_response_truncate_side"):
        RolloutConfig(multi_turn={"tool_response_truncate_side": "up"})
    with pytest.raises(ValueError, match="multi_turn.max_assistant_turns"):
        RolloutConfig(multi_turn={"max_assistant_turns": 0})
    with pytest.raises(ValueError, match="multi_turn.tool_config_path"):
        RolloutConfig(multi_turn={"tool_config_path": str(tmp_path / "missing.yaml")})
    with pytest.raises(ValueError, match="tokenization_sanity_check_mode"):
        RolloutConfig(multi_turn={"tokenization_sanity_check_mode": "loose"})
    with pytest.raises(ValueError, match="agent.max_concurrent_trajectories"):
        RolloutConfig(agent={"max_concurrent_trajectories": 0})
    cfg = RolloutConfig(
        multi_turn=MultiTurnConfig(enable=True), agent=AgentConfig(default_agent_loop="tool_agent")
    )
    assert cfg.multi_turn.enable and cfg.agent.default_agent_loop == "tool_agent"


class EchoLoop(AgentLoopBase):
    """A custom loop for the agent_loop_config_path test."""


def test_agent_loop_registry_and_config_path(tmp_path):
    assert {"single_turn_agent", "tool_agent"} <= set(list_agent_loops())
    assert get_agent_loop_class("tool_agent").__name__ == "ToolAgentLoop"
    with pytest.raises(ValueError, match="unknown agent loop 'missing'"):
        get_agent_loop_class("missing")
    path = tmp_path / "loops.yaml"
    path.write_text(f"- name: echo_agent\n  _target_: {__name__}.EchoLoop\n  greeting: hi\n")
    assert load_agent_loop_config(str(path)) == ["echo_agent"]
    loop = get_agent_loop_class("echo_agent")(context=None)
    assert isinstance(loop, EchoLoop) and loop.kwargs == {"greeting": "hi"}
    path.write_text("- name: x\n")
    with pytest.raises(ValueError, match="_target_"):
        load_agent_loop_config(str(path))


def test_agent_task_rows_carry_agent_name_and_tools_kwargs():
    rows = agent_task.make_rl_rows(5, 0, "train")
    for r in rows:
        a, b = map(int, r["prompt"][0]["content"].rstrip("=").split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and agent_task.pair_split(a, b) == "train"
        assert len(str(a * b)) == 5
        assert r["reward_model"]["ground_truth"] == str(a * b)
        assert r["agent_name"] == "tool_agent"
        assert r["extra_info"]["tools_kwargs"]["calc"]["create_kwargs"]["ground_truth"] == str(a * b)
    val = {
        tuple(map(int, r["prompt"][0]["content"].rstrip("=").split("*")))
        for r in agent_task.make_rl_rows(50, 1, "val")
    }
    assert all(agent_task.pair_split(a, b) == "val" for a, b in val)
    assert (
        agent_task.tool_call_text(123, 45)
        == '<tool_call>{"name":"calc","arguments":{"expr":"123*45"}}</tool_call>'
    )
