"""Environments under main_async: the env_agent loop (guess-the-number) in the asynchronous
trainer's rollout workers, its rewards and the env/* fault counts in the step metrics (slow: two
worker pools)."""

from __future__ import annotations

import importlib
import math

import pandas as pd
import pytest

from hybridrl.env.guess_number import make_rows

run_async = importlib.import_module("tests.async.test_async_e2e").run_async  # `async` is a keyword

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("ray_local")]


def test_async_trainer_plays_an_environment(tmp_path):
    pd.DataFrame(make_rows(16, 0, high=4, max_turns=3)).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(make_rows(8, 1, high=4, max_turns=3)).to_parquet(tmp_path / "val.parquet")
    trainer = run_async(
        [
            f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/val.parquet",
            "algorithm.adv_estimator=grpo",
            "data.return_raw_chat=true",
            "data.max_prompt_length=16",
            "data.max_response_length=48",
            "actor_rollout_ref.rollout.agent.default_agent_loop=env_agent",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "async_training.max_head_offpolicyness=1",
        ],
        tmp_path,
    )
    rows = trainer.history
    assert len(rows) == 2
    for key in (
        "actor/pg_loss",
        "critic/score/mean",
        "num_turns/mean",
        "env/errors",
        "env/timeouts",
        "env/malformed",
    ):
        assert all(key in r and math.isfinite(r[key]) for r in rows), (key, sorted(rows[-1]))
    for r in rows:
        assert r["env/errors"] == r["env/timeouts"] == r["env/malformed"] == 0, r
        assert 0.0 <= r["critic/score/mean"] <= 1.0  # the episode reward: 1 when the secret is found
        assert r["num_turns/mean"] >= 3  # prompt + at least one guess and its answer
    assert any(k.startswith("val-core/hybridrl/env/") for k in rows[-1]), sorted(rows[-1])
