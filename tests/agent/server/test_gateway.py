"""The rollout server's HTTP front (gateway.py) without Ray or a model: routing, back-pressure and the
error statuses, with a real aiohttp server on a free port and a real HTTP client; the test plays the
replica through the same methods the replicas call over Ray."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from hybridrl.agent.server.gateway import RolloutGateway
from hybridrl.agent.server.wire import RequestError, parse_chat_request, parse_completion_request
from hybridrl.rollout.base import SamplingSpec

CHAT = {"messages": [{"role": "user", "content": "1+1="}]}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def started(**kw) -> tuple[RolloutGateway, str]:
    gw = RolloutGateway(
        "127.0.0.1", 0, kw.get("max_in_flight", 8), kw.get("request_timeout_s", 30.0), "policy"
    )
    return gw, await gw.start()


async def answer_next(gw: RolloutGateway, tid: str, status: int = 200, body: dict | None = None) -> dict:
    ev = await gw.next_event(tid, 30)
    await gw.reply(ev["req_id"], status, body or {"ok": ev["kind"]})
    return ev


def test_tasks_are_sticky_and_handed_out_least_loaded_first():
    async def main():
        gw, url = await started()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/hybridrl/tasks", json={"wait_s": 0}) as r:
                assert r.status == 204  # nothing to do yet
            for tid, replica in (("a1", "A"), ("a2", "A"), ("b1", "B")):
                await gw.add_task(tid, replica, {"messages": [{"role": "user", "content": tid}]})
            got = []
            for _ in range(3):
                async with http.post(f"{url}/hybridrl/tasks", json={"wait_s": 1}) as r:
                    got.append((await r.json())["trajectory_id"])
            # A has a claimed trajectory after the first hand-out, so B's task comes next
            assert got == ["a1", "b1", "a2"]
            # the request of trajectory b1 reaches b1's inbox (replica B), not a1's
            req = asyncio.ensure_future(http.post(f"{url}/chat/completions", json={**CHAT, "user": "b1"}))
            ev = await answer_next(gw, "b1", 200, {"from": "B"})
            assert ev["kind"] == "chat" and ev["body"] == CHAT  # `user` is consumed by the routing
            r = await req
            assert r.status == 200 and (await r.json()) == {"from": "B"}
            assert gw.trajs["a1"].inbox.empty()
        await gw._runner.cleanup()

    run(main())


def test_back_pressure_and_error_statuses():
    async def main():
        gw, url = await started(max_in_flight=1, request_timeout_s=0.5)
        for tid in ("t1", "t2"):
            await gw.add_task(tid, "A", {})
        async with aiohttp.ClientSession() as http:
            first = asyncio.ensure_future(
                http.post(f"{url}/chat/completions", json=CHAT, headers={"X-Trajectory-Id": "t1"})
            )
            while gw.in_flight < 1:
                await asyncio.sleep(0.01)
            async with http.post(f"{url}/chat/completions", json={**CHAT, "user": "t2"}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
                assert "max_in_flight" in (await r.json())["error"]["message"]
            # the same trajectory again while its request runs: 409 (checked before the in-flight cap)
            gw.max_in_flight = 2
            async with http.post(f"{url}/chat/completions", json={**CHAT, "user": "t1"}) as r:
                assert r.status == 409
            # t1 was used without being handed out: it is no longer a pending task
            assert "t1" not in gw.pending["A"] and list(gw.pending["A"]) == ["t2"]
            r = await first  # nobody answers: 504 after request_timeout_s
            assert r.status == 504 and "request_timeout_s" in (await r.json())["error"]["message"]
            async with http.post(f"{url}/chat/completions", json={**CHAT, "user": "nope"}) as r:
                assert r.status == 404 and "not open" in (await r.json())["error"]["message"]
            async with http.post(
                f"{url}/completions", data=b"{bad json", headers={"X-Trajectory-Id": "t2"}
            ) as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            async with http.post(f"{url}/hybridrl/tasks", json={"wait_s": -1}) as r:
                assert r.status == 400
            await gw.drop("t2")
            async with http.post(f"{url}/hybridrl/trajectories/t2/finish", json={}) as r:
                assert r.status == 404
            async with http.get(f"{url}/models") as r:
                assert (await r.json())["data"][0]["id"] == "policy"
        assert gw.counts["refused_429"] == 1 and gw.in_flight == 0
        await gw._runner.cleanup()

    run(main())


SAMPLING = SamplingSpec(greedy=False, temperature=1.0, top_k=-1, top_p=1.0)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({**CHAT, "n": 2}, "n"),
        ({**CHAT, "stream": True}, "stream"),
        ({**CHAT, "temperature": 0.5}, "temperature"),
        ({**CHAT, "top_p": 0.9}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "stop": ["\n"]}, "stop"),
        ({**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_chat_request_refusals_name_the_field(body, param):
    with pytest.raises(RequestError) as e:
        parse_chat_request(body, SAMPLING)
    assert e.value.status == 400 and e.value.param == param


def test_accepted_requests():
    req = parse_chat_request(
        {**CHAT, "temperature": 1.0, "max_completion_tokens": 5, "logprobs": True}, SAMPLING
    )
    assert req.max_tokens == 5 and req.logprobs and req.parse_tools
    greedy = SamplingSpec(greedy=True, temperature=1.0, top_k=-1, top_p=1.0)
    assert not parse_chat_request({**CHAT, "temperature": 0, "tool_choice": "none"}, greedy).parse_tools
    with pytest.raises(RequestError):
        parse_chat_request({**CHAT, "temperature": 1.0}, greedy)  # validation is greedy
    assert parse_completion_request({"prompt": [1, 2, 3], "logprobs": 1}, SAMPLING).prompt == [1, 2, 3]
    with pytest.raises(RequestError) as e:
        parse_completion_request({"prompt": [1, -2]}, SAMPLING)
    assert e.value.param == "prompt"


def test_without_ray_the_gateway_runs_in_a_thread_called_like_an_actor():
    """trainer.backend runs the worker in the driver: get_gateway then serves from a thread, and the
    replica's `await handle.method.remote(...)` works from the replica's own event loop."""
    import ray

    from hybridrl.agent.server import gateway as gw_mod
    from hybridrl.config.agent_server import AgentServerConfig

    if ray.is_initialized():
        pytest.skip("Ray is running in this test process (the gateway would be a Ray actor)")
    handle, url = gw_mod.get_gateway(AgentServerConfig(port=0), "policy")
    try:
        assert gw_mod.get_gateway(AgentServerConfig(port=0), "policy") == (handle, url)  # one per process

        async def main():
            await handle.add_task.remote("t", "A", {"messages": []})
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/hybridrl/tasks", json={"wait_s": 5}) as r:
                    assert (await r.json())["trajectory_id"] == "t"
                req = asyncio.ensure_future(
                    http.post(f"{url}/completions", json={"prompt": [1], "user": "t"})
                )
                ev = await handle.next_event.remote("t", 30)
                await handle.reply.remote(ev["req_id"], 200, {"echo": ev["body"]["prompt"]})
                assert (await (await req).json()) == {"echo": [1]}
            await handle.drop.remote("t")
            assert (await handle.stats.remote())["open_trajectories"] == 0

        run(main())
    finally:
        gw_mod.shutdown_gateway()
    assert gw_mod.GATEWAY_NAME not in gw_mod._IN_PROCESS


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"mode": "server", "tensor_model_parallel_size": 2}, "rollout.mode"),
        ({"mode": "serve"}, "rollout.mode"),
        ({"agent_server": {"port": 70000}}, "rollout.agent_server.port"),
        ({"agent_server": {"max_in_flight": 0}}, "rollout.agent_server.max_in_flight"),
        ({"agent_server": {"reward_source": "judge"}}, "rollout.agent_server.reward_source"),
        ({"agent_server": {"claim_timeout_s": 0}}, "rollout.agent_server.claim_timeout_s"),
    ],
)
def test_bad_server_keys_fail_at_start_naming_the_key(kwargs, key):
    from hybridrl.config.rollout import RolloutConfig

    with pytest.raises(ValueError, match=f"actor_rollout_ref.{key}"):
        RolloutConfig(name="hf", **kwargs)
