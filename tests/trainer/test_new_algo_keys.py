"""Config keys of veRL's newest algorithms (gdpo, tir_optimal_token_baseline, dppo_*, sapo, dro):
read, validated at start-up with one-line errors, and handed to the loss by the actor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module

from hybridrl.config.roles import ActorConfig, PolicyLossConfig
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.batch_steps import reward_components
from hybridrl.trainer.ppo.config import ConfigError
from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv
from hybridrl.workers.actor import PPOActor

ACTOR = "actor_rollout_ref.actor"
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", f"{ACTOR}.ppo_mini_batch_size=4"]


def _check(*overrides):
    overrides = [*SMALL, *overrides]
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    return check_startup(cfg, explicit_keys={override_key(o) for o in overrides})


def test_gdpo_keys_are_read_with_verl_plus_spelling():
    c = _check(
        "algorithm.adv_estimator=gdpo",
        "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
        "algorithm.gdpo_reward_weights=[1.0,0.5]",
    )
    assert list(c.algorithm.gdpo_reward_keys) == ["accuracy_reward", "format_reward"]
    assert list(c.algorithm.gdpo_reward_weights) == [1.0, 0.5]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.adv_estimator=gdpo"], "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys"),
        (
            [
                "algorithm.adv_estimator=gdpo",
                "algorithm.gdpo_reward_keys=[a,b]",
                "algorithm.gdpo_reward_weights=[1]",
            ],
            "gdpo_reward_weights has 1 entries for 2",
        ),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,a]"], "names a component twice"),
        (
            ["algorithm.adv_estimator=tir_optimal_token_baseline"],
            "tir_optimal_token_baseline needs the per-token sum of pi\\^2: set "
            f"{ACTOR}.calculate_sum_pi_squared=True",
        ),
        ([f"{ACTOR}.policy_loss.loss_mode=dro"], f"loss_mode=dro needs {ACTOR}.policy_loss.dro_beta > 0"),
        ([f"{ACTOR}.policy_loss.dro_beta=-1"], "dro_beta=-1.0 must be > 0"),
        (
            [
                f"{ACTOR}.policy_loss.loss_mode=sapo",
                f"{ACTOR}.tau_pos=1.0",
                f"+{ACTOR}.policy_loss.tau_pos=2.0",
            ],
            f"{ACTOR}.tau_pos=1.0 and {ACTOR}.policy_loss.tau_pos=2.0 are the same setting",
        ),
        ([f"{ACTOR}.tau_neg=0"], f"{ACTOR}.tau_neg=0.0 must be > 0"),
        ([f"{ACTOR}.policy_loss.loss_mode=dppo_tv", f"{ACTOR}.clip_ratio_high=-0.1"], "divergence bound"),
    ],
)
def test_bad_values_fail_at_start_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _check(*overrides)


def test_new_names_pass_the_config_stage():
    _check("algorithm.adv_estimator=tir_optimal_token_baseline", f"{ACTOR}.calculate_sum_pi_squared=True")
    for mode in ("dppo_tv", "dppo_kl", "sapo"):
        assert (
            _check(f"{ACTOR}.policy_loss.loss_mode={mode}").actor_rollout_ref.actor.policy_loss.loss_mode
            == mode
        )
    c = _check(f"{ACTOR}.policy_loss.loss_mode=dro", f"{ACTOR}.policy_loss.dro_beta=0.1")
    assert c.actor_rollout_ref.actor.policy_loss.dro_beta == 0.1


def test_sapo_temperatures_from_either_spelling_reach_the_loss():
    assert ActorConfig().sapo_taus() == (1.0, 1.05)  # veRL's defaults
    config = ActorConfig(
        tau_neg=2.0, policy_loss=PolicyLossConfig(loss_mode="sapo", tau_pos=1.5, dro_beta=0.2)
    )
    assert config.sapo_taus() == (1.5, 2.0)
    actor = PPOActor(config, torch.nn.Linear(1, 1))
    hparams = actor._loss_hparams()
    assert (hparams["tau_pos"], hparams["tau_neg"], hparams["dro_beta"]) == (1.5, 2.0, 0.2)


def test_reward_components_come_from_the_reward_extras():
    batch = DataProto.from_dict({"x": torch.zeros(3, 1)})
    batch.non_tensor_batch["acc"] = np.array([1, 0, 1], dtype=object)
    batch.non_tensor_batch["fmt"] = np.array([0.5, 0.5, 0.0], dtype=object)
    metrics: dict = {}
    comps = reward_components(batch, ["acc", "fmt"], metrics)
    torch.testing.assert_close(comps, torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.5, 0.0]]))
    assert metrics["gdpo/acc/mean"] == pytest.approx(2 / 3) and metrics["gdpo/fmt/max"] == 0.5
    assert reward_components(batch, None, metrics) is None
    with pytest.raises(KeyError, match="names 'format_reward'.*returned no such per-row value"):
        reward_components(batch, ["format_reward"], metrics)
