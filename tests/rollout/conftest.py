"""Fixtures for the rollout tests: a tiny Qwen2 checkpoint with a character-level tokenizer."""

from __future__ import annotations

import os

import pytest
import torch
from rollout_testlib import make_tiny_qwen2

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    make_tiny_qwen2(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def source_model(tiny_model_dir):
    """The 'trained' model: the checkpoint with every weight perturbed (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model
