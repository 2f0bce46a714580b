"""The tool agent inside main_async's rollout workers (slow: two worker pools)."""

from __future__ import annotations

import importlib
import math
import os

import pandas as pd
import pytest

from hybridrl.data import agent_task

run_async = importlib.import_module("tests.async.test_async_e2e").run_async  # `async` is a keyword

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "agent")


def agent_task_overrides(tmp_path) -> list[str]:
    """The built-in calculator-agent task written to parquet under `tmp_path` (16 train rows, 8 val),
    and the overrides that run the tool agent on it (two assistant turns, 48 response tokens)."""
    pd.DataFrame(agent_task.make_rl_rows(16, 0, "train")).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(agent_task.make_rl_rows(8, 1, "val")).to_parquet(tmp_path / "val.parquet")
    return [
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet",
        "data.return_raw_chat=true",
        "data.max_prompt_length=16",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={RECIPE}/calculator_tool.yaml",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=ignore_strippable",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ]


def test_async_trainer_runs_the_tool_agent(tmp_path):
    trainer = run_async(
        [*agent_task_overrides(tmp_path), "async_training.max_head_offpolicyness=1"], tmp_path
    )
    rows = trainer.history
    assert len(rows) == 3
    for key in ("actor/pg_loss", "actor/behave_imp_weight", "num_turns/mean", "tool/calls_per_traj"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert "val-core/hybridrl/arith_tool/acc/mean@1" in rows[-1]
