"""The constant-reward warning (trainer.constant_reward_warn_steps): the pure helper and its counter."""

from __future__ import annotations

import pytest
import torch

from hybridrl.trainer.ppo.reward_guard import (
    ConstantRewardGuard,
    constant_reward_message,
    rewards_are_constant,
)
from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config


def test_constant_sequence_and_token_scores():
    assert rewards_are_constant(torch.zeros(8))
    assert rewards_are_constant(torch.full((4,), 1.0))
    assert not rewards_are_constant(torch.tensor([0.0, 0.0, 1.0, 0.0]))
    # (B, T) token scores: summed per row first; the reward sits on different tokens
    tok = torch.zeros(3, 5)
    tok[0, 4], tok[1, 2], tok[2, 0] = 1.0, 1.0, 1.0
    assert rewards_are_constant(tok)
    tok[2, 1] = 0.5
    assert not rewards_are_constant(tok)
    assert rewards_are_constant(torch.tensor([0.3, 0.3 + 1e-8]))  # float noise is still constant
    assert not rewards_are_constant(torch.tensor([0.3, 0.3 + 1e-3]))


def test_warns_once_after_n_consecutive_constant_steps(capsys):
    guard = ConstantRewardGuard(3, "grpo")
    zero, mixed = torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert guard.observe(zero) is None and guard.observe(zero) is None
    assert guard.observe(mixed) is None  # a varied batch resets the count
    assert guard.observe(zero) is None and guard.observe(zero) is None
    msg = guard.observe(zero)
    assert msg is not None and "3 steps in a row" in msg and "was 0" in msg
    assert "policy gradient is zero" in msg and "format" in msg and "max_response_length" in msg
    assert capsys.readouterr().out.count("[hybridrl] warning: every reward") == 1
    for _ in range(5):  # said once per run
        assert guard.observe(zero) is None
    assert capsys.readouterr().out == ""


def test_zero_turns_it_off_and_negative_is_refused():
    guard = ConstantRewardGuard(0, "grpo")
    assert all(guard.observe(torch.zeros(2)) is None for _ in range(10))
    with pytest.raises(ValueError, match="constant_reward_warn_steps"):
        ConstantRewardGuard(-1, "grpo")


def test_message_names_the_estimator_effect():
    assert "policy gradient is zero" in constant_reward_message(1.0, 5, "rloo")
    gae = constant_reward_message(1.0, 5, "gae")
    assert "critic" in gae and "policy gradient is zero" not in gae and "was 1" in gae


def test_config_refuses_a_negative_count(tmp_path):
    with pytest.raises(ConfigError, match="trainer.constant_reward_warn_steps=-2"):
        compose_config(["trainer.constant_reward_warn_steps=-2"], tmp_path)
    assert compose_config([], tmp_path).trainer.constant_reward_warn_steps == 5
