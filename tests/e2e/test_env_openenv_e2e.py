"""An OpenEnv environment, unchanged, trains 2 GRPO steps through main_ppo (`env_name: openenv`).

openenv-core ships no environment of its own beyond the one `openenv init` writes (an echo
environment: it answers each action's message with the message itself and rewards it with 0.1 x
its length); its published environments are Docker images. The test writes that environment with
the package's own CLI, serves it with the package's own server (`create_app`, uvicorn) in a
subprocess, and trains on it: each episode opens a WebSocket session with openenv-core's
`GenericEnvClient` from its own episode process. The prompts are the built-in task's (so the
built-in model ends its turns), each answer is echoed back as the next user turn, and every reward
is the environment's (0.1 x the characters the policy wrote).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pandas as pd
import pytest

from hybridrl.data import builtin_task
from hybridrl.env.base import ENV_DATA_SOURCE
from tests.e2e.ppo_runs import assert_finite, run

pytest.importorskip("openenv")
pytestmark = [pytest.mark.timeout(1200), pytest.mark.usefixtures("ray_local")]

SERVE = """\
import sys
sys.path.insert(0, {env_dir!r})
import uvicorn
from openenv.core.env_server.http_server import create_app
from models import EchoE2eAction, EchoE2eObservation
from server.echo_e2e_environment import EchoE2eEnvironment

app = create_app(EchoE2eEnvironment, EchoE2eAction, EchoE2eObservation, env_name="echo_e2e", max_concurrent_envs=64)
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    """The `openenv init` echo environment served by openenv-core's app; yields its URL."""
    root = tmp_path_factory.mktemp("openenv")
    cli = [sys.executable, "-c", "from openenv.cli.__main__ import main; main()"]
    subprocess.run([*cli, "init", "echo_e2e"], cwd=root, check=True, capture_output=True, timeout=120)
    env_dir = root / "echo_e2e"
    assert (env_dir / "server" / "echo_e2e_environment.py").exists()
    port = _free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(env_dir=str(env_dir), port=port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert proc.poll() is None, (root / "server.log").read_text()
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def rows(n: int, seed: int, split: str, url: str) -> list[dict]:
    """Built-in task prompts (`12+34=`: the built-in model answers and ends its turn) played on the echo server."""
    return [
        {
            "data_source": ENV_DATA_SOURCE,
            "agent_name": "env_agent",
            "prompt": r["prompt"],
            "ability": "echo",
            "reward_model": {"style": "environment", "ground_truth": ""},
            "extra_info": {
                "index": i,
                "env_name": "openenv",
                "env_kwargs": {
                    "base_url": url,
                    "observation_field": "echoed_message",
                    "first_message": "row",
                },
            },
        }
        for i, r in enumerate(builtin_task.make_rl_rows(n, seed, split))
    ]


def test_openenv_echo_environment_trains_two_grpo_steps(echo_server, tmp_path):
    pd.DataFrame(rows(8, 0, "train", echo_server)).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(rows(4, 1, "val", echo_server)).to_parquet(tmp_path / "val.parquet")
    dump = tmp_path / "rollouts"
    loops = tmp_path / "loops.yaml"  # deadlines for a loaded 2-core machine
    loops.write_text(
        "- {name: env_agent, _target_: hybridrl.env.loop.EnvAgentLoop, timeout_s: 120, start_timeout_s: 600}\n"
    )
    metrics = run(
        [
            "algorithm.adv_estimator=grpo",
            f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/val.parquet",
            "data.return_raw_chat=true",
            "data.max_prompt_length=40",
            "data.max_response_length=96",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.agent.default_agent_loop=env_agent",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "trainer.n_gpus_per_node=1",
            "trainer.test_freq=-1",
            f"trainer.rollout_data_dir={dump}",
        ],
        tmp_path,
    )
    train = [m for m in metrics if "actor/pg_loss" in m]
    assert len(train) == 2
    assert_finite(train, ["actor/pg_loss", "critic/score/mean"])
    for m in train:
        assert m.get("env/errors", 0) == 0 and m.get("env/timeouts", 0) == 0, m
    samples = [json.loads(line) for f in sorted(dump.glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4
    # every reward is the environment's: 0.1 x the characters of each turn it was sent (a turn cut off
    # by the length budget is never sent, so it is not rewarded)
    for s in samples:
        assert s["score"] <= 0.1 * len(s["response"]) + 1e-6, s
        assert abs(s["score"] * 10 - round(s["score"] * 10)) < 1e-4, s
    assert sum(s["score"] > 0 for s in samples) >= len(samples) // 2, samples[:4]
    assert any(abs(s["score"] - 0.1 * len(s["response"])) < 1e-6 and s["score"] > 0 for s in samples)
