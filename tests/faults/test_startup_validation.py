"""Start-up validation: mistakes found before Ray starts, naming the key and the fix."""

from __future__ import annotations

import pytest

from hybridrl.utils.config_loader import ConfigError
from tests.e2e.ppo_runs import compose_config


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.actor.ppo_epochs=0", "actor_rollout_ref.actor.ppo_epochs"),
        ("trainer.total_epochs=0", "trainer.total_epochs"),
    ],
)
def test_counts_that_must_be_positive_are_refused(tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"{key}=-?\d+ must be an integer >= 1 .*e\.g\. {key}=1"):
        compose_config([override, "trainer.total_training_steps=null"], tmp_path)


def test_critic_epochs_are_checked_only_when_a_critic_runs(tmp_path):
    compose_config(["critic.ppo_epochs=0"], tmp_path)  # grpo: no critic, the key is unused
    with pytest.raises(ConfigError, match=r"critic.ppo_epochs=0 must be an integer >= 1"):
        compose_config(["critic.ppo_epochs=0", "algorithm.adv_estimator=gae"], tmp_path)


def test_a_model_path_naming_a_file_is_refused_before_ray(tmp_path):
    import ray

    from hybridrl.trainer.ppo.launch import run_ppo_config

    started_before = ray.is_initialized()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a folder")
    config = compose_config([f"actor_rollout_ref.model.path={weights}", "trainer.backend=ray"], tmp_path)
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref.model.path=.*model.safetensors' names a file; point it at"
    ):
        run_ppo_config(config)
    assert ray.is_initialized() == started_before  # refused before Ray was started
