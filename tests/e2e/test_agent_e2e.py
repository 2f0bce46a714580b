"""End-to-end: a veRL-format tool yaml and a dataset with `agent_name` / `extra_info.tools_kwargs`
columns, run unchanged through main_ppo (real Ray actors, FSDP2, HF rollout, the tool agent)."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from hybridrl.data import agent_task
from tests.e2e.ppo_runs import assert_finite, run

pytestmark = pytest.mark.usefixtures("ray_local")

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "agent")

VERL_GSM8K_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_tool_agent_runs_through_main_ppo(tmp_path):
    rows = agent_task.make_rl_rows(16, 0, "train")
    rows[1]["agent_name"] = "single_turn_agent"  # per-row routing inside one batch
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(agent_task.make_rl_rows(8, 1, "val")).to_parquet(tmp_path / "val.parquet")
    (tmp_path / "gsm8k_tool_config.yaml").write_text(VERL_GSM8K_YAML)
    (tmp_path / "fn_tools.py").write_text(
        "from hybridrl.tools.tool import function_tool\n\n"
        '@function_tool\ndef echo(text: str) -> str:\n    """Echo the text."""\n    return text\n'
    )
    metrics = run(
        [
            "algorithm.adv_estimator=grpo",
            f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/val.parquet",
            "data.return_raw_chat=true",
            "data.max_prompt_length=16",
            "data.max_response_length=48",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/gsm8k_tool_config.yaml",
            f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tmp_path}/fn_tools.py",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=ignore_strippable",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ],
        tmp_path,
    )
    train = [r for r in metrics if "actor/pg_loss" in r]
    assert len(train) == 2
    assert_finite(train, ["actor/pg_loss", "num_turns/mean", "tool/calls_per_traj", "tool/error_rate"])
    assert any(k.startswith("val-core/hybridrl/arith_tool/") for k in metrics[-1])


def test_calculator_yaml_is_verl_format():
    from hybridrl.tools.tool_loading import load_tools_from_yaml

    (tool,) = load_tools_from_yaml(os.path.join(RECIPE, "calculator_tool.yaml"))
    assert tool.name == "calc"
