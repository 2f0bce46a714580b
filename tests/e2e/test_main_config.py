"""`main(config)` on a config composed with hydra's compose API, as veRL's tutorial calls its
`main(config)`: main_ppo (with GDPO on two reward components), main_async and main_sft."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from tests.e2e.ppo_runs import SMALL, assert_finite, read_metrics

SCORE_FN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    fmt = float("####" in solution_str)
    acc = float(solution_str.strip().endswith(str(ground_truth)))
    return {"score": acc + 0.5 * fmt, "acc_part": acc, "fmt_part": fmt}
"""


def _compose(name, overrides):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        return compose(name, overrides=overrides)


def test_main_ppo_runs_a_composed_config_with_gdpo(tmp_path, monkeypatch):
    from hybridrl.trainer.main_ppo import main

    score = tmp_path / "score.py"
    score.write_text(SCORE_FN)
    monkeypatch.setenv("HYBRIDRL_LOG_DIR", str(tmp_path / "logs"))
    cfg = _compose(
        "ppo_trainer",
        [
            *SMALL,
            f"trainer.default_local_dir={tmp_path}/ckpt",
            "algorithm.adv_estimator=gdpo",
            "+algorithm.gdpo_reward_keys=[acc_part,fmt_part]",
            "algorithm.gdpo_reward_weights=[1.0,0.5]",
            f"custom_reward_function.path={score}",
            "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
        ],
    )
    main(cfg)
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert len([r for r in rows if "actor/pg_loss" in r]) == 2
    assert_finite(rows, ["actor/pg_loss", "gdpo/acc_part/mean", "gdpo/fmt_part/std"])


@pytest.mark.slow
def test_main_async_runs_a_composed_config(tmp_path, monkeypatch):
    from hybridrl.trainer.async_ppo.launch import ASYNC_DEFAULTS
    from hybridrl.trainer.main_async import main

    monkeypatch.setenv("HYBRIDRL_LOG_DIR", str(tmp_path / "logs"))
    cfg = _compose("ppo_trainer", [*ASYNC_DEFAULTS, *SMALL, f"trainer.default_local_dir={tmp_path}/ckpt"])
    main(cfg)
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert_finite(rows, ["actor/pg_loss"])


@pytest.mark.slow
def test_main_sft_runs_a_composed_config(tmp_path):
    from hybridrl.trainer.main_sft import main

    cfg = _compose(
        "sft_trainer",
        ["trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.logger=[]"],
    )
    metrics = main(cfg)
    assert metrics and all(isinstance(v, float) for v in metrics.values())  # the final validation
