"""veRL's newest tool API (verl/tools/base_tool.py, schemas.py, function_tool.py, tool_registry.py)
works here with only the import line changed: the shapes a tool may return, the places its schema
may come from, yaml and json tool configs, both spellings of create's arguments."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_style_tools.py")


def _parse(body: str):
    from hybridrl.agent.parser import get_tool_parser

    (call,) = get_tool_parser("hermes").parse(f"<tool_call>{body}</tool_call>")[1]
    return call


def _run(tools, calls, tools_kwargs=None):
    from hybridrl.agent.tool_agent import TrajectoryTools

    async def go():
        tt = TrajectoryTools(tools, tools_kwargs, timeout_s=5.0)
        texts = [await tt.call(_parse(json.dumps(c))) for c in calls]
        await tt.finish()
        return tt, texts

    return asyncio.run(go())


def test_class_declared_schema_json_config_and_create_kwargs(tmp_path):
    from hybridrl.tools.tool_registry import initialize_tools_from_config, load_all_tools

    cfg = {"tools": [{"class_name": "verl_style_tools.AnswerCheckTool", "config": {"type": "native"}}]}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(cfg))
    (tool,) = initialize_tools_from_config(str(path))
    assert tool.name == "check_answer" and tool.tool_schema.function.parameters.required == ["answer"]
    assert tool.schema["function"]["parameters"]["properties"]["answer"]["type"] == "string"
    kwargs = {"check_answer": {"create_kwargs": {"ground_truth": "42"}}}
    tt, texts = _run({tool.name: tool}, [{"name": "check_answer", "arguments": {"answer": "42"}}], kwargs)
    assert texts == ["check_answer: correct"] and tt.step_reward == 1.0 and tt.errors == 0
    # the same class from a yaml entry with an explicit schema (veRL passes it as a pydantic model)
    yml = tmp_path / "tools.yaml"
    yml.write_text(
        "tools:\n  - class_name: verl_style_tools.AnswerCheckTool\n    config: {type: native}\n"
        "    tool_schema:\n      type: function\n      function:\n        name: grade\n"
        "        description: grade it\n        parameters: {type: object, properties: {answer: {type: string}}}\n"
    )
    (graded,) = load_all_tools(str(yml), None)
    assert graded.name == "grade" and graded.tool_schema["function"]["name"] == "grade"


def test_function_tools_schema_inference_names_and_return_shapes():
    from hybridrl.tools.function_tool import FUNCTION_TOOL_REGISTRY, get_function_tool
    from hybridrl.tools.tool_loading import load_function_tools

    tools = {t.name: t for t in load_function_tools(HERE)}
    assert set(tools) == {"multiply", "lookup", "echo"}
    mul = tools["multiply"].get_openai_tool_schema()["function"]
    assert mul["description"] == "Multiply two integers."
    assert mul["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor."}
    assert get_function_tool("lookup").name == "lookup" and "echo" in FUNCTION_TOOL_REGISTRY
    tt, texts = _run(
        tools,
        [
            {"name": "multiply", "arguments": {"a": 6, "b": 7}},
            {"name": "lookup", "arguments": {"key": "k"}},
            {"name": "echo", "arguments": {"text": "hi"}},
        ],
    )
    assert texts == ['{"product": 42}', "value of k", "hi"]
    assert tt.step_reward == 0.5 and tt.errors == 0
    with pytest.raises(KeyError, match="function_tool_path"):
        get_function_tool("nope")


def test_bad_shapes_fail_clearly():
    from hybridrl.tools.function_tool import function_tool
    from hybridrl.tools.schemas import ToolResponse
    from hybridrl.tools.tool import BaseTool, normalize_tool_return

    with pytest.raises(ValueError, match="must be a list"):
        ToolResponse(image="one.png")
    with pytest.raises(TypeError, match="return tuple"):
        normalize_tool_return(("a", 1.0, {}, "extra"))
    with pytest.raises(ValueError, match="variadic"):

        @function_tool
        def spread(*args: int) -> int:
            """Spread.

            Args:
                args: numbers.
            """
            return 0

    with pytest.raises(ValueError, match="no tool_schema"):
        BaseTool({}, None)

    class Pictures(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="see", image=["img"]), 0.0, {}

    pics = Pictures({}, {"type": "function", "function": {"name": "pics"}})
    tt, texts = _run({"pics": pics}, [{"name": "pics", "arguments": {}}])
    assert texts[0].startswith("Error: tool 'pics' returned images") and tt.errors == 1
