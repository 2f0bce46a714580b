"""Cost of the GenRM HTTP router (hybridrl/reward/genrm_router.py) against the client.

Two judge replicas (the built-in model, HF generate, greedy, 12 new tokens) serve N chat prompts in
four ways, interleaved round by round in one process so machine noise hits them alike:

* client_batched: one `reward_model_client.chat(all N)` call (one left-padded generate per replica);
* client_per_row: N `chat([one])` calls, one after the other (the naive manager's client path);
* http_per_row:   N `requests.post` to /v1/chat/completions, one after the other (a sync veRL function);
* http_async:     N aiohttp POSTs awaited together (an async veRL function under the naive manager).

The replicas run in this process (trainer.backend=local's layout); medians over the rounds are printed.
Run: python bench/genrm_router.py [--prompts 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import requests

from hybridrl.config.roles import ModelConfig, RewardRolloutConfig
from hybridrl.models.hf import load_tokenizer
from hybridrl.reward.genrm import GenRMClient, GenRMServer
from hybridrl.reward.genrm_router import RouterHandle


async def _async_posts(address: str, bodies: list[dict]) -> list[str]:
    import aiohttp

    async with aiohttp.ClientSession() as s:

        async def one(body):
            async with s.post(f"http://{address}/v1/chat/completions", json=body) as r:
                return (await r.json())["choices"][0]["message"]["content"]

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rollout = RewardRolloutConfig(
        name="hf", dtype="float32", prompt_length=32, response_length=12, do_sample=False
    )
    servers = [GenRMServer("builtin:tiny", rollout, num_threads=1) for _ in range(2)]
    tok = load_tokenizer(ModelConfig(path="builtin:tiny"))
    client = GenRMClient(servers, rollout, tok)
    router = RouterHandle(servers, rollout, "builtin:tiny", False, use_ray=False)
    convs = [[{"role": "user", "content": f"{10 + i % 80}+{3 + (7 * i) % 90}="}] for i in range(args.prompts)]
    bodies = [{"model": "judge", "messages": c, "max_tokens": 12} for c in convs]
    ways = {
        "client_batched": lambda: client.chat(convs, max_tokens=12),
        "client_per_row": lambda: [client.chat([c], max_tokens=12)[0] for c in convs],
        "http_per_row": lambda: [
            requests.post(f"http://{router.address}/v1/chat/completions", json=b).json()["choices"][0][
                "message"
            ]["content"]
            for b in bodies
        ],
        "http_async": lambda: asyncio.run(_async_posts(router.address, bodies)),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    answers: dict[str, list[str]] = {}
    try:
        for _ in range(args.rounds):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                answers[name] = fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        router.shutdown()
    base = statistics.median(times["client_per_row"])
    print(f"{args.prompts} prompts, 2 replicas, median of {args.rounds} rounds")
    for name, ts in times.items():
        med = statistics.median(ts)
        same = answers[name] == answers["client_per_row"]
        print(
            f"{name:15s} {med:7.3f} s  {1e3 * med / args.prompts:6.1f} ms/prompt  x{med / base:5.2f}  same answers: {same}"
        )


if __name__ == "__main__":
    main()
