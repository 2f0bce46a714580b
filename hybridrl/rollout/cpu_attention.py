"""Grouped-query attention on CPU for the HF rollout's model copy, without copying K/V heads.

With grouped-query attention (num_key_value_heads < num_attention_heads) and a padding mask,
transformers' `sdpa` attention copies every key and value head `num_key_value_groups` times
(`repeat_kv`) before `F.scaled_dot_product_attention`: it passes torch's `enable_gqa` only when
there is no mask, because CUDA's fused kernels take GQA only without one. Left-padded prompts
(every batch of prompts of different lengths) always carry a mask, so each decode step copied
the whole KV cache of every layer and ran SDPA on three times the heads.

On CPU torch's flash kernel takes `enable_gqa` with a mask. `gqa_sdpa_attention` is transformers'
SDPA attention with that one change: on CPU, with GQA, it calls SDPA with `enable_gqa=True`
and the mask as it is (same causal rule as transformers'); anything else (another device, no
GQA, paged caches, position biases, attention outputs) goes to transformers' own function.
`bench/rollout_generation.py --engines hf,hf-repeatkv --left-pad K` measures it against
transformers' path (which copies every K/V head per query head under a mask).

`install_cpu_gqa_attention(model)` switches a text model on CPU from `sdpa` to it (registered
with transformers' attention and mask interfaces under `ATTN_NAME`, the mask built as for
`sdpa`). Same numbers up to float rounding; tests/rollout/test_cpu_attention.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:  # transformers without its SDPA integration: install_cpu_gqa_attention leaves the model alone
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:
    sdpa_attention_forward = None

ATTN_NAME = "hybridrl_cpu_gqa_sdpa"

__all__ = ["ATTN_NAME", "gqa_sdpa_attention", "install_cpu_gqa_attention"]


def gqa_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """q (B, H, Lq, D), k/v (B, KV, Lk, D), mask (B, 1, Lq, Lk) bool or additive, or None ->
    (B, Lq, H, D): transformers' `sdpa_attention_forward` with `enable_gqa=True` under a mask."""
    groups = getattr(module, "num_key_value_groups", 1)
    special = any(kwargs.get(k) is not None for k in ("position_bias", "cache")) or kwargs.get(
        "output_attentions", False
    )
    if groups <= 1 or not query.is_cpu or special:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )  # fmt: skip
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_len > 1 and attention_mask is None and causal
    if causal and key.shape[2] > q_len:  # a prefill into an empty preallocated cache (as transformers)
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def install_cpu_gqa_attention(model: nn.Module) -> bool:
    """Switch `model` (a transformers text model on CPU using `sdpa`) to `gqa_sdpa_attention`.

    Returns whether it did: a vision-language model, another attention implementation, a model
    that cannot switch its attention, or a model without grouped-query heads keeps its own.
    """
    try:  # transformers without attention / mask registries: keep its own attention
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    if sdpa_attention_forward is None:
        return False

    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is not None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not heads or not kv_heads or kv_heads >= heads or config._attn_implementation != "sdpa":
        return False
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return False
    AttentionInterface.register(ATTN_NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    model.set_attn_implementation(ATTN_NAME)
    return config._attn_implementation == ATTN_NAME
