"""Videos in veRL's format for Qwen2-VL: a ``videos`` column of frame lists, ``<video>`` placeholders.

A video is given as veRL's dict ``{"video": [frame, frame, ...]}`` (or the bare list of frames),
each frame anything :func:`hybridrl.data.image_decode.decode_image` reads (PIL image, PNG/JPEG
bytes, ``{"bytes": ...}`` / ``{"path": ...}``, a path, ``file://`` paths included), or as a video
*file* (``{"video": "clip.mp4", "fps": 2.0, ...}`` or the bare path), whose frames are sampled as
qwen_vl_utils samples them (`hybridrl.data.video_file`, PyAV: ``pip install hybridrl[video]``;
without it a file is refused with that command).

Qwen2-VL's video path without transformers' video processor (which imports torchvision): each
frame goes through the model's own image processor (the same resize, rescale and normalisation
as an image), and the frames are grouped ``temporal_patch_size`` at a time (an odd last group
repeats the last frame, as transformers' video processor does) into patches laid out as
transformers' ``Qwen2VLVideoProcessor.patchify`` lays them out: rows (t, h / m, w / m, m, m),
columns (C, temporal_patch_size, patch, patch). Returns ``pixel_values_videos`` (t * h * w, D)
and ``video_grid_thw`` (1, 3) per video; ``<|video_pad|>`` is expanded to t * h * w / m**2 tokens.
Frames are sized by the image processor's ``min_pixels`` / ``max_pixels`` (veRL's
qwen_vl_utils has video-specific limits); Qwen2.5-VL gets no ``second_per_grid_ts`` (its default,
1 s per temporal patch, is what veRL's frame lists at the default 2 fps give).

Shapes: F frames, C channels, p patch size, m merge size, D = C * temporal_patch_size * p * p.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "NO_VIDEO_FAMILIES",
    "check_video",
    "decode_video",
    "expand_video_tokens",
    "qwen3_vl_video_refusal",
    "refuse_qwen3_vl_videos",
    "video_inputs",
]

NO_VIDEO_FAMILIES = ("qwen3_vl",)  # videos refused: hybridrl does not write Qwen3-VL's frame timestamps


def qwen3_vl_video_refusal(where: str) -> str:
    """The message refusing videos with a Qwen3-VL model (`NO_VIDEO_FAMILIES`).

    Qwen3-VL's processor writes each video as one ``<t seconds><|vision_start|>frame tokens
    <|vision_end|>`` block per temporal patch and its ``get_rope_index`` splits ``video_grid_thw``
    per frame to match; hybridrl's video path writes one run of video tokens per video (the
    Qwen2-VL layout), which Qwen3-VL would position wrongly. Refused rather than computed wrong.
    """
    return (
        f"{where}: videos with a Qwen3-VL model are not supported yet (its processor puts frame "
        "timestamps between the frames, which hybridrl's video path does not write); drop the "
        "videos column (data.video_key) / the tool's videos, or use a Qwen2-VL / Qwen2.5-VL model"
    )


def refuse_qwen3_vl_videos(processor: Any, where: str) -> None:
    """Raise ValueError (`qwen3_vl_video_refusal`) when `processor` feeds a Qwen3-VL model."""
    kind = getattr(processor, "hybridrl_model_type", "")
    if kind in NO_VIDEO_FAMILIES or type(processor).__name__.startswith("Qwen3VL"):
        raise ValueError(qwen3_vl_video_refusal(where))


def decode_video(video: Any, where: str) -> list[Any]:
    """A video's frames as RGB PIL images (all of one size).

    Raises:
        ValueError: an empty or malformed entry, an unreadable frame or file (or a file without
            PyAV), frames of different sizes; naming `where`.
    """
    from hybridrl.data.image_decode import decode_image

    frames = video.get("video") if isinstance(video, Mapping) else video
    if isinstance(frames, np.ndarray):
        frames = list(frames)
    if isinstance(frames, str):  # a video file (hybridrl.data.video_file, PyAV)
        from hybridrl.data.video_file import read_video_file

        return read_video_file(video, where)
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ValueError(
            f"{where}: a video must be {{'video': [frame, ...]}}, {{'video': 'path/to/clip.mp4'}} (or a list "
            f"of frames, or a path), got {type(frames).__name__}"
            + ("; a video file is given by its path, not its bytes" if isinstance(frames, bytes) else "")
        )
    out = []
    for k, frame in enumerate(frames):
        if isinstance(frame, str) and frame.startswith("file://"):
            frame = frame[len("file://") :]
        out.append(decode_image(frame, f"{where} frame {k}"))
    sizes = {f.size for f in out}
    if len(sizes) > 1:
        raise ValueError(f"{where}: the frames of a video must have one size, got {sorted(sizes)}")
    return out


def check_video(video: Any, where: str) -> None:
    """The start-up check of a video entry: a file is opened and its sampling checked (its
    pictures are decoded when the row is read), a frame list is decoded.

    Raises:
        ValueError: as `decode_video`.
    """
    frames = video.get("video") if isinstance(video, Mapping) else video
    if isinstance(frames, str):
        from hybridrl.data.video_file import probe_video_file

        probe_video_file(video, where)
        return
    decode_video(video, where)


def video_inputs(image_processor: Any, frames: list[Any]) -> dict[str, torch.Tensor]:
    """pixel_values_videos (t * h * w, D) and video_grid_thw (1, 3) of one video's frames."""
    tps = int(getattr(image_processor, "temporal_patch_size", 2))
    p = int(image_processor.patch_size)
    frames = list(frames) + [frames[-1]] * (-len(frames) % tps)
    enc = image_processor(images=frames, return_tensors="pt")
    grid = torch.as_tensor(enc["image_grid_thw"])  # (F, 3): (1, h, w) per frame, all equal
    n = int(grid[0].prod())
    channels = enc["pixel_values"].shape[-1] // (tps * p * p)
    # each frame's rows (n, C, tps, p, p) hold the frame repeated over tps: keep slice 0
    per_frame = enc["pixel_values"].reshape(len(frames), n, channels, tps, p, p)[
        :, :, :, 0
    ]  # (F, n, C, p, p)
    t = len(frames) // tps
    grouped = per_frame.reshape(t, tps, n, channels, p, p).permute(0, 2, 3, 1, 4, 5)  # (t, n, C, tps, p, p)
    pixels = grouped.reshape(t * n, channels * tps * p * p)
    return {
        "pixel_values_videos": pixels,
        "video_grid_thw": torch.tensor([[t, int(grid[0, 1]), int(grid[0, 2])]]),
    }


def expand_video_tokens(ids: list[int], video_token_id: int, grids: torch.Tensor, merge: int) -> list[int]:
    """`ids` with the k-th video token repeated t*h*w / merge**2 times for video k of `grids` (V, 3).

    Raises:
        ValueError: the ids hold a different number of video tokens than there are videos.
    """
    n = [int(g.prod()) // merge**2 for g in torch.as_tensor(grids)]
    found = sum(1 for i in ids if i == video_token_id)
    if found != len(n):
        raise ValueError(f"the prompt renders {found} video token(s) for {len(n)} video(s)")
    out, k = [], 0
    for i in ids:
        if i == video_token_id:
            out += [i] * n[k]
            k += 1
        else:
            out.append(i)
    return out
