"""An external agent for hybridrl's rollout server: the openai client and a calculator tool.

    python recipes/agent_server/calc_agent.py [BASE_URL] [CONCURRENCY]    # http://127.0.0.1:8000/v1 64

Takes tasks (POST /v1/hybridrl/tasks), runs each with `calc` (at most 3 model turns), finishes it (the
trainer's reward function scores it); stops after 5 minutes without a task.
"""

import asyncio
import json
import re
import sys
import time

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
EXPR = {"type": "string", "description": "the expression, e.g. 123*45"}
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": EXPR}, "required": ["expr"]}}}  # fmt: skip


def calc(expr: str) -> str:  # digits, operators and parentheses only: nothing else can be evaluated
    try:
        return (
            str(eval(expr, {"__builtins__": {}}))
            if re.fullmatch(r"[\d\s+\-*/%().]+", expr) and "**" not in expr
            else "Error: bad expression"
        )
    except Exception as e:
        return f"Error: {e}"


async def episode(llm: AsyncOpenAI, http: httpx.AsyncClient) -> bool:
    r = await http.post(f"{URL}/hybridrl/tasks", json={"wait_s": 30})
    if r.status_code == 204:
        return False
    task = r.json()
    msgs, tid = list(task["messages"]), task["trajectory_id"]
    for _ in range(3):
        out = await llm.chat.completions.create(model="policy", messages=msgs, tools=[CALC], user=tid,
                                                temperature=task["sampling"]["temperature"])  # fmt: skip
        msg = out.choices[0].message
        msgs.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if out.choices[0].finish_reason != "tool_calls":
            break
        for call in msg.tool_calls:
            expr = str(json.loads(call.function.arguments).get("expr", ""))
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": calc(expr)})
    await http.post(f"{URL}/hybridrl/trajectories/{tid}/finish", json={})
    return True


async def main(concurrency: int) -> None:
    llm, last = AsyncOpenAI(base_url=URL, api_key="unused", max_retries=20, timeout=600), [time.monotonic()]
    async with httpx.AsyncClient(timeout=120) as http:

        async def worker():
            while time.monotonic() - last[0] < 300:
                try:
                    if await episode(llm, http):
                        last[0] = time.monotonic()
                except (httpx.TransportError, APIConnectionError):  # the trainer is starting up
                    await asyncio.sleep(2)
                except APIStatusError as e:  # e.g. 404: the trajectory timed out on the server
                    print(f"calc_agent: {e.status_code} {e.message}", flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[2]) if len(sys.argv) > 2 else 64))
