"""veRL's reward loop (reward_model.use_reward_loop=True): the same scores as the legacy path.

A tiny Qwen2ForSequenceClassification (num_labels=1) with the character tokenizer is saved to a
temporary folder; the legacy RewardModelWorker (FSDP engine, in this process through the local
backend) and the reward loop (Ray actors: 2 reward-loop workers and one served replica, HF forward
or vLLM's pooling runner) score the same batch.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from hybridrl.config.roles import RewardModelConfig, RewardModelModelConfig, RewardRolloutConfig
from hybridrl.protocol import DataProto
from hybridrl.reward.manager import load_reward_manager
from hybridrl.reward.reward_loop import RewardLoopManager, chunk_bounds, merge_extras
from hybridrl.reward.rm_server import RewardModelServer
from hybridrl.single_controller.local import LocalWorkerGroup
from hybridrl.single_controller.ray.base import RayClassWithInitArgs
from hybridrl.workers.engine_workers import RewardModelWorker

P, T, B = 6, 5, 6


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hybridrl.models.tokenizer_builder import build_tokenizer

    path = str(tmp_path_factory.mktemp("rm"))
    tok = build_tokenizer(path)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def policy_dir(rm_dir, tmp_path_factory):
    """The same tokenizer in another folder: the RM input is then re-templated (decoded, chat template)."""
    path = str(tmp_path_factory.mktemp("policy"))
    for f in os.listdir(rm_dir):
        if "token" in f or f.endswith(".jinja"):
            shutil.copy(os.path.join(rm_dir, f), path)
    return path


def make_batch(tok) -> DataProto:
    g = torch.Generator().manual_seed(1)
    low = len(tok.all_special_ids) + 1
    prompts = torch.randint(low, len(tok), (B, P), generator=g)
    responses = torch.randint(low, len(tok), (B, T), generator=g)
    p_mask, r_mask = torch.ones(B, P, dtype=torch.long), torch.ones(B, T, dtype=torch.long)
    for i in range(B):
        p_mask[i, : i % 3] = 0
        r_mask[i, 1 + i % T :] = 0
    prompts[p_mask == 0] = tok.pad_token_id
    responses[r_mask == 0] = tok.pad_token_id
    mask = torch.cat([p_mask, r_mask], -1)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": r_mask,
        },
        non_tensors={
            "data_source": np.array(["openai/gsm8k"] * B, dtype=object),
            "reward_model": np.array([{"ground_truth": str(i)} for i in range(B)], dtype=object),
        },
    )


def rm_config(rm_dir, name="hf", policy=None, **kw) -> RewardModelConfig:
    model = RewardModelModelConfig(path=rm_dir, input_tokenizer=policy)
    model.fsdp_config.model_dtype = "fp32"
    model.fsdp_config.mixed_precision.param_dtype = "fp32"
    return RewardModelConfig(
        enable=True,
        model=model,
        rollout=RewardRolloutConfig(name=name, dtype="float32", prompt_length=64, response_length=64, **kw),
        **{},
    )


def legacy_scores(config, data, policy_path) -> torch.Tensor:
    spec = RayClassWithInitArgs(RewardModelWorker, config=config, policy_tokenizer_path=policy_path)
    group = LocalWorkerGroup(spec, name_prefix="legacy_rm", num_threads=1)
    try:
        group.init_model()
        return group.compute_rm_score(data).batch["rm_scores"]
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
    )
    yield
    ray.shutdown()


def _tok(path):
    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.hf import load_tokenizer

    return load_tokenizer(ModelConfig(path=path))


@pytest.mark.parametrize(
    "engine,retemplate",
    [
        ("hf", False),
        pytest.param("hf", True, marks=pytest.mark.slow),  # re-templating: in-process test below
        ("vllm", False),
        pytest.param("vllm", True, marks=pytest.mark.slow),
    ],
    ids=["hf", "hf-retemplated", "vllm", "vllm-retemplated"],
)
def test_reward_loop_scores_equal_the_legacy_reward_model_worker(
    rm_dir, policy_dir, ray_cluster, engine, retemplate
):
    if engine == "vllm":
        pytest.importorskip("vllm")
    data = make_batch(_tok(rm_dir))
    policy = policy_dir if retemplate else rm_dir
    config = rm_config(rm_dir, engine)
    config.use_reward_loop, config.num_workers = True, 2
    want = legacy_scores(config, data, policy)
    loop = RewardLoopManager(config, policy, reward_fn=None, slots=1, use_ray=True, num_threads=1)
    try:
        scored, extra = loop.compute_rm_score(data)
    finally:
        loop.shutdown()
    got = scored.batch["rm_scores"]
    assert extra == {}
    assert got.shape == (B, T) and (got != 0).sum() == B  # one score per row, on its last response token
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().sum() > 0


def test_rule_based_reward_loop_equals_the_drivers_reward_manager(rm_dir, ray_cluster):
    tok = _tok(rm_dir)
    data = make_batch(tok)
    manager = load_reward_manager("naive", tok, 0)
    config = RewardModelConfig(use_reward_loop=True, num_workers=2)
    want = manager(data, return_dict=True)
    loop = RewardLoopManager(config, rm_dir, manager, slots=1, use_ray=True, num_threads=1)
    try:
        scored, extra = loop.compute_rm_score(data)
    finally:
        loop.shutdown()
    torch.testing.assert_close(scored.batch["rm_scores"], want["reward_tensor"])
    assert extra == want["reward_extra_info"]


def test_rm_server_refuses_inputs_longer_than_prompt_plus_response_length(rm_dir):
    server = RewardModelServer(
        rm_dir, RewardRolloutConfig(name="hf", dtype="float32", prompt_length=4, response_length=2)
    )
    assert len(server.score([[5, 6, 7, 8, 9, 10]])) == 1
    with pytest.raises(ValueError, match="reward_model.rollout.prompt_length"):
        server.score([[5] * 7])
    with pytest.raises(ValueError, match="sglang"):
        RewardModelServer(rm_dir, RewardRolloutConfig(name="sglang"))


def test_chunks_cover_the_batch_and_extras_realign():
    assert chunk_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert merge_extras([{"acc": [1, 0]}, {}], [2, 1]) == {"acc": [1, 0, None]}


def test_trainer_scores_a_batch_with_the_reward_loop_in_process(rm_dir, policy_dir):
    """RayPPOTrainer._compute_reward with the loop's workers in this process (trainer.backend=local),
    re-templated RM input: token_level_scores are the reward model's scores (once, not added to
    themselves)."""
    from functools import partial
    from types import SimpleNamespace

    from hybridrl.trainer.ppo.step_data import StepData
    from hybridrl.trainer.ppo.trainer import RayPPOTrainer

    tok = _tok(rm_dir)
    data = make_batch(tok)
    config = rm_config(rm_dir)
    config.use_reward_loop, config.num_workers = True, 2
    want = legacy_scores(config, data, policy_dir)
    loop = RewardLoopManager(config, policy_dir, None, slots=1, use_ray=False)
    trainer = SimpleNamespace(
        workers=SimpleNamespace(reward_loop=loop, reward_model=None),
        reward_fn=load_reward_manager("naive", tok, 0),
        data=StepData(None, by_reference=False),  # the local backend's step data: the batch on the driver
        _reward_on_workers=False,
    )
    trainer._on_driver = partial(RayPPOTrainer._on_driver, trainer)
    batch, extra = RayPPOTrainer._compute_reward(trainer, data, {})
    torch.testing.assert_close(batch.batch["token_level_scores"], want, atol=1e-5, rtol=1e-5)
    assert extra == {}
