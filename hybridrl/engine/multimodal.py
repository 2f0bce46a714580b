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
on them, whatever the packing. An agent loop's tool turns may carry images too: their tokens sit
in the response, listed per row in ``multi_modal_inputs["response_vision_positions"]`` (K,)
(indices into the response), and are fed as image tokens; any other vision token of a response
is a sampled text token.

Ulysses SP (:func:`text_tower_on_slice`): every rank of a group runs the vision tower and the
embedding on the whole packed row (the image features are scattered into the image-token
positions there), and the text tower on its slice of the embedded row and of the (4, 1, nnz)
positions, padded to a multiple of the SP size.

Qwen3-VL: the same ``get_rope_index`` signature (interleaved mrope is inside its rotary embedding);
its deepstack inputs (image-token mask, per-layer vision features) are built by its own forward
from the ids fed, so the padded, packed and grouped paths need nothing more; Ulysses SP cuts them
to the rank's slice (`_deepstack_slice`). Videos are refused with it (`NO_VIDEO_FAMILIES`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridrl.data.video import NO_VIDEO_FAMILIES, qwen3_vl_video_refusal

MM_KEY = "multi_modal_inputs"

__all__ = [
    "FED_KEY",
    "MM_KEY",
    "attach_multimodal",
    "grouped_model_inputs",
    "has_multimodal",
    "model_inputs",
    "prompt_media_keys",
    "text_tower_on_slice",
    "vlm_core",
]


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
        f"{type(base).__name__} has no get_rope_index: multimodal inputs need a Qwen-VL-family model "
        "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL)"
    )


def _vision_ids(module: nn.Module) -> list[int]:
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    return [
        i
        for i in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
        if i is not None
    ]


FED_KEY = "response_vision_positions"


def _model_type(module: nn.Module) -> str:
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    return getattr(cfg, "model_type", "")


def fed_vision_tokens(rows: list[dict[str, Any]], responses: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the response's vision tokens a tool turn fed (each row's
    ``multi_modal_inputs[FED_KEY]``, indices into its response); all False for a plain rollout."""
    fed = torch.zeros(responses.shape, dtype=torch.bool, device=responses.device)
    for i, row in enumerate(rows):
        if row.get(FED_KEY) is not None and len(row[FED_KEY]):
            fed[i, torch.as_tensor(row[FED_KEY], dtype=torch.long, device=responses.device)] = True
    return fed


def _token_types(
    module: nn.Module, input_ids: torch.Tensor, prompt_len: int, fed: torch.Tensor
) -> torch.Tensor:
    """mm_token_type_ids (B, S): 1 at image (2 at video) tokens of the prompt and of the fed
    response tokens `fed` (B, T), 0 elsewhere."""
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == cfg.image_token_id] = 1
    if getattr(cfg, "video_token_id", None) is not None:
        types[input_ids == cfg.video_token_id] = 2
    types[:, prompt_len:] *= fed.to(types.dtype)  # a sampled vision token in a policy turn is text
    return types


def rope_positions(
    module: nn.Module, input_ids, attention_mask, grids: dict[str, torch.Tensor], prompt_len: int, fed
) -> torch.Tensor:
    """(3, B, S) mrope positions of a padded batch (padding positions read 0).

    Args:
        grids: image_grid_thw (I, 3) / video_grid_thw (V, 3) of the batch's images / videos, in order.
        fed: (B, T) the response's vision tokens a tool turn fed (`fed_vision_tokens`).
    """
    if grids.get("video_grid_thw") is not None and _model_type(module) in NO_VIDEO_FAMILIES:
        raise ValueError(qwen3_vl_video_refusal("the training forward"))
    positions, _ = vlm_core(module).get_rope_index(
        input_ids,
        mm_token_type_ids=_token_types(module, input_ids, prompt_len, fed),
        image_grid_thw=grids.get("image_grid_thw"),
        video_grid_thw=grids.get("video_grid_thw"),
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


_VISION_INPUTS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def _stacked_inputs(rows: list[dict[str, Any]], device, dtype) -> dict[str, torch.Tensor]:
    """The rows' pixel inputs concatenated in row order: pixel_values (sum N_i, D) and image_grid_thw
    (sum I_i, 3); pixel_values_videos and video_grid_thw likewise for videos."""
    out: dict[str, torch.Tensor] = {}
    for pix_key, grid_key in _VISION_INPUTS:
        have = [r for r in rows if r.get(pix_key) is not None]
        if have:
            out[pix_key] = torch.cat([torch.as_tensor(r[pix_key]) for r in have]).to(device, dtype)
            out[grid_key] = torch.cat([torch.as_tensor(r[grid_key]) for r in have]).to(device)
    return out


def _sampled_vision(module: nn.Module, input_ids: torch.Tensor, prompt_len: int, fed: torch.Tensor):
    """(B, S) bool: the vision tokens a response sampled (fed as text), not the tool-fed ones `fed` (B, T)."""
    sampled = torch.isin(input_ids, torch.tensor(_vision_ids(module), device=input_ids.device))
    sampled[:, :prompt_len] = False
    sampled[:, prompt_len:] &= ~fed
    return sampled


def model_inputs(
    module: nn.Module, batch: Any, packed: Any = None
) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """Ids and extra forward kwargs for a multimodal micro-batch.

    Args:
        batch: TensorDict with input_ids (B, S), attention_mask (B, S), responses (B, T) and
            `multi_modal_inputs` (with FED_KEY for an agent loop's tool images).
        packed: the packing of the batch (remove-padding) or None (padded forward).

    Returns:
        (input_ids to feed: (B, S) or packed (1, nnz), a copy; kwargs: pixel_values (sum N_i, D),
        image_grid_thw (sum I_i, 3) when the rows hold images (pixel_values_videos /
        video_grid_thw for videos), position_ids (3, B, S) padded or (4, 1, nnz) packed; the
        context manager to run the forward in, see `response_vision_tokens_as_text`).
    """
    rows = _rows(batch)
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt_len = input_ids.shape[1] - batch["responses"].shape[1]
    device = input_ids.device
    out: dict[str, Any] = _stacked_inputs(rows, device, next(module.parameters()).dtype)
    fed = fed_vision_tokens(rows, batch["responses"])
    positions = rope_positions(module, input_ids, mask, out, prompt_len, fed)  # (3, B, S)
    sampled = _sampled_vision(module, input_ids, prompt_len, fed)
    if packed is None:
        out["position_ids"] = positions
        ids = input_ids.clone()
    else:
        flat = positions.reshape(3, -1)[:, packed.indices]  # (3, nnz)
        out["position_ids"] = torch.cat([packed.position_ids.view(1, -1), flat]).unsqueeze(1)
        ids = packed.input_ids.clone()
        sampled = sampled.reshape(-1)[packed.indices].view(1, -1)
    return ids, out, response_vision_tokens_as_text(module, ids, sampled)


# ----------------------------------------------------------------------------------------------
# the shared-prompt forward (`engine.prefix_group`): each group's prompt and its pixels once
# ----------------------------------------------------------------------------------------------
def _token_ids(module: nn.Module) -> dict[str, int | None]:
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    return {"pixel_values": cfg.image_token_id, "pixel_values_videos": getattr(cfg, "video_token_id", None)}


def _merge_size(module: nn.Module) -> int:
    cfg = (module.get_base_model() if hasattr(module, "get_base_model") else module).config
    return int(getattr(cfg.vision_config, "spatial_merge_size", 2))


def _split_media(row: dict[str, Any], prompt_tokens: dict[str, int], merge: int) -> tuple[dict, dict]:
    """A row's pixel inputs cut into (its prompt's, its response's): the first images (videos)
    whose tokens (t*h*w / merge**2 each) fill the prompt's `prompt_tokens[pixel key]`, then the
    rest (an agent loop's tool images, listed after the prompt's).

    Raises:
        ValueError: the prompt's vision tokens do not end at an image boundary.
    """
    prompt: dict[str, torch.Tensor] = {}
    response: dict[str, torch.Tensor] = {}
    for pix_key, grid_key in _VISION_INPUTS:
        if row.get(pix_key) is None:
            continue
        pix, grids = torch.as_tensor(row[pix_key]), torch.as_tensor(row[grid_key]).reshape(-1, 3)
        ends = (grids.prod(-1) // merge**2).cumsum(0)
        want = prompt_tokens[pix_key]
        k = int((ends <= want).sum())
        if want != (int(ends[k - 1]) if k else 0):
            raise ValueError(
                f"the prompt holds {want} {grid_key[:5]} tokens, which end inside an image of {grid_key} "
                f"{grids.tolist()}; the row's pixel inputs do not match its ids"
            )
        cut = int(grids[:k].prod(-1).sum())  # patch rows of the prompt's images
        for part, sl, gs in ((prompt, slice(0, cut), grids[:k]), (response, slice(cut, None), grids[k:])):
            if len(gs):
                part[pix_key], part[grid_key] = pix[sl], gs
    return prompt, response


def _prompt_splits(module: nn.Module, batch: Any) -> list[tuple[dict, dict]]:
    """Each row's (prompt, response) pixel inputs (`_split_media`)."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    p = input_ids.shape[1] - batch["responses"].shape[1]
    ids, merge = _token_ids(module), _merge_size(module)
    out = []
    for b, row in enumerate(_rows(batch)):
        valid = input_ids[b, :p][mask[b, :p]]
        counts = {k: int((valid == i).sum()) if i is not None else 0 for k, i in ids.items()}
        out.append(_split_media(row, counts, merge))
    return out


def prompt_media_keys(module: nn.Module, batch: Any) -> list[bytes]:
    """Per row, a digest of its prompt's pixel inputs: two rows share a prompt in the grouped
    forward only when these are equal too (equal image tokens may hold different pictures)."""
    import hashlib

    keys = []
    for prompt, _ in _prompt_splits(module, batch):
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(prompt):
            value = prompt[name].detach().cpu().contiguous()
            h.update(name.encode() + str(tuple(value.shape)).encode() + str(value.dtype).encode())
            h.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        keys.append(h.digest())
    return keys


def grouped_model_inputs(module: nn.Module, batch: Any, layout: Any) -> tuple[torch.Tensor, dict, Any]:
    """Ids and forward kwargs of the shared-prompt packed row of a multimodal micro-batch.

    The pixel inputs follow the row's segments: each group's prompt images (videos) once (from
    its first row), then each response's tool images, in the order their tokens appear, so the
    model scatters each image's features into its own tokens. The 3-D rotary positions are each
    row's own (`rope_positions` on the padded batch) gathered at the packed tokens
    (`layout.source`), with the per-segment text positions in front: (4, 1, N).

    Args:
        batch: as `model_inputs`.
        layout: the micro-batch's `prefix_group.PrefixGroupLayout` (built with `prompt_media_keys`).

    Returns:
        as `model_inputs`: ids (1, N) (a copy), kwargs, the feed context.
    """
    rows = _rows(batch)
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt_len = input_ids.shape[1] - batch["responses"].shape[1]
    dtype = next(module.parameters()).dtype
    fed = fed_vision_tokens(rows, batch["responses"])
    grids = {k: v for k, v in _stacked_inputs(rows, input_ids.device, dtype).items() if k.endswith("_thw")}
    positions = rope_positions(module, input_ids, mask, grids, prompt_len, fed)  # (3, B, S)
    splits = _prompt_splits(module, batch)
    parts = [splits[r][0 if of < 0 else 1] for r, of in zip(layout.rows, layout.prompt_of)]
    out: dict[str, Any] = _stacked_inputs(parts, input_ids.device, dtype)
    text = layout.position_ids.to(positions.dtype)  # (1, N): each segment's own text positions
    out["position_ids"] = torch.cat([text, positions.reshape(3, -1)[:, layout.source]])[:, None]  # (4, 1, N)
    ids = layout.input_ids.clone()
    sampled = _sampled_vision(module, input_ids, prompt_len, fed).reshape(-1)[layout.source].view(1, -1)
    return ids, out, response_vision_tokens_as_text(module, ids, sampled)


def _deepstack_slice(kwargs: dict[str, Any], pad: int, lo: int, length: int) -> dict[str, Any]:
    """Qwen3-VL's deepstack text-tower inputs cut to this rank's slice [lo, lo + length) of the
    padded packed row: ``visual_pos_masks`` (1, nnz) -> (1, length) and each layer's features at the
    vision tokens (n_vision, H) -> the rows of the vision tokens inside the slice ({} for a model
    without deepstack, or a micro-batch without images)."""
    mask, embeds = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
    if mask is None or embeds is None:
        return {}
    mask = nn.functional.pad(mask, (0, pad), value=False)
    before = int(mask[:, :lo].sum())
    local = mask[:, lo : lo + length]
    n = int(local.sum())
    return {"visual_pos_masks": local, "deepstack_visual_embeds": [e[before : before + n] for e in embeds]}


@contextlib.contextmanager
def text_tower_on_slice(module: nn.Module, sp: Any):
    """Ulysses SP: run the VLM's text tower on this rank's slice of the packed row.

    The VLM forward embeds the whole packed row (1, nnz) and scatters the vision tower's features
    into its image tokens (every rank of the group holds the same rows, so the counts match); a
    pre-hook on the text tower then pads the embedded row (1, nnz, H) and its (4, 1, nnz) positions
    to a multiple of the SP size (padding: zero embeddings at positions 0, 1, ..., a sequence of
    its own) and keeps this rank's contiguous slice (1, L, H) / (4, 1, L), L = padded / sp. The
    gradient reaches the vision tower through the image positions of each rank's slice. Qwen3-VL's
    deepstack inputs (image-token mask and per-layer features) are cut to the same slice.

    Args:
        sp: the rank's `ulysses.SPGroup`.
    """
    from hybridrl.engine.ulysses import padded_length

    text_tower = vlm_core(module).language_model

    def hook(_mod, args, kwargs):
        emb, pos = kwargs["inputs_embeds"], kwargs["position_ids"]
        nnz = emb.shape[1]
        pad = padded_length(nnz, sp) - nnz
        length, lo = (nnz + pad) // sp.size, sp.rank * ((nnz + pad) // sp.size)
        emb = nn.functional.pad(emb, (0, 0, 0, pad))
        fill = torch.arange(pad, device=pos.device, dtype=pos.dtype).expand(*pos.shape[:-1], pad)
        pos = torch.cat([pos, fill], dim=-1)
        return args, {
            **kwargs,
            "inputs_embeds": emb[:, lo : lo + length],
            "position_ids": pos[..., lo : lo + length],
            **_deepstack_slice(kwargs, pad, lo, length),
        }

    handle = text_tower.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
