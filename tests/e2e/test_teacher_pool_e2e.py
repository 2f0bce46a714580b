"""A separate teacher pool (`distillation.nnodes > 0`, trainer/ppo/teacher_pool.py) end to end: the
teacher in two replicas of its own Ray worker processes, each given half the rows, must give the
colocated teacher's step: the same loss, KL, pg loss and grad norm (fp32, 1e-6) for two steps (at
step 2 the student has moved, so a row in the wrong order would show)."""

from __future__ import annotations

import os

import pytest

from tests.e2e.ppo_runs import run

DISTILL = [
    "distillation.enabled=true",
    "distillation.teacher_models.teacher_model.model_path=builtin:tiny",
    "trainer.backend=ray",
    "actor_rollout_ref.actor.use_prefix_grouper=false",
]
STEP_KEYS = ["distillation/loss", "distillation/student_teacher_kl", "actor/pg_loss", "actor/grad_norm"]


@pytest.fixture(scope="module")
def ray_3cpus():
    """Ray with 3 logical CPUs: the actor's slot and the teachers' two (one thread each)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        runtime_env={
            "env_vars": {
                "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
            }
        },
    )
    yield ray
    ray.shutdown()


def _steps(tmp_path, *extra):
    rows = [r for r in run([*DISTILL, *extra], tmp_path) if "actor/pg_loss" in r]
    assert len(rows) == 2
    return rows


@pytest.mark.slow  # ~75 s on the shared 2 cores: two runs of 2 steps, the second with 3 worker processes
@pytest.mark.usefixtures("ray_3cpus")
def test_separate_teacher_pool_equals_the_colocated_teacher(tmp_path):
    colocated = _steps(tmp_path / "colocated")
    separate = _steps(
        tmp_path / "separate",
        "distillation.nnodes=1",
        "distillation.n_gpus_per_node=2",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
    )
    assert abs(separate[1]["distillation/student_teacher_kl"]) > 1e-7  # the student has moved
    for c, s in zip(colocated, separate, strict=True):
        for key in STEP_KEYS:
            assert s[key] == pytest.approx(c[key], abs=1e-6, rel=1e-6), key
    assert all(r["timing_s/teacher"] > 0 for r in separate)
