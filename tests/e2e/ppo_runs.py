"""Helpers for the end-to-end PPO tests: compose the real config with small overrides and run it."""

from __future__ import annotations

import json
import math
import os

from hydra import compose, initialize_config_module

from hybridrl.trainer.ppo.config import load_config
from hybridrl.trainer.ppo.launch import run_ppo_config

# A few seconds per step on 2 CPU cores: 4 prompts x 4 responses, short validation.
SMALL = [
    "data.train_batch_size=4",
    "data.val_max_samples=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.logger=[console,file]",
    "trainer.progress_bar=false",
    "trainer.make_report=false",
    "trainer.cpus_per_worker=1",
]


def compose_config(overrides, tmp_path):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_trainer",
            overrides=[*SMALL, f"trainer.default_local_dir={tmp_path}/ckpt", *overrides],
        )
    return load_config(cfg)


def run(overrides, tmp_path) -> list[dict]:
    """Run PPO with `overrides`; returns the per-step metrics read back from the file logger."""
    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / "logs")
    config = compose_config(overrides, tmp_path)
    run_ppo_config(config)
    return read_metrics(tmp_path / "logs" / "metrics.jsonl")


def read_metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_finite(rows: list[dict], keys) -> None:
    for key in keys:
        values = [r[key] for r in rows if key in r]
        assert values, f"metric {key} was never logged; logged: {sorted(rows[-1])}"
        assert all(v is not None and math.isfinite(v) for v in values), (key, values)
