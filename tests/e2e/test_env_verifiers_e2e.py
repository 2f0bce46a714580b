"""A `verifiers` environment, unchanged, trains 2 GRPO steps through main_ppo.

The environment is written as environments of verifiers' hub are (a module with
`load_environment()` returning a `vf.SingleTurnEnv` with its own parser and rubric), on the
built-in task so the built-in model earns some reward. It runs in a process of its own
(`python -m hybridrl.env.verifiers_bridge agent`): its own `run_rollout` generates through the
rollout server's OpenAI endpoint (`rollout.mode=server`) and its rubric's reward is the
trajectory's reward (`agent_server.reward_source=agent`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from tests.e2e.ppo_runs import assert_finite, run

pytest.importorskip("verifiers")
pytest.importorskip("openai")
pytestmark = [pytest.mark.timeout(1200), pytest.mark.usefixtures("ray_local")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV_MODULE = textwrap.dedent(
    '''
    """A verifiers environment on the built-in task: answer `a+b=` with `#### <sum>`."""
    import verifiers as vf
    from datasets import Dataset

    from hybridrl.data import builtin_task


    def _dataset(n, seed, split):
        rows = builtin_task.make_rl_rows(n, seed, split)
        return Dataset.from_list(
            [{"question": r["prompt"][0]["content"], "answer": r["reward_model"]["ground_truth"]} for r in rows]
        )


    def correct_sum(completion, answer, parser, **kwargs):
        return 1.0 if parser.parse_answer(completion) == answer else 0.0


    def load_environment(n_train=64, n_eval=16):
        parser = vf.Parser(extract_fn=lambda text: text.split("####")[-1].strip())
        rubric = vf.Rubric(funcs=[correct_sum], parser=parser)
        return vf.SingleTurnEnv(
            dataset=_dataset(n_train, 0, "train"), eval_dataset=_dataset(n_eval, 1, "val"), parser=parser, rubric=rubric
        )
    '''
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_verifiers_environment_trains_two_grpo_steps(tmp_path):
    from hybridrl.env.verifiers_bridge import load_env, make_rows

    (tmp_path / "vf_builtin_sum.py").write_text(ENV_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        env = load_env("vf_builtin_sum:load_environment")
    finally:
        sys.path.remove(str(tmp_path))
    pd.DataFrame(make_rows(env, "train")).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(make_rows(env, "val")).to_parquet(tmp_path / "val.parquet")
    port, log = _free_port(), tmp_path / "trajectories.jsonl"
    agent_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    agent = subprocess.Popen(
        [sys.executable, "-m", "hybridrl.env.verifiers_bridge", "agent", "--env", "vf_builtin_sum:load_environment",
         "--url", f"http://127.0.0.1:{port}/v1", "--concurrency", "16", "--idle-s", "120", "--log", str(log)],
        env=agent_env, stdout=open(tmp_path / "agent.out", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        metrics = run(
            [
                "algorithm.adv_estimator=grpo",
                f"data.train_files={tmp_path}/train.parquet",
                f"data.val_files={tmp_path}/val.parquet",
                "data.return_raw_chat=true",
                "data.max_prompt_length=16",
                "data.max_response_length=16",
                "actor_rollout_ref.rollout.name=hf",
                "actor_rollout_ref.rollout.mode=server",
                f"actor_rollout_ref.rollout.agent_server.port={port}",
                "actor_rollout_ref.rollout.agent_server.reward_source=agent",
                "actor_rollout_ref.rollout.agent_server.claim_timeout_s=120",
                "trainer.n_gpus_per_node=1",
                "trainer.test_freq=-1",
            ],
            tmp_path,
        )
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    train = [m for m in metrics if "actor/pg_loss" in m]
    assert len(train) == 2
    assert_finite(train, ["actor/pg_loss", "critic/score/mean"])
    played = [json.loads(line) for line in log.read_text().splitlines()]
    validated = [p for p in played if p["temperature"] == 0]  # the validation after the last step (greedy)
    played = [p for p in played if p["temperature"] > 0]
    assert len(played) == 2 * 4 * 4, (tmp_path / "agent.out").read_text()[-2000:]
    assert len(validated) == 16
    # the rubric scored every trajectory (its reward function's metric), and its reward is the trainer's score
    assert all(p["error"] is None and p["reward"] == p["metrics"]["correct_sum"] for p in played), played[:3]
    assert any(p["reward"] > 0 for p in played)
    mean_logged = sum(p["reward"] for p in played) / len(played)
    mean_trained = sum(m["critic/score/mean"] for m in train) / len(train)
    assert mean_logged == pytest.approx(mean_trained, abs=1e-6)
