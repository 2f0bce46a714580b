"""GenRM reward functions written as veRL's reward loop expects them (veRL's
tests/experimental/reward_loop/reward_fn.py shape): they take `reward_router_address` and
`reward_model_tokenizer` (no **kwargs), POST OpenAI chat requests to
`http://{reward_router_address}/v1/chat/completions` and parse the answer with openai's types.
They judge as the GenRM recipe does (recipes/genrm/judge_reward.py): the judge is asked the row's
question and a response scores 1 when its answer equals the judge's."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest
import requests

pytest.importorskip("openai")  # veRL's functions parse with openai's types
from openai.types.chat import ChatCompletion  # noqa: E402

ANSWER = re.compile(r"####\s*(-?\d+)")


def _answer(text):
    found = ANSWER.findall(text or "")
    return found[-1] if found else None


def _result(judge_text, solution_str, ground_truth):
    judged, mine = _answer(judge_text), _answer(solution_str)
    rule = float(mine is not None and mine == str(ground_truth).strip())
    score = 0.0 if judged is None else float(mine is not None and mine == judged)
    return {
        "score": score,
        "acc": rule,
        "genrm_agree": float(score == rule),
        "genrm_parse_failure": judged is None,
        "genrm_response": judge_text,
    }


def _request(extra_info, max_tokens):
    return {
        "model": "judge",
        "messages": [{"role": "user", "content": extra_info["question"]}],
        "max_tokens": max_tokens,
    }


async def chat_complete(router_address, request):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(f"http://{router_address}/v1/chat/completions", json=request) as resp:
            return ChatCompletion(**json.loads(await resp.text()))


async def compute_score(
    data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer,
    max_tokens=12, address_log=None,
):  # fmt: skip
    """async def + aiohttp, as veRL's example."""
    if address_log:
        with open(address_log, "a") as f:
            f.write(reward_router_address + "\n")
    result = await chat_complete(reward_router_address, _request(extra_info, max_tokens))
    return _result(result.choices[0].message.content, solution_str, ground_truth)


def compute_score_sync(
    data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer,
    max_tokens=12,
):  # fmt: skip
    """A plain function with `requests`."""
    resp = requests.post(
        f"http://{reward_router_address}/v1/chat/completions",
        json=_request(extra_info, max_tokens),
        timeout=300,
    )
    resp.raise_for_status()
    return _result(ChatCompletion(**resp.json()).choices[0].message.content, solution_str, ground_truth)
