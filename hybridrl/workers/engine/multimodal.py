"""Vision-language model inputs for the training forward: pixel values and 3-D rotary positions.

A multimodal batch carries, per row, the processor's model inputs in
``non_tensor_batch["multi_modal_inputs"]`` (``{"pixel_values": (N_i, D), "image_grid_thw": (I_i, 3)}``;
an empty dict for a text row). :func:`attach_multimodal` puts them into the TensorDict the engine
splits into micro-batches (a ``NonTensorStack``, split, indexed and concatenated with the rows).

Qwen2-VL's rotary embedding is 3-D ("mrope"): every token has a (temporal, height, width) position;
text tokens have three equal positions, image tokens their grid coordinates, and the text after an
image continues from ``max(previous positions) + 1``. The model computes them with
``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, attention_mask)`` -> (3, B, S). In
the padded forward these (3, B, S) positions are passed as ``position_ids``; in the packed
(remove-padding) forward the valid tokens' positions are gathered to (3, 1, nnz) and the per-sequence
text positions (1, nnz) are put in front, giving the (4, 1, nnz) layout transformers reads for packed
sequences (row 0 finds the sequence boundaries, rows 1-3 rotate).

Image tokens are prompt tokens: they sit before the response, so the response slice never trains
on them, whatever the packing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

MM_KEY = "multi_modal_inputs"

__all__ = ["MM_KEY", "attach_multimodal", "has_multimodal", "model_inputs", "vlm_core"]


def attach_multimodal(batch: Any, data: Any) -> Any:
    """`batch` (a TensorDict of `data`'s rows) with `data`'s multi_modal_inputs attached, if any."""
    rows = getattr(data, "non_tensor_batch", {}).get(MM_KEY)
    if rows is None:
        return batch
    from tensordict import NonTensorStack

    batch[MM_KEY] = NonTensorStack(*[dict(r or {}) for r in rows])
    return batch


def has_multimodal(batch: Any) -> bool:
    return MM_KEY in batch.keys()


def _rows(batch: Any) -> list[dict[str, Any]]:
    value = batch[MM_KEY]
    rows = value.tolist() if hasattr(value, "tolist") else list(value)
    if isinstance(rows, np.ndarray):
        rows = rows.tolist()
    return [r or {} for r in rows]


def vlm_core(module: nn.Module) -> nn.Module:
    """The submodule holding `get_rope_index` (Qwen2-VL's `model`), through PEFT/FSDP wrappers."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    for candidate in (base, getattr(base, "model", None)):
        if candidate is not None and hasattr(candidate, "get_rope_index"):
            return candidate
    raise ValueError(
        f"{type(base).__name__} has no get_rope_index: multimodal inputs need a Qwen2-VL-family model "
        "(Qwen2-VL, Qwen2.5-VL)"
    )


def _vision_ids(module: nn.Module) -> list[int]:
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    return [
        i
        for i in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
        if i is not None
    ]


def _token_types(module: nn.Module, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """mm_token_type_ids (B, S): 1 at image (2 at video) tokens of the prompt, 0 elsewhere."""
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == cfg.image_token_id] = 1
    if getattr(cfg, "video_token_id", None) is not None:
        types[input_ids == cfg.video_token_id] = 2
    types[:, prompt_len:] = 0  # a sampled vision token in a response is a text token
    return types


def rope_positions(
    module: nn.Module, input_ids, attention_mask, image_grid_thw, prompt_len: int
) -> torch.Tensor:
    """(3, B, S) mrope positions of a padded batch (padding positions read 0)."""
    positions, _ = vlm_core(module).get_rope_index(
        input_ids,
        mm_token_type_ids=_token_types(module, input_ids, prompt_len),
        image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
    )
    return positions


@contextlib.contextmanager
def response_vision_tokens_as_text(module: nn.Module, input_ids: torch.Tensor, where: torch.Tensor):
    """Feed vision tokens that a response sampled as plain tokens, as the rollout did.

    The model takes every ``<|image_pad|>`` in ``input_ids`` for an image slot; a response that
    sampled one (a random or young policy does) would break that count. Those ids are swapped for
    the pad id in the ids the model sees, and a hook on the input embedding puts the sampled
    token's own embedding back at those places.

    Args:
        input_ids: the ids as fed to the model, (B, S) or packed (1, nnz); edited in place.
        where: bool mask of the same shape: the response positions holding vision tokens.
    """
    if not bool(where.any()):
        yield
        return
    original = input_ids[where].clone()
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    pad = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    input_ids[where] = pad
    embed = module.get_input_embeddings()

    def hook(mod, _inputs, out):
        out = out.clone()
        out[where] = nn.functional.embedding(original, mod.weight).to(out.dtype)
        return out

    handle = embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def model_inputs(
    module: nn.Module, batch: Any, packed: Any = None
) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """Ids and extra forward kwargs for a multimodal micro-batch.

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), responses (B, T) and
            `multi_modal_inputs`.
        packed: the packing of the batch (remove-padding) or None (padded forward).

    Returns:
        (input_ids to feed: (B, S) or packed (1, nnz), a copy; kwargs: pixel_values (sum N_i, D),
        image_grid_thw (sum I_i, 3) when the rows hold images, position_ids (3, B, S) padded or
        (4, 1, nnz) packed; the context manager to run the forward in, see
        `response_vision_tokens_as_text`).
    """
    rows = _rows(batch)
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt_len = input_ids.shape[1] - batch["responses"].shape[1]
    device = input_ids.device
    pixels = [r["pixel_values"] for r in rows if r.get("pixel_values") is not None]
    grids = [r["image_grid_thw"] for r in rows if r.get("pixel_values") is not None]
    out: dict[str, Any] = {}
    grid = None
    if pixels:
        dtype = next(module.parameters()).dtype
        out["pixel_values"] = torch.cat([torch.as_tensor(p) for p in pixels]).to(device, dtype)
        grid = torch.cat([torch.as_tensor(g) for g in grids]).to(device)
        out["image_grid_thw"] = grid
    positions = rope_positions(module, input_ids, mask, grid, prompt_len)  # (3, B, S)
    sampled = torch.isin(input_ids, torch.tensor(_vision_ids(module), device=device))
    sampled[:, :prompt_len] = False
    if packed is None:
        out["position_ids"] = positions
        ids = input_ids.clone()
    else:
        flat = positions.reshape(3, -1)[:, packed.indices]  # (3, nnz)
        out["position_ids"] = torch.cat([packed.position_ids.view(1, -1), flat]).unsqueeze(1)
        ids = packed.input_ids.clone()
        sampled = sampled.reshape(-1)[packed.indices].view(1, -1)
    return ids, out, response_vision_tokens_as_text(module, ids, sampled)
