"""On-policy distillation in main_async: the teacher step of main_ppo (trainer/ppo/teachers.py) on each
consumed batch. With eta = 0 the asynchronous trainer is synchronous PPO, so with a teacher it must
give main_ppo's run step for step: the same metrics (the distillation loss and KL included) and the
same final weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config

SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_prefix_grouper=false",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[console]",
    "trainer.progress_bar=false",
    "trainer.make_report=false",
    "trainer.cpus_per_worker=1",
    "trainer.resume_mode=disable",
    "distillation.enabled=true",
    "distillation.teacher_models.teacher_model.model_path=builtin:tiny",
    "distillation.teacher_models.teacher_model.inference.temperature=2.0",  # a teacher that differs from the student
]
KEYS = [
    "distillation/loss", "distillation/student_teacher_kl", "critic/score/mean", "actor/pg_loss",
    "actor/grad_norm", "response_length/mean",
]  # fmt: skip


def _fit(trainer, policy, out_dir):
    """Train, export the final actor as an HF folder; returns its {name: tensor}."""
    try:
        trainer.fit()
        policy.export_hf(str(out_dir))
    finally:
        trainer.tracker.finish()
    return load_file(str(out_dir / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_eta0_async_distillation_equals_main_ppo(tmp_path):
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.async_ppo.trainer import build_async_trainer
    from hybridrl.trainer.ppo.config import load_config
    from hybridrl.trainer.ppo.setup import build_trainer

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[*SMALL, f"trainer.default_local_dir={tmp_path}/s"])
    sync = build_trainer(load_config(cfg))
    try:
        sync_w = _fit(sync, sync.workers.actor_rollout, tmp_path / "sync_hf")
    finally:
        sync.workers.shutdown()
    cfg = compose_async_config(
        [
            *SMALL,
            f"trainer.default_local_dir={tmp_path}/a",
            "async_training.max_head_offpolicyness=0",
            "async_training.use_decoupled_loss=false",
        ]
    )
    asyn = build_async_trainer(load_async_config(cfg))
    try:
        async_w = _fit(asyn, asyn.async_workers.actor_rollout, tmp_path / "async_hf")
    finally:
        asyn.async_workers.shutdown()
    assert asyn.consumed_versions == [[0] * 4, [1] * 4]
    assert len(sync.history) == len(asyn.history) == 2
    assert sync.history[0]["distillation/student_teacher_kl"] > 1e-3  # the teacher's temperature differs
    for s, a in zip(sync.history, asyn.history, strict=True):
        for key in KEYS:
            assert a[key] == s[key], key  # bit-identical: same samples, same teacher, same updates
    assert sorted(sync_w) == sorted(async_w) and sync_w
    for name, w in sync_w.items():
        assert torch.equal(w, async_w[name]), name
