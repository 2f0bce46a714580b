"""On-policy distillation end to end: a colocated teacher on 2 Ray ranks (FSDP2), self-distillation.

With the teacher = the student's own starting weights, the teacher's log-probs at step 1 equal the
student's old log-probs exactly (same model, same fp32 forward), so the per-token KL and the k3
loss are 0; after one update the student has moved and both are > 0. The teacher's path is in the
checkpoint's meta and it is not checkpointed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.teachers import route_rows
from tests.e2e.ppo_runs import assert_finite, run

DISTILL = [
    "distillation.enabled=true",
    "distillation.teacher_models.teacher_model.model_path=builtin:tiny",
    "trainer.n_gpus_per_node=2",
    "trainer.backend=ray",
    "trainer.save_freq=2",
]


def _two_steps(tmp_path, *extra):
    rows = [r for r in run([*DISTILL, *extra], tmp_path) if "actor/pg_loss" in r]
    assert len(rows) == 2
    assert_finite(rows, ["distillation/loss", "distillation/student_teacher_kl", "timing_s/teacher"])
    first = rows[0]
    assert abs(first["distillation/student_teacher_kl"]) < 1e-5  # the teacher sees the student's tokens
    assert abs(first["distillation/loss"]) < 1e-6  # k3 of identical log-probs
    assert all(r["timing_s/teacher"] > 0 for r in rows)
    return rows


@pytest.mark.usefixtures("ray_local")
def test_self_distillation_without_task_rewards_never_moves_and_records_the_teacher(tmp_path):
    # use_task_rewards=false drops the GRPO loss; k3's gradient is 0 at identical log-probs, so the
    # student stays the teacher: the step-2 loss is still 0. The student's forward must be the
    # teacher's exactly: with the shared-prompt forward (use_prefix_grouper=auto turns it on for
    # GRPO) the two differ by round-off, whose ~1e-7 gradients Adam turns into lr-sized moves.
    rows = _two_steps(
        tmp_path,
        "distillation.distillation_loss.use_task_rewards=false",
        "actor_rollout_ref.actor.use_prefix_grouper=false",
    )
    assert abs(rows[1]["distillation/loss"]) < 1e-6
    meta = json.loads((tmp_path / "ckpt" / "global_step_2" / "meta.json").read_text())
    assert meta["distillation_teachers"] == {"default": "builtin:tiny"}
    assert sorted(meta["parts"]) == ["actor"]  # the teacher is not checkpointed


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_self_distillation_with_task_rewards_moves_away_from_the_teacher(tmp_path):
    rows = _two_steps(tmp_path)  # GRPO moves the student at step 1: at step 2 it differs from the teacher
    assert rows[1]["distillation/loss"] > 1e-6 and abs(rows[1]["distillation/student_teacher_kl"]) > 1e-6


@pytest.mark.usefixtures("ray_local")
def test_self_distillation_forward_kl_topk_is_zero_at_step_one(tmp_path):
    # teacher = student: the top-k forward KL of identical distributions is 0 at step 1; the top-k
    # masses are the same and close to 1 (k = 16 of a 103-token vocabulary, a peaked model)
    rows = _two_steps(
        tmp_path,
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.topk=16",
        "distillation.distillation_loss.use_task_rewards=false",
    )
    first = rows[0]
    assert abs(first["distillation/student_mass"] - first["distillation/teacher_mass"]) < 1e-5
    assert 0.5 < first["distillation/teacher_mass"] <= 1.0 + 1e-6
    # the truncated KL's gradient raises the top-k tokens' mass: the student moves at step 1
    assert rows[1]["distillation/loss"] >= 0 and abs(rows[1]["distillation/student_teacher_kl"]) > 1e-7


def _batch(sources):
    return DataProto.from_dict(
        {"responses": torch.zeros(len(sources), 2, dtype=torch.long)},
        non_tensors={"data_source": np.array(sources, dtype=object)},
    )


def test_rows_are_routed_by_teacher_key():
    got = route_rows(_batch(["a", "b", "a"]), ["a", "b"], "data_source")
    assert {k: v.tolist() for k, v in got.items()} == {"a": [0, 2], "b": [1]}
    assert route_rows(_batch(["x"]), ["default"], "data_source")["default"].tolist() == [0]
    with pytest.raises(KeyError, match=r"data_source=\['c'\] have no teacher"):
        route_rows(_batch(["a", "c"]), ["a", "b"], "data_source")
    with pytest.raises(KeyError, match="teacher_key='task' is not a field"):
        route_rows(_batch(["a"]), ["a", "b"], "task")


@pytest.mark.slow
def test_distillation_sigkill_resume_matches_uninterrupted(tmp_path):
    """SIGKILL after the step-2 checkpoint, resume: steps 3 and 4 (teacher log-probs, distillation
    loss and KL included) equal the uninterrupted run's. The teacher is not checkpointed: it is
    rebuilt from its path, so a resume that loaded the wrong teacher or lost the student's state
    shows in the distillation metrics. Task rewards on, so the student moves away from the teacher
    and the loss is not zero."""
    from tests.e2e.ppo_runs import SMALL
    from tests.e2e.test_resume import COMPARED, check_sigkill_resume

    args = [
        *SMALL, "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1",
        "distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=builtin:tiny",
        "distillation.distillation_loss.use_task_rewards=true",
    ]  # fmt: skip
    keys = [*COMPARED, "distillation/loss", "distillation/student_teacher_kl"]
    check_sigkill_resume(tmp_path, args, keys)
