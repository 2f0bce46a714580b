"""veRL algorithm / engine keys: each one changes what runs, or fails clearly."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

from hybridrl import algos
from hybridrl.trainer.ppo.config import ConfigError
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv
from hybridrl.utils.config_loader import WARNED


def _check(overrides):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    return check_startup(cfg, explicit_keys={override_key(o) for o in overrides})


@pytest.fixture(autouse=True)
def _fresh_warnings():
    WARNED.clear()


# ------------------------------------------------------------------ GRPO with rollout.n=1
def test_grpo_with_one_response_per_prompt_loads_and_says_the_advantage_is_the_raw_score(capsys):
    c = _check(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"])
    assert c.actor_rollout_ref.rollout.n == 1
    assert "advantage is the raw score" in capsys.readouterr().err


def test_grpo_groups_of_one_give_the_raw_score_like_verl():
    # veRL: a group of one has mean 0 and std 1, so A = s / (1 + 1e-6)
    rewards = torch.tensor([[0.0, 2.0], [0.0, -1.0], [0.5, 0.0]])
    mask = torch.ones_like(rewards)
    adv, _ = algos.get_adv_estimator_fn("grpo")(rewards, mask, index=["a", "b", "c"], epsilon=1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.0, -1.0, 0.5]) / (1 + 1e-6))


def test_grpo_passk_still_needs_two_responses():
    with pytest.raises(ConfigError, match="grpo_passk.*rollout.n must be >= 2"):
        _check(["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"])


# ------------------------------------------------------------------ model.torch_dtype
def test_model_torch_dtype_sets_the_load_dtype_of_actor_and_ref():
    c = _check(["actor_rollout_ref.model.torch_dtype=bfloat16"])
    arr = c.actor_rollout_ref
    assert arr.actor.fsdp_config.model_dtype == "bfloat16"
    assert arr.ref.fsdp_config.model_dtype == "bfloat16"
    assert c.critic.model.fsdp_config.model_dtype == "fp32"  # the critic loads its own model
    default = _check([])
    assert default.actor_rollout_ref.actor.fsdp_config.model_dtype == "fp32"


def test_model_torch_dtype_builds_the_model_in_that_dtype():
    from hybridrl.models.hf import build_hf_model

    c = _check(["actor_rollout_ref.model.torch_dtype=bfloat16"])
    model = build_hf_model(c.actor_rollout_ref.model, dtype=c.actor_rollout_ref.actor.fsdp_config.model_dtype)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_critic_model_torch_dtype():
    c = _check(["algorithm.adv_estimator=gae", "critic.model.torch_dtype=float16"])
    assert c.critic.model.fsdp_config.model_dtype == "float16"


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["actor_rollout_ref.model.torch_dtype=auto"], "torch_dtype='auto' is not a dtype"),
        (
            [
                "actor_rollout_ref.model.torch_dtype=bfloat16",
                "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
            ],
            "torch_dtype=bfloat16 and actor_rollout_ref.actor.fsdp_config.model_dtype=fp32 disagree",
        ),
    ],
)
def test_model_torch_dtype_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _check(overrides)


def test_model_torch_dtype_agreeing_with_an_explicit_model_dtype_is_fine():
    c = _check(
        [
            "actor_rollout_ref.model.torch_dtype=bfloat16",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        ]
    )
    assert c.actor_rollout_ref.actor.fsdp_config.model_dtype == "bfloat16"


# ------------------------------------------------------------------ trainer.use_legacy_worker_impl
def test_use_legacy_worker_impl_auto_is_our_single_implementation():
    assert _check(["trainer.use_legacy_worker_impl=auto"]).trainer.use_legacy_worker_impl == "auto"


@pytest.mark.parametrize(
    "value, pattern", [("enable", "single implementation"), ("disable", "single"), ("x", "one of")]
)
def test_use_legacy_worker_impl_other_values_fail(value, pattern):
    with pytest.raises(ConfigError, match=f"trainer.use_legacy_worker_impl.*{pattern}"):
        _check([f"trainer.use_legacy_worker_impl={value}"])


# ------------------------------------------------------------------ PF-PPO
def test_pf_ppo_with_gae_loads():
    c = _check(
        [
            "algorithm.adv_estimator=gae",
            "algorithm.use_pf_ppo=True",
            "algorithm.pf_ppo.reweight_method=max_min",
        ]
    )
    assert c.algorithm.use_pf_ppo and c.algorithm.pf_ppo.reweight_method == "max_min"


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["algorithm.use_pf_ppo=True"], "only after GAE"),
        (
            [
                "algorithm.adv_estimator=gae",
                "algorithm.use_pf_ppo=True",
                "algorithm.pf_ppo.reweight_method=x",
            ],
            "reweight_method='x' is not one of",
        ),
    ],
)
def test_pf_ppo_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _check(overrides)


# ------------------------------------------------------------------ run_qwen3-8b_npu.sh keys
def test_forward_prefetch_and_ref_entropy_chunking_reach_the_engine_settings():
    c = _check(
        [
            "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
            "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True",
            "++actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
        ]
    )
    arr = c.actor_rollout_ref
    assert arr.actor.fsdp_config.forward_prefetch and arr.ref.fsdp_config.forward_prefetch
    assert not c.critic.model.fsdp_config.forward_prefetch
    # the reference's PPOActor (fsdp_workers) is built from this config: chunked entropy
    assert arr.ref.policy_config().entropy_from_logits_with_chunking
    assert not _check([]).actor_rollout_ref.ref.policy_config().entropy_from_logits_with_chunking


# ------------------------------------------------------------------ optimal token baseline
def test_otb_loads_with_sum_pi_squared_and_keeps_the_old_log_prob_pass():
    from hybridrl.trainer.ppo.trainer import old_log_prob_is_redundant

    otb = [
        "algorithm.adv_estimator=optimal_token_baseline",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
    ]
    small = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]  # on-policy
    c = _check(otb + small)
    assert c.actor_rollout_ref.actor.calculate_sum_pi_squared
    assert not old_log_prob_is_redundant(c)  # the old-log-prob pass computes sum_pi_squared
    assert old_log_prob_is_redundant(_check(small))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["algorithm.adv_estimator=optimal_token_baseline"], "calculate_sum_pi_squared=True"),
        (
            [
                "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                "actor_rollout_ref.actor.strategy=megatron",
            ],
            "FSDP actor only",
        ),
    ],
)
def test_otb_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _check(overrides)


# ------------------------------------------------------------------ rollout correction (examples/rollout_correction)
RC = "algorithm.rollout_correction."
CALC = "actor_rollout_ref.rollout.calculate_log_probs=True"


def test_bypass_reinforce_becomes_the_actors_bypass_loss():
    c = _check(
        [CALC, f"{RC}bypass_mode=True", f"{RC}loss_type=reinforce", f"{RC}rollout_is=sequence"]
        + [f"{RC}rollout_is_batch_normalize=True", "algorithm.adv_estimator=rloo"]
    )
    pl = c.actor_rollout_ref.actor.policy_loss
    assert pl.loss_mode == "bypass_mode"
    assert (pl.rollout_correction.loss_type, pl.rollout_correction.rollout_is) == ("reinforce", "sequence")
    assert pl.rollout_correction.rollout_is_batch_normalize
    assert _check([]).actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"


def test_multi_option_rejection_loads():
    c = _check([CALC, f"{RC}rollout_rs='token_k1,seq_max_k2'", f"{RC}rollout_rs_threshold='0.6_1.6,2.5'"])
    assert c.algorithm.rollout_correction.rollout_rs == "token_k1,seq_max_k2"


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ([CALC, f"{RC}loss_type=reinforce"], "loss of bypass mode"),
        (
            [CALC, f"{RC}bypass_mode=True", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
            "leave it at vanilla",
        ),
        (
            [CALC, f"{RC}rollout_rs='token_k1,seq_max_k2'", f"{RC}rollout_rs_threshold='0.6_1.6,2.5,3'"],
            "3 specs",
        ),
        ([CALC, f"{RC}rollout_rs=token_k7", f"{RC}rollout_rs_threshold=2"], "is not one of null"),
    ],
)
def test_rollout_correction_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _check(overrides)
