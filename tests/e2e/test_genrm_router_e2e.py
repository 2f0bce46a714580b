"""A real main_ppo step scored by a GenRM reward function written for veRL (tests/reward/verl_genrm_fns.py:
async def, aiohttp POSTs to http://{reward_router_address}/v1/chat/completions): Ray reward-loop
workers call it, the GenRM router (an async Ray actor) forwards to the judge's replica (HF generate in
its own Ray actor). Its scores must be the client path's (the GenRM recipe's function) exactly, and the
router must be gone after the run (port closed, actor ended)."""

from __future__ import annotations

import importlib.util
import os
import socket
import time

import pandas as pd
import pytest

from tests.e2e.ppo_runs import run

pytest.importorskip("openai")  # the veRL-shaped function parses with openai's types

HERE = os.path.dirname(__file__)
RECIPES = os.path.join(HERE, "..", "..", "recipes", "genrm")
FNS = os.path.join(HERE, "..", "reward", "verl_genrm_fns.py")


def _data(tmp_path):
    """The built-in task's files with each row's question in extra_info (recipes/genrm/prepare_data.py)."""
    from hybridrl.data.builtin_task import ensure_builtin_data

    spec = importlib.util.spec_from_file_location("genrm_prepare", os.path.join(RECIPES, "prepare_data.py"))
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    files = ensure_builtin_data()
    out = {}
    for split in ("train", "val"):
        out[split] = str(tmp_path / f"{split}.parquet")
        prep.add_question(pd.read_parquet(files[split])).to_parquet(out[split])
    return out


def _genrm(data, path, name, *extra):
    return [
        f"data.train_files={data['train']}",
        f"data.val_files={data['val']}",
        "trainer.backend=ray",
        "trainer.total_training_steps=1",
        "reward_model.enable=True",
        "reward_model.use_reward_loop=True",
        "reward_model.model.path=builtin:tiny",
        "reward_model.rollout.name=hf",
        "reward_model.rollout.dtype=float32",
        "reward_model.rollout.do_sample=False",
        "reward_model.rollout.prompt_length=64",
        "reward_model.rollout.response_length=12",
        "reward_model.rollout.request_timeout_s=120",
        "reward_model.reward_manager=naive",
        f"custom_reward_function.path={path}",
        f"custom_reward_function.name={name}",
        *extra,
    ]


@pytest.mark.slow  # ~105 s on the shared 2 cores (two 1-step runs with Ray reward-loop workers and judge)
@pytest.mark.usefixtures("ray_local")
def test_a_verl_genrm_function_scores_a_main_ppo_step_as_the_client_path(tmp_path):
    import ray

    data = _data(tmp_path)
    log = tmp_path / "router_addresses.txt"
    client = run(_genrm(data, os.path.join(RECIPES, "judge_reward.py"), "compute_score"), tmp_path / "client")
    http = run(
        _genrm(data, FNS, "compute_score", f"+custom_reward_function.reward_kwargs.address_log={log}"),
        tmp_path / "http",
    )
    (c,), (h,) = [r for r in client if "actor/pg_loss" in r], [r for r in http if "actor/pg_loss" in r]
    for key in (
        "critic/score/mean",
        "reward/genrm_agree/mean",
        "reward/genrm_parse_failures",
        "actor/pg_loss",
    ):
        assert h[key] == c[key], key
    addresses = set(log.read_text().split())
    assert len(addresses) == 1  # one router for the run, seen by every reward-loop worker
    host, port = addresses.pop().rsplit(":", 1)
    with pytest.raises(OSError):  # shut down with the run
        socket.create_connection((host, int(port)), timeout=2).close()
    deadline = time.monotonic() + 30  # ray.kill is asynchronous: the name goes when the actor has ended
    while [a for a in ray.util.list_named_actors() if "genrm_router" in a] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [a for a in ray.util.list_named_actors() if "genrm_router" in a]
