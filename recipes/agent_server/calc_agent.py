"""An external agent for hybridrl's rollout server: the openai client plus a calculator tool.

    python recipes/agent_server/calc_agent.py [BASE_URL] [CONCURRENCY]    # default http://127.0.0.1:8000/v1 64

Takes tasks (POST /v1/hybridrl/tasks), runs each with the `calc` tool (at most 3 model turns), finishes
it (the trainer's reward function scores it); exits after 5 minutes without a task.
"""

import ast
import asyncio
import json
import operator
import sys
import time

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
CALC = {"name": "calc", "description": "Evaluate an arithmetic expression (+ - * / // % and parentheses).",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string", "description": "the expression, e.g. 123*45"}}, "required": ["expr"]}}  # fmt: skip
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}  # fmt: skip


def calc(expr: str) -> str:
    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float):
            return n.value
        if isinstance(n, ast.BinOp | ast.UnaryOp) and type(n.op) in OPS:
            return OPS[type(n.op)](
                *(ev(x) for x in ((n.left, n.right) if isinstance(n, ast.BinOp) else (n.operand,)))
            )
        raise ValueError(f"unsupported expression {expr!r}")

    try:
        return str(ev(ast.parse(expr, mode="eval").body))
    except Exception as e:
        return f"Error: {e}"


async def episode(llm: AsyncOpenAI, http: httpx.AsyncClient) -> bool:
    r = await http.post(f"{URL}/hybridrl/tasks", json={"wait_s": 30})
    if r.status_code == 204:
        return False
    task = r.json()
    msgs, tid = list(task["messages"]), task["trajectory_id"]
    for _ in range(3):
        out = await llm.chat.completions.create(model="policy", messages=msgs, user=tid, tools=[{"type": "function", "function": CALC}],
                                                temperature=task["sampling"]["temperature"])  # fmt: skip
        msg, done = out.choices[0].message, out.choices[0].finish_reason != "tool_calls"
        msgs.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if done:
            break
        for call in msg.tool_calls:
            expr = json.loads(call.function.arguments).get("expr", "")
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(expr))})
    await http.post(f"{URL}/hybridrl/trajectories/{tid}/finish", json={})
    return True


async def worker(llm, http, last):
    while time.monotonic() - last[0] < 300:
        try:
            if await episode(llm, http):
                last[0] = time.monotonic()
        except (httpx.TransportError, APIConnectionError, OSError):  # the trainer is starting up
            await asyncio.sleep(2)
        except APIStatusError as e:  # e.g. 404: the trajectory timed out on the server
            print(f"calc_agent: {e.status_code} {e.message}", flush=True)


async def main(concurrency: int) -> None:
    llm = AsyncOpenAI(base_url=URL, api_key="unused", max_retries=20, timeout=600)
    async with httpx.AsyncClient(timeout=120) as http:
        last = [time.monotonic()]
        await asyncio.gather(*(worker(llm, http, last) for _ in range(concurrency)))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[2]) if len(sys.argv) > 2 else 64))
