"""Tools that ship with hybridrl: a calculator (the built-in agent task's tool) and a GSM8K answer
checker with the interface of veRL's example `Gsm8kTool`.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from hybridrl.tools.tool import BaseTool, ToolResponse

__all__ = ["CALCULATOR_SCHEMA", "CalculatorTool", "Gsm8kTool", "evaluate_expression"]

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression (+ - * / // % and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string", "description": "e.g. 123*45"}},
            "required": ["expr"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_ABS = 10**15
_MAX_CHARS = 200


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_eval(node.left), _eval(node.right))
        if abs(value) > _MAX_ABS:
            raise ValueError("result too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def evaluate_expression(expr: str) -> str:
    """The value of an arithmetic expression as text (integers without a decimal point).

    Only numbers, + - * / // %, unary signs and parentheses are allowed (no names, no calls, no
    powers). Raises ValueError / ZeroDivisionError / SyntaxError on anything else.

    >>> evaluate_expression("123*45")
    '5535'
    """
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError("expr must be a non-empty string")
    if len(expr) > _MAX_CHARS:
        raise ValueError(f"expression longer than {_MAX_CHARS} characters")
    value = _eval(ast.parse(expr.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class CalculatorTool(BaseTool):
    """`calc(expr)`: evaluates arithmetic. Errors propagate (the agent loop reports them)."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config or {}, tool_schema or CALCULATOR_SCHEMA)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        if "expr" not in parameters:
            raise ValueError(f"calc needs the argument 'expr'; got {sorted(parameters)}")
        return ToolResponse(text=evaluate_expression(parameters["expr"])), 0.0, {}


class Gsm8kTool(BaseTool):
    """veRL's example GSM8K tool: `calc_gsm8k_reward(answer)` scores the answer against the
    trajectory's ground truth (`create_kwargs: {ground_truth: ...}` from `extra_info.tools_kwargs`).

    Step reward: 0 when the score improved on the previous call, else -0.05 (discourages repeated
    calls); `calc_reward` is the latest score.
    """

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any) -> str:
        instance_id = await super().create(instance_id)
        self._instances[instance_id] = {"ground_truth": ground_truth, "response": "", "reward": 0.0}
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        state["response"] = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        from hybridrl.reward.scorers.gsm8k import compute_score

        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return float(compute_score(state["response"], str(state["ground_truth"])))
