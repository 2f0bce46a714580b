"""A whole PPO step with a reward model: veRL's reward loop (Ray reward-loop workers + served RM)
gives the same training scores as the legacy RewardModelWorker (same seed, same generations)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.ppo_runs import run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hybridrl.models.tokenizer_builder import build_tokenizer

    path = str(tmp_path_factory.mktemp("rm"))
    tok = build_tokenizer(path)  # the built-in policy's tokenizer: re-templated RM input
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    return path


def test_reward_loop_run_scores_equal_the_legacy_runs(tmp_path, rm_dir):
    common = [
        "algorithm.adv_estimator=grpo",
        "trainer.total_training_steps=1",
        "reward_model.enable=True",
        f"reward_model.model.path={rm_dir}",
        "reward_model.model.fsdp_config.model_dtype=fp32",
        "reward_model.model.fsdp_config.mixed_precision.param_dtype=fp32",
    ]
    legacy = run(common, tmp_path / "legacy")
    loop = run(
        common
        + [
            "reward_model.use_reward_loop=True",
            "reward_model.num_workers=2",
            "reward_model.rollout.name=hf",
            "reward_model.rollout.dtype=float32",
            "reward_model.rollout.prompt_length=256",
            "reward_model.rollout.response_length=256",
        ],
        tmp_path / "loop",
    )
    for key in ("critic/score/mean", "critic/score/max", "critic/score/min"):
        assert loop[0][key] == pytest.approx(legacy[0][key], abs=1e-5), key
    assert legacy[0]["critic/score/max"] != legacy[0]["critic/score/min"]  # real, varying RM scores


def test_the_run_scores_through_the_served_model(tmp_path, rm_dir):
    """The loop is what scores: its engine's length limit (reward_model.rollout.*) stops the run."""
    with pytest.raises(Exception, match="reward_model.rollout.prompt_length"):
        run(
            [
                "algorithm.adv_estimator=grpo",
                "trainer.total_training_steps=1",
                "reward_model.enable=True",
                f"reward_model.model.path={rm_dir}",
                "reward_model.use_reward_loop=True",
                "reward_model.rollout.prompt_length=4",
                "reward_model.rollout.response_length=4",
            ],
            tmp_path,
        )
