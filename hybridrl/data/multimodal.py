"""Multimodal prompts in veRL's format: an ``images`` column next to ``prompt``, ``<image>`` placeholders.

A row (as written by veRL's ``examples/data_preprocess/geo3k.py``) looks like::

    {"prompt": [{"role": "user", "content": "<image>Find x. ..."}],
     "images": [{"bytes": b"\\x89PNG..."}], ...}

Each ``<image>`` in the message contents takes the next entry of the row's ``data.image_key`` column,
in order; the counts must match. An image may be a ``{"bytes": ...}`` / ``{"path": ...}`` dict (what
``datasets`` writes for an Image feature), raw ``bytes``, a path string, or a ``PIL.Image``.

The processor (``AutoProcessor`` of the model, e.g. Qwen2-VL's) turns the rendered prompt and the
images into ``input_ids`` with each image expanded to its image tokens, and the per-row model
inputs ``multi_modal_inputs = {"pixel_values": (N, C*t*p*p), "image_grid_thw": (I, 3)}`` (N patch
rows, I images of the row), which ride in the batch's non-tensor part.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "count_placeholders",
    "decode_image",
    "multimodal_messages",
    "process_row",
    "validate_row_images",
]

_PLACEHOLDER = re.compile(r"(<image>|<video>)")


def decode_image(image: Any, where: str):
    """One image as an RGB ``PIL.Image``.

    Args:
        image: {"bytes": b} / {"path": p} dict, bytes, a path (str / PathLike), or a PIL image.
        where: "file ... row n image k", named in errors.

    Raises:
        ValueError: unreadable bytes, a missing file, or an unsupported type.
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, Mapping):
        if image.get("bytes") is not None:
            image = image["bytes"]
        elif image.get("path"):
            image = image["path"]
        elif image.get("image") is not None:
            return decode_image(image["image"], where)
        else:
            raise ValueError(
                f"{where}: an image dict needs a 'bytes' or 'path' entry, got keys {sorted(image)}"
            )
    if isinstance(image, (bytes, bytearray, memoryview)):
        source: Any = io.BytesIO(bytes(image))
    elif isinstance(image, (str, os.PathLike)):
        source = os.path.expanduser(os.fspath(image))
        if not os.path.isfile(source):
            raise ValueError(f"{where}: image file not found: {source!r}")
    else:
        raise ValueError(
            f"{where}: an image must be a {{'bytes'|'path'}} dict, bytes, a path or a PIL.Image, "
            f"got {type(image).__name__}"
        )
    try:
        with Image.open(source) as img:
            return img.convert("RGB")
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError ...
        raise ValueError(f"{where}: cannot decode the image ({type(exc).__name__}: {exc})") from exc


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        return list(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]  # one image given without a list


def count_placeholders(messages: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(number of ``<image>``, number of ``<video>``) placeholders in string message contents."""
    text = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    return text.count("<image>"), text.count("<video>")


def validate_row_images(
    messages: Sequence[Mapping[str, Any]], row: Mapping[str, Any], image_key: str, video_key: str, where: str
) -> int:
    """Check a row's images at start-up: counts match the placeholders, every image decodes.

    Returns:
        The number of images of the row.

    Raises:
        ValueError: naming the row (`where`) and the problem.
    """
    images, videos = _as_list(row.get(image_key)), _as_list(row.get(video_key))
    n_img, n_vid = count_placeholders(messages)
    if n_vid or videos:
        raise NotImplementedError(
            f"{where}: video inputs ({video_key!r} / <video>) are not supported yet; remove them or "
            "use image frames"
        )
    if n_img != len(images):
        raise ValueError(
            f"{where}: the prompt has {n_img} <image> placeholder(s) but column {image_key!r} holds "
            f"{len(images)} image(s); they must match (set data.image_key to the images column)"
        )
    for k, image in enumerate(images):
        decode_image(image, f"{where} image {k}")
    return len(images)


def multimodal_messages(messages: Sequence[Mapping[str, Any]], images: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages with ``<image>`` split out of string contents into content parts.

    ``"<image>Find x"`` becomes ``[{"type": "image"}, {"type": "text", "text": "Find x"}]``; the
    images themselves go to the processor in the same order.
    """
    out, used = [], 0
    for msg in messages:
        content = msg["content"]
        if not isinstance(content, str) or "<image>" not in content:
            out.append(dict(msg))
            continue
        parts = []
        for seg in _PLACEHOLDER.split(content):
            if seg == "<image>":
                parts.append({"type": "image"})
                used += 1
            elif seg:
                parts.append({"type": "text", "text": seg})
        out.append({**msg, "content": parts})
    if used != len(images):
        raise ValueError(f"{used} <image> placeholders for {len(images)} images")
    return out


def process_row(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    images: Sequence[Any],
    where: str,
    chat_template_kwargs: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any],
) -> tuple[str, list[int], dict[str, torch.Tensor]]:
    """Render and process one multimodal prompt.

    Returns:
        (prompt text with the image markers, input_ids with every image expanded to its image
        tokens, multi_modal_inputs: pixel_values (N, D) and image_grid_thw (I, 3)).
    """
    pil = [decode_image(im, f"{where} image {k}") for k, im in enumerate(images)]
    msgs = multimodal_messages(messages, pil)
    text = processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
    )
    enc = processor(text=[text], images=pil or None, return_tensors="pt", **mm_processor_kwargs)
    ids = enc["input_ids"][0].tolist()
    mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
    return text, ids, mm
