"""Grouped-query attention on CPU without copying K/V heads (cpu/gqa_attention.py):
equal to transformers' SDPA attention (masked and unmasked, prefill and decode), and the HF
rollout of a GQA model with left-padded prompts generates what plain `generate` with `sdpa` does."""

from __future__ import annotations

import pytest
import torch
from rollout_testlib import make_char_tokenizer, make_prompts, make_tiny_qwen2, plain_generate
from torch import nn
from transformers import Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridrl.cpu.gqa_attention import ATTN_NAME, gqa_sdpa_attention, install_cpu_gqa_attention
from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.weight_sync import sync_weights

TEXTS = ["12+34=", "7+1=", "abc", "9", "88*2=", "x"]
T = 10


class _Attn(nn.Module):  # what the attention functions read from the module
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _qkv(b, heads, kv, lq, lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, heads, lq, 16, generator=g),
        torch.randn(b, kv, lk, 16, generator=g),
        torch.randn(b, kv, lk, 16, generator=g),
    )


def _padding_mask(b, lq, lk, pads):
    """(b, 1, lq, lk) bool: causal (queries are the last lq of lk positions), left padding."""
    q_pos = torch.arange(lk - lq, lk)[:, None]
    causal = torch.arange(lk)[None, :] <= q_pos
    valid = torch.stack([torch.arange(lk) >= p for p in pads])  # (b, lk)
    return (causal[None] & valid[:, None, :])[:, None]


@pytest.mark.parametrize("lq", [1, 7])
@pytest.mark.parametrize("kind", ["bool", "additive", "none"])
def test_equals_transformers_sdpa(lq, kind):
    q, k, v = _qkv(3, 6, 2, lq, 9)
    mask = _padding_mask(3, lq, 9, pads=[0, 2, 0])
    if kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    elif kind == "none":
        mask = None
        if lq > 1:  # transformers drops a causal mask without padding: keys = queries
            k, v = k[:, :, :lq], v[:, :, :lq]
    module = _Attn(groups=3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = gqa_sdpa_attention(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (3, lq, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """The tiny test model with grouped-query attention: 4 heads of 32, 2 key/value heads."""
    path = str(tmp_path_factory.mktemp("gqa_qwen2"))
    make_tiny_qwen2(path, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return path


def test_rollout_uses_it_and_generates_what_sdpa_does(gqa_dir):
    tok = make_char_tokenizer()
    prompts = make_prompts(tok, TEXTS)
    assert (prompts.batch["attention_mask"] == 0).any()  # left padding: transformers' sdpa repeats K/V
    cfg = RolloutConfig(
        name="hf", dtype="float32", prompt_length=8, response_length=T, ignore_eos=True, do_sample=False
    )
    rollout = create_rollout(cfg, gqa_dir, tok, device="cpu")
    assert rollout.model.config._attn_implementation == ATTN_NAME
    plain = Qwen2ForCausalLM.from_pretrained(gqa_dir, attn_implementation="sdpa").eval()
    sync_weights(rollout, plain.state_dict().items())
    got = rollout.generate_sequences(prompts).batch["responses"]
    want = plain_generate(plain, prompts, T, do_sample=False)
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    assert torch.equal(got, want)
    # and the log-probs of the same sequences agree with sdpa's, padding included
    full = torch.cat([ids, want], dim=1)
    fmask = torch.cat([mask, torch.ones_like(want)], dim=1)
    pos = (fmask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = rollout.model(input_ids=full, attention_mask=fmask, position_ids=pos).logits
        b = plain(input_ids=full, attention_mask=fmask, position_ids=pos).logits
    valid = fmask.bool()
    torch.testing.assert_close(a[valid], b[valid], atol=1e-4, rtol=1e-4)


def test_models_it_leaves_alone(tiny_model_dir, gqa_dir):
    no_gqa = Qwen2ForCausalLM.from_pretrained(tiny_model_dir)  # 2 heads, 2 KV heads
    assert not install_cpu_gqa_attention(no_gqa) and no_gqa.config._attn_implementation == "sdpa"
    eager = Qwen2ForCausalLM.from_pretrained(gqa_dir, attn_implementation="eager")
    assert not install_cpu_gqa_attention(eager) and eager.config._attn_implementation == "eager"
    ok = Qwen2ForCausalLM.from_pretrained(gqa_dir)
    assert install_cpu_gqa_attention(ok) and ok.config._attn_implementation == ATTN_NAME
