"""The HF rollout's in-place growing KV cache (cpu/kv_cache.py): the same keys and values
as transformers' concatenating layer through every cache method, and the same generations."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from hybridrl.cpu.kv_cache import GrowingLayer, growing_cache


def _states(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, n, 8, generator=g), torch.randn(b, 2, n, 8, generator=g)


def _same(a, b):
    assert a.get_seq_length() == b.get_seq_length()
    torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
    torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)


def test_growing_layer_equals_dynamic_layer_through_every_method():
    ref, grow = DynamicLayer(), GrowingLayer(reserve=3)
    steps = [("update", 4, 5), ("update", 4, 1), ("update", 4, 1), ("update", 4, 1), ("update", 4, 1)]
    steps += [("crop", -2), ("update", 4, 1), ("select", [2, 0, 0, 3]), ("update", 4, 2)]
    steps += [("repeat", 2), ("update", 8, 1), ("reset",), ("update", 3, 2), ("update", 3, 1)]
    buffers = set()
    for i, step in enumerate(steps):
        if step[0] == "update":
            k, v = _states(step[1], step[2], seed=i)
            for layer in (ref, grow):
                out_k, out_v = layer.update(k, v)
                assert out_k is layer.keys and out_v is layer.values
            buffers.add(grow._key_buf.data_ptr())
        elif step[0] == "crop":
            ref.crop(step[1]), grow.crop(step[1])
        elif step[0] == "select":
            idx = torch.tensor(step[1])
            ref.batch_select_indices(idx), grow.batch_select_indices(idx)
        elif step[0] == "repeat":
            ref.batch_repeat_interleave(step[1]), grow.batch_repeat_interleave(step[1])
        else:
            ref.reset(), grow.reset()
        if ref.is_initialized:
            _same(ref, grow)
    # new buffers only when full or after a copying method: 5 + 1 + 1 fit in 5 + 3, then the fourth
    # single step, the select, the repeat and the reset each needed one
    assert len(buffers) == 5
    with pytest.raises(ValueError, match="reserve must be >= 1"):
        GrowingLayer(reserve=0)


def test_growing_cache_keeps_sliding_layers_and_generates_the_same_tokens():
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    cache = growing_cache(model, reserve=4)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer, GrowingLayer]
    sliding = Qwen2Config(
        **{**cfg.to_dict(), "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    )
    kinds = [type(layer) for layer in DynamicCache(config=sliding).layers]
    if DynamicSlidingWindowLayer in kinds:  # the model's sliding layers stay sliding
        grown = growing_cache(AutoModelForCausalLM.from_config(sliding), reserve=4)
        assert [type(x) for x in grown.layers] == [GrowingLayer if k is DynamicLayer else k for k in kinds]
    ids = torch.randint(1, 64, (3, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(input_ids=ids, **kw)
        got = model.generate(input_ids=ids, past_key_values=growing_cache(model, reserve=3), **kw)
    assert torch.equal(got, want)
