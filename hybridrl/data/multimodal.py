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

Videos (``data.video_key``, ``<video>`` placeholders, veRL's ``{"video": [frames]}`` entries) are
read by hybridrl.data.video and add ``pixel_values_videos`` / ``video_grid_thw``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridrl.data.image_decode import decode_image

__all__ = [
    "as_media_list",
    "count_placeholders",
    "decode_image",
    "multimodal_messages",
    "process_row",
    "validate_row_images",
]

_PLACEHOLDER = re.compile(r"(<image>|<video>)")


def as_media_list(value: Any) -> list[Any]:
    """A row's images / videos cell as a list (None: empty; one item given without a list: [it])."""
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
    from hybridrl.data.video import check_video

    images, videos = as_media_list(row.get(image_key)), as_media_list(row.get(video_key))
    n_img, n_vid = count_placeholders(messages)
    if n_vid != len(videos):
        raise ValueError(
            f"{where}: the prompt has {n_vid} <video> placeholder(s) but column {video_key!r} holds "
            f"{len(videos)} video(s); they must match (set data.video_key to the videos column)"
        )
    for k, video in enumerate(videos):
        check_video(video, f"{where} video {k}")
    if n_img != len(images):
        raise ValueError(
            f"{where}: the prompt has {n_img} <image> placeholder(s) but column {image_key!r} holds "
            f"{len(images)} image(s); they must match (set data.image_key to the images column)"
        )
    for k, image in enumerate(images):
        decode_image(image, f"{where} image {k}")
    return len(images)


def multimodal_messages(
    messages: Sequence[Mapping[str, Any]], images: Sequence[Any], videos: Sequence[Any] = ()
) -> list[dict[str, Any]]:
    """Messages with ``<image>`` / ``<video>`` split out of string contents into content parts.

    ``"<image>Find x"`` becomes ``[{"type": "image"}, {"type": "text", "text": "Find x"}]``; the
    images (videos) themselves go to the processor in the same order.
    """
    out, used = [], {"<image>": 0, "<video>": 0}
    for msg in messages:
        content = msg["content"]
        if not isinstance(content, str) or not _PLACEHOLDER.search(content):
            out.append(dict(msg))
            continue
        parts = []
        for seg in _PLACEHOLDER.split(content):
            if seg in used:
                parts.append({"type": seg[1:-1]})
                used[seg] += 1
            elif seg:
                parts.append({"type": "text", "text": seg})
        out.append({**msg, "content": parts})
    if used["<image>"] != len(images) or used["<video>"] != len(videos):
        raise ValueError(
            f"{used['<image>']} <image> / {used['<video>']} <video> placeholders for {len(images)} images / "
            f"{len(videos)} videos"
        )
    return out


def process_row(
    processor: Any,
    messages: Sequence[Mapping[str, Any]],
    images: Sequence[Any],
    where: str,
    chat_template_kwargs: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any],
    videos: Sequence[Any] = (),
) -> tuple[str, list[int], dict[str, torch.Tensor]]:
    """Render and process one multimodal prompt.

    Returns:
        (prompt text with the image / video markers, input_ids with every image (video) expanded
        to its tokens, multi_modal_inputs: pixel_values (N, D) and image_grid_thw (I, 3);
        pixel_values_videos (M, D) and video_grid_thw (V, 3) with videos).
    """
    from hybridrl.data.video import decode_video, expand_video_tokens, video_inputs

    if videos:
        from hybridrl.data.video import refuse_qwen3_vl_videos

        refuse_qwen3_vl_videos(processor, where)
    pil = [decode_image(im, f"{where} image {k}") for k, im in enumerate(images)]
    clips = [decode_video(v, f"{where} video {k}") for k, v in enumerate(videos)]
    msgs = multimodal_messages(messages, pil, clips)
    text = processor.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
    )
    enc = processor(text=[text], images=pil or None, return_tensors="pt", **mm_processor_kwargs)
    ids = enc["input_ids"][0].tolist()
    mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
    if clips:
        per_video = [video_inputs(processor.image_processor, c) for c in clips]
        mm["pixel_values_videos"] = torch.cat([v["pixel_values_videos"] for v in per_video])
        mm["video_grid_thw"] = torch.cat([v["video_grid_thw"] for v in per_video])
        token = getattr(processor, "video_token_id", None) or processor.tokenizer.convert_tokens_to_ids(
            "<|video_pad|>"
        )
        merge = int(getattr(processor.image_processor, "merge_size", 2))
        ids = expand_video_tokens(ids, int(token), mm["video_grid_thw"], merge)
    return text, ids, mm
