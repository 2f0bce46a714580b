"""veRL's GenRM router (reward/genrm_router.py): a real aiohttp server in front of real judge
replicas (the built-in model, HF generate), spoken to over HTTP with `requests`/`aiohttp` and parsed
with openai's types, as a veRL GenRM reward function does. Its answers must be the client's
(`reward_model_client`, genrm.py) exactly; the veRL-shaped function in verl_genrm_fns.py must score
a batch through the reward loop exactly as the recipe's client-path function does."""

from __future__ import annotations

import concurrent.futures
import os
import socket

import pytest
import requests

pytest.importorskip("openai")
from openai.types.chat import ChatCompletion  # noqa: E402

from hybridrl.reward.custom import load_custom_reward_fn
from hybridrl.reward.genrm import GenRMClient, GenRMServer
from hybridrl.reward.genrm_router import RouterHandle
from hybridrl.reward.manager import load_reward_manager
from hybridrl.reward.reward_loop import RewardLoopManager
from hybridrl.trainer.ppo.genrm_config import judge_kwargs
from tests.reward.test_genrm import QUESTIONS, RECIPE, genrm_config, make_batch, responses_for

FNS = os.path.join(os.path.dirname(__file__), "verl_genrm_fns.py")


@pytest.fixture(scope="module")
def tok():
    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.hf import load_tokenizer

    return load_tokenizer(ModelConfig(path="builtin:tiny"))


@pytest.fixture(scope="module")
def judge_answers(servers, tok):
    """{question: the judge's greedy answer} through the client (tests/reward/test_genrm.py checks
    the client against a plain HF generate)."""
    client = GenRMClient(servers, genrm_config().rollout, tok)
    unique = list(dict.fromkeys(QUESTIONS))
    return dict(zip(unique, client.chat([[{"role": "user", "content": q}] for q in unique], max_tokens=12)))


@pytest.fixture(scope="module")
def servers():
    rollout = genrm_config().rollout
    return [GenRMServer("builtin:tiny", rollout, num_threads=1) for _ in range(2)]


@pytest.fixture()
def router(servers):
    handle = RouterHandle(servers, genrm_config().rollout, "builtin:tiny", False, use_ray=False)
    yield handle
    handle.shutdown()


def _chat(address, question, **extra):
    body = {"model": "judge", "messages": [{"role": "user", "content": question}], "max_tokens": 12, **extra}
    return requests.post(f"http://{address}/v1/chat/completions", json=body, timeout=60)


def test_chat_and_completions_answer_as_the_client_and_balance_the_replicas(router, servers, tok):
    client = GenRMClient(servers, genrm_config().rollout, tok)
    want = client.chat([[{"role": "user", "content": q}] for q in QUESTIONS], max_tokens=12)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda q: _chat(router.address, q), QUESTIONS))
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    parsed = [ChatCompletion(**r.json()) for r in got]
    assert [p.choices[0].message.content for p in parsed] == want
    assert all(p.usage.prompt_tokens > 0 and p.choices[0].finish_reason in ("stop", "length") for p in parsed)
    # concurrent requests are batched as they arrive, so their split depends on timing: both serve
    first = router.stats()["served"]
    assert sum(first) == len(QUESTIONS) and min(first) > 0, first
    # one at a time, the balance is exact: least-loaded (both idle), then fewest-served, so 6 more
    # requests even any split of the first 6 out to 6 each
    for q in QUESTIONS:
        assert _chat(router.address, q).status_code == 200
    assert router.stats()["served"] == [6, 6], first
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(text, add_special_tokens=False)
    for prompt in (text, ids):
        r = requests.post(
            f"http://{router.address}/v1/completions",
            json={"model": "judge", "prompt": prompt, "max_tokens": 12},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0], r.text
    assert requests.get(f"http://{router.address}/v1/models").json()["data"][0]["id"] == "builtin:tiny"


def test_concurrent_requests_are_batched_and_a_bad_one_fails_alone(router, judge_answers):
    import asyncio

    import aiohttp

    async def ask_all(questions):
        async with aiohttp.ClientSession() as s:

            async def one(q, max_tokens):
                body = {
                    "model": "judge",
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": max_tokens,
                }
                async with s.post(f"http://{router.address}/v1/chat/completions", json=body) as r:
                    return r.status, await r.json()

            return await asyncio.gather(*(one(q, 12) for q in questions), one(questions[0] + "9" * 40, 12))

    questions = QUESTIONS * 2
    *good, bad = asyncio.run(ask_all(questions))
    assert [b["choices"][0]["message"]["content"] for _, b in good] == [judge_answers[q] for q in questions]
    assert bad[0] == 400 and "reward_model.rollout.prompt_length" in bad[1]["error"]["message"]
    stats = router.stats()
    assert sum(stats["served"]) == 13 and sum(stats["calls"]) < 13  # waiting prompts went as batches


def test_bad_requests_get_400_naming_the_field(router):
    r = _chat(router.address, "1+2=", frequency_penalty=0.5)
    assert r.status_code == 400 and "frequency_penalty" in r.json()["error"]["message"]
    r = _chat(router.address, "1+2=", max_tokens=4096)  # veRL's example asks 4096: more than the judge holds
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    r = _chat(router.address, "1+2=", n=2)
    assert r.status_code == 400 and "n must be 1" in r.json()["error"]["message"]


def test_a_judge_that_does_not_answer_in_time_gets_504_naming_the_key(servers):
    slow = genrm_config(request_timeout_s=0.001).rollout
    handle = RouterHandle(servers, slow, "builtin:tiny", False, use_ray=False)
    try:
        r = _chat(handle.address, QUESTIONS[0])
        assert r.status_code == 504
        assert "reward_model.rollout.request_timeout_s=0.001" in r.json()["error"]["message"]
        assert "reward_model.rollout.request_timeout_s" in r.reason  # what requests' raise_for_status shows
        assert handle.pop_timeouts() == 1 and handle.pop_timeouts() == 0
    finally:
        handle.shutdown()


def test_shutdown_closes_the_port(servers):
    handle = RouterHandle(servers, genrm_config().rollout, "builtin:tiny", False, use_ray=False)
    host, port = handle.address.rsplit(":", 1)
    assert _chat(handle.address, QUESTIONS[0]).status_code == 200
    handle.shutdown()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def _loop(tok, fn_name, **rollout):
    """A GenRM reward loop (in this process) whose naive manager calls `fn_name`."""
    path = FNS if fn_name.startswith("verl:") else RECIPE
    fn = load_custom_reward_fn(path, fn_name.removeprefix("verl:"))
    manager = load_reward_manager("naive", tok, 0, fn, **judge_kwargs(fn))
    return RewardLoopManager(
        genrm_config(**rollout), None, manager, slots=1, use_ray=False, num_threads=1, genrm=True
    )


@pytest.mark.parametrize("fn", ["verl:compute_score", "verl:compute_score_sync"])
def test_a_verl_genrm_function_scores_the_batch_as_the_client_path(tok, judge_answers, fn):
    batch = make_batch(tok, responses_for(judge_answers))
    client_loop, http_loop = _loop(tok, "compute_score"), _loop(tok, fn)
    try:
        assert client_loop.router is None and http_loop.router is not None  # started only when asked for
        want, want_extra = client_loop.compute_rm_score(batch)
        got, got_extra = http_loop.compute_rm_score(batch)
    finally:
        client_loop.shutdown()
        http_loop.shutdown()
    assert got.batch["rm_scores"].sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert (got.batch["rm_scores"] == want.batch["rm_scores"]).all()
    assert (
        got_extra["genrm_response"] == want_extra["genrm_response"] == [judge_answers[q] for q in QUESTIONS]
    )


def test_the_function_gets_the_judge_arguments_its_signature_takes():
    verl = load_custom_reward_fn(FNS, "compute_score")
    assert judge_kwargs(verl) == {"reward_model_tokenizer": None, "reward_router_address": None}
    # **kwargs: the client (the router is started only for a function that names its address)
    assert set(judge_kwargs(load_custom_reward_fn(RECIPE, "compute_score"))) == {
        "reward_model_client", "reward_model_tokenizer",
    }  # fmt: skip

    def rule_only(data_source, solution_str, ground_truth, extra_info):
        return 0.0

    with pytest.raises(ValueError, match="neither reward_model_client nor reward_router_address"):
        judge_kwargs(rule_only)


def test_a_router_timeout_fails_the_batch_naming_the_key(tok):
    loop = _loop(tok, "verl:compute_score", request_timeout_s=0.001)
    try:
        with pytest.raises(TimeoutError, match=r"reward_model\.rollout\.request_timeout_s=0\.001"):
            loop.compute_rm_score(make_batch(tok, ["#### 1"] * len(QUESTIONS)))
    finally:
        loop.shutdown()
