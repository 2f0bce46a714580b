"""A key/value cache for the HF rollout that grows in place instead of by concatenation.

transformers' `DynamicLayer.update` appends each decode step's keys and values with `torch.cat`,
so every step copies the whole cache of every layer into a fresh allocation: for 16 rows of the
~100M bench model (12 layers, 4 KV heads of 64) growing from 53 to 309 positions that is ~70 MB
written per step on average, on top of the attention that reads it. `GrowingLayer` keeps keys and values (B, H, capacity, D)
in buffers with room for `reserve` more positions, writes each step's states into the next free
positions and hands out views of the filled part; only when the buffer is full, or the cache was
rebuilt by a method that copies (`batch_select_indices`, `batch_repeat_interleave`, `reset`), is a
new buffer made. The views are what `DynamicLayer` would hold (same values; `crop` and the other
methods work on them unchanged), so the attention computes the same numbers and the rollout the
same tokens (tests/rollout/test_hf_cache.py), without copying the whole cache at every step
(`bench/rollout_generation.py` measures generation).

`growing_cache(model, reserve)` builds a `DynamicCache` from the model's config with every plain
`DynamicLayer` replaced by a `GrowingLayer` (sliding-window and other layer kinds are kept), or
None where the config gives no layers to replace (then `generate` builds its own cache).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # transformers without cache layers (< 4.56): `generate` keeps its own cache
    DynamicCache = DynamicLayer = None

__all__ = ["GrowingLayer", "growing_cache"]


class GrowingLayer(DynamicLayer if DynamicLayer is not None else object):
    """`DynamicLayer` whose keys / values are views of buffers with room for `reserve` more
    positions (see the module docstring)."""

    def __init__(self, reserve: int = 256) -> None:
        super().__init__()
        if reserve < 1:
            raise ValueError(f"GrowingLayer: reserve must be >= 1, got {reserve}")
        self.reserve = reserve
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def _holds_prefix_of_buffer(self, new_len: int) -> bool:
        """Whether `self.keys` / `self.values` are views of the first positions of the buffers and
        the buffers have room up to `new_len` positions."""
        kb, vb, k, v = self._key_buf, self._value_buf, self.keys, self.values
        if kb is None or vb is None or k is None or v is None or k.dim() != 4 or v.dim() != 4:
            return False
        return (
            k.data_ptr() == kb.data_ptr()
            and v.data_ptr() == vb.data_ptr()
            and k.stride() == kb.stride()
            and v.stride() == vb.stride()
            and k.shape[:2] == kb.shape[:2]
            and v.shape[:2] == vb.shape[:2]
            and kb.shape[-2] >= new_len
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, H, n, D) key / value states after the cached positions; return the views of
        every position so far, (B, H, L + n, D) each."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if not self._holds_prefix_of_buffer(new):
            b, h, _, dk = key_states.shape
            kb = key_states.new_empty(b, h, new + self.reserve, dk)
            vb = value_states.new_empty(b, h, new + self.reserve, value_states.shape[-1])
            if old:
                kb[:, :, :old] = self.keys
                vb[:, :, :old] = self.values
            self._key_buf, self._value_buf = kb, vb
        self._key_buf[:, :, old:new] = key_states
        self._value_buf[:, :, old:new] = value_states
        self.keys, self.values = self._key_buf[:, :, :new], self._value_buf[:, :, :new]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        super().reset()


def growing_cache(model: Any, reserve: int) -> DynamicCache | None:
    """A `DynamicCache` for `model` whose plain layers grow in place (`GrowingLayer`), or None.

    Args:
        model: a Hugging Face causal LM (its `config` gives the layer kinds).
        reserve: positions each buffer makes room for beyond what it holds (the rollout passes the
            tokens it will generate, so one buffer holds the whole call).
    """
    if DynamicCache is None:
        return None
    try:
        cache = DynamicCache(config=model.config)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if not cache.layers or not any(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
