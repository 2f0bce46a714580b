"""Train on a `verifiers` environment unchanged: its rollouts drive the rollout server's endpoint.

A verifiers environment (PyPI `verifiers`; prime-rl's environment hub) generates with an
`AsyncOpenAI` client and scores with its own rubric. hybridrl's rollout server
(`actor_rollout_ref.rollout.mode=server`, docs/agent.md) is an OpenAI-compatible endpoint that
records every trajectory token-in, token-out, so the environment runs as it is, in a process of
its own beside the trainer:

    python -m hybridrl.env.verifiers_bridge data  --env ENV --out DIR     # its dataset -> parquet
    python -m hybridrl.env.verifiers_bridge agent --env ENV --url http://127.0.0.1:8000/v1

`agent` takes each task the trainer hands out (POST /v1/hybridrl/tasks), runs the environment's
own `run_rollout` (its turns, its parser, its rubric) with a client whose requests name the
trajectory (the OpenAI `user` field), and finishes the trajectory with the rubric's reward
(`agent_server.reward_source=agent`). ENV is an environment id that `verifiers.load_environment`
knows (an installed hub environment) or `module:callable` returning an environment;
`--env-args` is a JSON object of its arguments.

The rows `data` writes are veRL's schema: the environment's own formatted prompt (system prompt
and few-shot turns included), `data_source: verifiers`, and in `extra_info` what the environment
needs back (`vf_answer`, `vf_task`, `vf_info`, `vf_example_id`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from typing import Any

__all__ = ["load_env", "make_rows", "rollout_input", "run_agent"]

DATA_SOURCE = "verifiers"


def load_env(spec: str, args: dict[str, Any] | None = None):
    """The environment `spec` names: `module:callable` (called with args), else a verifiers env id."""
    args = dict(args or {})
    if ":" in spec:
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr)(**args)
    import verifiers as vf

    return vf.load_environment(spec, **args)


def make_rows(env, split: str, n: int = -1) -> list[dict[str, Any]]:
    """RL rows (veRL's schema) of the environment's train (`get_dataset`) or eval dataset."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    ds = env.get_dataset(n) if split == "train" else env.get_eval_dataset(n)
    rows = []
    for i, ex in enumerate(ds):
        info = ex.get("info") or {}
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [dict(m) for m in ex["prompt"]],
                "ability": str(ex.get("task") or "default"),
                "reward_model": {"style": "environment", "ground_truth": str(ex.get("answer", ""))},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "vf_example_id": int(ex.get("example_id", i)),
                    "vf_answer": str(ex.get("answer", "")),
                    "vf_task": str(ex.get("task") or "default"),
                    "vf_info": json.dumps(info if isinstance(info, dict) else json.loads(info)),
                },
            }
        )
    return rows


def rollout_input(task: dict[str, Any]) -> dict[str, Any]:
    """The environment's RolloutInput for a task of the rollout server (its messages and extra_info)."""
    extra = task.get("extra_info") or {}
    missing = [k for k in ("vf_answer", "vf_example_id") if k not in extra]
    if missing:
        raise ValueError(
            f"a task's extra_info lacks {missing}: train on rows written by "
            "`python -m hybridrl.env.verifiers_bridge data` (or add those fields in preprocessing)"
        )
    return {
        "prompt": list(task["messages"]),
        "answer": str(extra["vf_answer"]),
        "task": str(extra.get("vf_task") or "default"),
        "info": json.loads(extra.get("vf_info") or "{}"),
        "example_id": int(extra["vf_example_id"]),
    }


async def _episode(env, url: str, llm, http, log) -> bool:
    r = await http.post(f"{url}/hybridrl/tasks", json={"wait_s": 30})
    if r.status_code == 204:
        return False
    r.raise_for_status()
    task = r.json()
    tid = task["trajectory_id"]
    sampling = {"temperature": task["sampling"]["temperature"], "user": tid}
    reward, metrics, error = 0.0, {}, None
    try:
        out = await env.run_rollout(rollout_input(task), llm, "policy", sampling)
        reward = float(out.get("reward") or 0.0)
        metrics = {k: float(v) for k, v in (out.get("metrics") or {}).items()}
        error = out.get("error")
    except Exception as e:  # the environment failed: this trajectory scores 0, the run goes on
        error = f"{type(e).__name__}: {e}"
    finally:
        await http.post(f"{url}/hybridrl/trajectories/{tid}/finish", json={"reward": reward})
    if log is not None:
        line = {
            "trajectory_id": tid,
            "temperature": sampling["temperature"],
            "reward": reward,
            "metrics": metrics,
        }
        log.write(json.dumps({**line, "error": _text(error)}) + "\n")
        log.flush()
    return True


def _text(error: Any) -> str | None:
    return None if error is None else str(error)[:500]


async def run_agent(
    env, url: str, concurrency: int = 64, idle_s: float = 300.0, log_path: str | None = None
) -> None:
    """Play the server's tasks with `env` until none came for `idle_s` seconds."""
    import httpx
    from openai import AsyncOpenAI

    llm = AsyncOpenAI(base_url=url, api_key="unused", max_retries=20, timeout=600)
    last = [time.monotonic()]
    log = open(log_path, "a") if log_path else None
    try:
        async with httpx.AsyncClient(timeout=120) as http:

            async def worker() -> None:
                while time.monotonic() - last[0] < idle_s:
                    try:
                        if await _episode(env, url, llm, http, log):
                            last[0] = time.monotonic()
                    except httpx.TransportError:  # the trainer is starting up or between steps
                        await asyncio.sleep(1)
                    except httpx.HTTPStatusError as e:
                        print(f"verifiers_bridge: {e}", file=sys.stderr, flush=True)
                        await asyncio.sleep(1)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        if log is not None:
            log.close()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hybridrl.env.verifiers_bridge", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("data", "agent"):
        p = sub.add_parser(name)
        p.add_argument("--env", required=True, help="a verifiers environment id, or module:callable")
        p.add_argument("--env-args", default="{}", help="JSON object of the environment's arguments")
    data = sub.choices["data"]
    data.add_argument("--out", required=True)
    data.add_argument("--n-train", type=int, default=-1, help="rows of the train dataset (-1: all)")
    data.add_argument("--n-val", type=int, default=-1, help="rows of the eval dataset (-1: all)")
    agent = sub.choices["agent"]
    agent.add_argument("--url", default="http://127.0.0.1:8000/v1")
    agent.add_argument("--concurrency", type=int, default=64)
    agent.add_argument("--idle-s", type=float, default=300.0, help="stop after this long without a task")
    agent.add_argument(
        "--log",
        default=None,
        help="append one JSON line per trajectory (temperature, reward, rubric metrics, error)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    env_args = json.loads(args.env_args)
    if not isinstance(env_args, dict):
        raise SystemExit(f"--env-args must be a JSON object, got {args.env_args!r}")
    env = load_env(args.env, env_args)
    if args.cmd == "data":
        import pandas as pd

        os.makedirs(args.out, exist_ok=True)
        for split, n in (("train", args.n_train), ("val", args.n_val)):
            rows = make_rows(env, split, n)
            pd.DataFrame(rows).to_parquet(os.path.join(args.out, f"{split}.parquet"), index=False)
            print(f"wrote {args.out}/{split}.parquet ({len(rows)} rows)")
        return
    asyncio.run(run_agent(env, args.url.rstrip("/"), args.concurrency, args.idle_s, args.log))


if __name__ == "__main__":
    main()
