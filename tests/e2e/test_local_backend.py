"""The in-process backend (trainer.backend=local) runs the same training as the Ray backend.

Two GRPO steps on the built-in tiny model, once with the worker in the driver process and once as
a Ray actor: the same seeds give the same rollouts, losses and gradient norms. A GAE run checks
the critic in the driver process.
"""

from __future__ import annotations

import math

import pytest

from hybridrl.single_controller.backend import resolve_backend
from hybridrl.trainer.ppo.config import ConfigError
from tests.e2e.ppo_runs import assert_finite, compose_config, run

pytestmark = pytest.mark.usefixtures("ray_local")

_NOT_COMPARED = ("timing_s/", "perf/", "timing_per_token_ms/")
_TIMES = ("_per_s", "seconds", "_s/")  # wall-clock quantities differ between any two runs


def _compared(rows: list[dict]) -> list[dict]:
    return [
        {
            k: v
            for k, v in r.items()
            if not k.startswith(_NOT_COMPARED)
            and not any(t in k for t in _TIMES)
            and isinstance(v, (int, float))
        }
        for r in rows
        if "actor/pg_loss" in r
    ]


def test_local_backend_equals_ray_backend(tmp_path):
    local = _compared(run(["trainer.backend=local"], tmp_path / "local"))
    ray_rows = _compared(run(["trainer.backend=ray"], tmp_path / "ray"))
    assert len(local) == len(ray_rows) == 2
    for a, b in zip(local, ray_rows):
        assert set(a) == set(b)
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-7), (key, a[key], b[key])


def test_local_backend_with_a_critic(tmp_path):
    # not compared with Ray: the fresh value head's initialisation differs from run to run there
    extra = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=8"]
    rows = run([*extra, "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.backend=local"], tmp_path)
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    assert_finite(train, ["critic/vf_loss", "critic/values/mean", "critic/grad_norm", "actor/grad_norm"])


def test_backend_choice_and_errors(tmp_path):
    assert resolve_backend("auto", slots=1, use_gpu=False) == "ray"  # Ray is running (fixture)
    assert resolve_backend("local", slots=1, use_gpu=False) == "local"
    assert resolve_backend("auto", slots=2, use_gpu=False) == "ray"
    with pytest.raises(ConfigError, match="trainer.backend=local runs one worker in the driver"):
        compose_config(["trainer.backend=local", "trainer.n_gpus_per_node=2"], tmp_path)
    with pytest.raises(ConfigError, match="trainer.backend='mpi'"):
        compose_config(["trainer.backend=mpi"], tmp_path)
