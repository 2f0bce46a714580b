"""veRL's `distillation.*` keys: defaults, the teachers' resolution, start-up errors naming key and fix."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

import hybridrl
from hybridrl.trainer.ppo.config import load_config
from hybridrl.utils.config_loader import ConfigError

CONFIG_DIR = os.path.join(os.path.dirname(hybridrl.__file__), "trainer", "config")
TEACHER = "distillation.teacher_models.teacher_model.model_path=builtin:tiny"
ON = ["distillation.enabled=true", TEACHER]


def load(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return load_config(compose("ppo_trainer", overrides=list(overrides)))


def test_defaults_are_verls_and_disabled_changes_nothing():
    off, with_keys = (
        load(),
        load("distillation.enabled=false", TEACHER, "distillation.distillation_loss.loss_mode=k9"),
    )
    d = off.distillation
    assert not d.enabled and d.nnodes == 0 and d.n_gpus_per_node == 8 and d.teacher_key == "data_source"
    loss = d.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_task_rewards, loss.use_policy_gradient) == (
        "k3",
        32,
        True,
        False,
    )
    assert (loss.loss_max_clamp, loss.log_prob_min_clamp, loss.policy_loss_mode) == (None, None, "vanilla")
    # disabled: nothing under distillation.* is checked, and the rest of the config is the same
    assert with_keys.actor_rollout_ref == off.actor_rollout_ref and with_keys.algorithm == off.algorithm


def test_single_teacher_gets_key_default_and_the_rollouts_interpolations():
    cfg = load(*ON)
    (key, teacher), = cfg.distillation.teachers().items()  # fmt: skip
    assert key == "default" and teacher.model_path == "builtin:tiny"
    inf = teacher.inference
    assert (inf.name, inf.temperature, inf.prompt_length) == ("hf", 1.0, cfg.data.max_prompt_length)


def test_multi_teacher_drops_the_default_entry_and_routes_by_key():
    cfg = load(
        "distillation.enabled=true",
        TEACHER,  # silently dropped, as in veRL
        "+distillation.teacher_models.a.key=math",
        "+distillation.teacher_models.a.model_path=pa",
        "+distillation.teacher_models.b.key=code",
        "+distillation.teacher_models.b.model_path=pb",
    )
    assert {k: t.model_path for k, t in cfg.distillation.teachers().items()} == {"math": "pa", "code": "pb"}


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["distillation.enabled=true"], r"teacher_models.teacher_model.model_path is required"),
        ([*ON, "distillation.distillation_loss.loss_mode=k9"], r"loss_mode='k9'.*forward_kl_topk.*k3"),
        ([*ON, "distillation.distillation_loss.loss_mode=k1"], r"use_policy_gradient=true"),
        ([*ON, "distillation.distillation_loss.policy_loss_mode=gspo"], r"only 'vanilla'"),
        ([*ON, "distillation.distillation_loss.loss_max_clamp=0"], r"loss_max_clamp must be > 0"),
        ([*ON, "distillation.distillation_loss.log_prob_min_clamp=1"], r"log_prob_min_clamp must be < 0"),
        ([*ON, "distillation.distillation_loss.clip_ratio_low=1.5"], r"clip_ratio_low"),
        ([*ON, "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=0"],
         r"topk must be >= 1"),
        ([*ON, "distillation.distillation_loss.loss_mode=forward_kl_topk", "actor_rollout_ref.actor.use_prefix_grouper=true"],
         r"use_prefix_grouper=true is not implemented"),
        ([*ON, "distillation.teacher_models.teacher_model.inference.max_model_len=10"], r"max_model_len=10 <"),
        (["distillation.enabled=true", "+distillation.teacher_models.x.key=k", "+distillation.teacher_models.x.model_path=p",
          "+distillation.teacher_models.x.num_replicas=1"], r"sum to 2 slots.*= 0"),
        (["distillation.enabled=true", "+distillation.teacher_models.a.model_path=p",
          "+distillation.teacher_models.b.model_path=q", "+distillation.teacher_models.b.key=k"], r"teacher_models.a.key is required"),
        (["distillation.enabled=true", "+distillation.teacher_models.a.model_path=p", "+distillation.teacher_models.a.key=k",
          "+distillation.teacher_models.b.model_path=q", "+distillation.teacher_models.b.key=k"], r"also the key of"),
        ([*ON, "distillation.nnodes=1", "distillation.n_gpus_per_node=3"], r"not a multiple"),
        ([*ON, "+distillation.teacher_models.teacher_model.bogus=1"], r"unknown config key.*bogus"),
    ],
)  # fmt: skip
def test_bad_values_fail_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(*overrides)


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_forward_kl_topk_is_accepted_with_fsdp_and_megatron(strategy):
    loss = load(
        *ON,
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        f"actor_rollout_ref.actor.strategy={strategy}",
    ).distillation.distillation_loss
    assert (loss.loss_mode, loss.topk) == ("forward_kl_topk", 32)


def test_server_only_inference_keys_are_accepted_with_a_note(capsys):
    load(*ON, "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.3")
    assert "inference.{gpu_memory_utilization} tune an inference server" in capsys.readouterr().out


def test_main_async_accepts_distillation():
    from hybridrl.trainer.async_ppo.config import load_async_config

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("ppo_trainer", overrides=ON)
    assert load_async_config(cfg).distillation.enabled


def test_separate_pool_replicas_follow_verls_rule():
    from hybridrl.trainer.ppo.teacher_pool import replica_counts
    from hybridrl.trainer.ppo.teachers import teacher_pool_cpus

    single = load(*ON, "distillation.nnodes=1", "distillation.n_gpus_per_node=4").distillation
    assert replica_counts(single) == {"default": 2}  # pool 4 / (inference tp 2 x dp 1 x pp 1)
    cfg = load(
        "distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=3",
        "+distillation.teacher_models.a.key=math", "+distillation.teacher_models.a.model_path=pa",
        "+distillation.teacher_models.a.num_replicas=1",
        "+distillation.teacher_models.b.key=code", "+distillation.teacher_models.b.model_path=pb",
        "+distillation.teacher_models.b.num_replicas=1",
        "+distillation.teacher_models.b.inference.tensor_model_parallel_size=1", "trainer.cpus_per_worker=2",
    )  # fmt: skip
    assert replica_counts(cfg.distillation) == {"math": 1, "code": 1}
    assert teacher_pool_cpus(cfg) == 6 and teacher_pool_cpus(load(*ON)) == 0.0
    with pytest.raises(ConfigError, match=r"keys \['code'\] have num_replicas < 1"):
        load(
            "distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=2",
            "+distillation.teacher_models.a.key=math", "+distillation.teacher_models.a.model_path=pa",
            "+distillation.teacher_models.a.num_replicas=1",
            "+distillation.teacher_models.b.key=code", "+distillation.teacher_models.b.model_path=pb",
        )  # fmt: skip


def test_a_separate_pool_without_ray_workers_is_refused_naming_the_key():
    from hybridrl.trainer.ppo.teachers import start_teacher_pool

    cfg = load(*ON, "distillation.nnodes=1", "distillation.n_gpus_per_node=2")
    with pytest.raises(ValueError, match=r"distillation.nnodes=1 \(a separate teacher pool\) needs Ray"):
        start_teacher_pool(cfg, object, gpu=False, ray_backend=False)
    assert start_teacher_pool(load(*ON), object, gpu=False, ray_backend=False) is None  # colocated: no pool
