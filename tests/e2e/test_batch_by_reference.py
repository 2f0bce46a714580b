"""The fit loop with its batch held by reference (BatchRef) logs exactly what the through-the-driver
loop logs, and the token-level tensors do not pass through the driver.

Two Ray ranks, two steps: the default trainer (by reference) against the same trainer with its
batch kept on the driver (`BATCH_BY_REFERENCE = False`), with GRPO (its per-token half on the
workers) and GAE (a critic, KL in the reward, the estimator on one worker).
"""

from __future__ import annotations

import pytest

from hybridrl.single_controller.batch_ref import TRANSFER
from hybridrl.trainer.ppo.trainer import RayPPOTrainer
from tests.e2e.ppo_runs import compose_config, read_metrics

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]  # two 2-rank runs each

_TIMES = (
    "time",
    "timing",
    "_s",
    "tok/s",
    "throughput",
    "mfu",
    "perf/",
    "rss",
    "memory",
    "seconds",
)  # wall-clock


class DriverPathTrainer(RayPPOTrainer):
    BATCH_BY_REFERENCE = False


def _run(overrides, tmp_path, trainer_cls=None) -> list[dict]:
    import os

    from hybridrl.trainer.ppo.launch import run_ppo_config

    os.environ["HYBRIDRL_LOG_DIR"] = str(tmp_path / "logs")
    run_ppo_config(compose_config(["trainer.backend=ray", "trainer.n_gpus_per_node=2", *overrides], tmp_path),
                   trainer_cls=trainer_cls)  # fmt: skip
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    return [
        {k: v for k, v in r.items() if not any(t in k for t in _TIMES)} for r in rows if "actor/pg_loss" in r
    ]


def _assert_same(by_ref: list[dict], driver: list[dict]) -> None:
    assert len(by_ref) == len(driver) == 2
    for a, b in zip(by_ref, driver):
        assert set(a) == set(b), sorted(set(a) ^ set(b))
        differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not differ, differ


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=grpo", "trainer.balance_batch=true"],
        [
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "actor_rollout_ref.rollout.n=1",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=4",
        ],
    ],
    ids=["grpo", "gae"],
)
def test_by_reference_logs_what_the_driver_path_logs(overrides, tmp_path):
    TRANSFER.clear()
    by_ref = _run(overrides, tmp_path / "ref")
    moved = dict(TRANSFER)
    driver = _run(overrides, tmp_path / "driver", trainer_cls=DriverPathTrainer)
    _assert_same(by_ref, driver)
    assert moved.get("pulls", 0) == 0, moved  # nothing was brought back to the driver
    assert 0 < moved["put"], moved  # only the prompts went out
