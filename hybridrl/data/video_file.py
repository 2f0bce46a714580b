"""Video files in veRL's format (``{"video": "clip.mp4"}``, ``file://`` paths), read with PyAV.

veRL hands a video file to qwen_vl_utils' ``fetch_video``, which reads it with torchcodec, decord or
torchvision. hybridrl reads it with PyAV (the optional ``video`` extra: ``pip install hybridrl[video]``,
PyAV bundles its own FFmpeg and needs no torch build of its own), imported only when a file is read,
and samples the frames the way qwen_vl_utils does (``smart_nframes``, ``calculate_video_frame_range``):

- the entry's ``video_start`` / ``video_end`` (seconds) cut a frame range [start, end] (the whole
  clip by default);
- ``nframes`` (rounded to a multiple of 2), or else ``fps`` (default 2.0) frames a second of the
  range, clamped to [``min_frames`` (default 4), ``max_frames`` (default min(768, range))] and to the
  range, then floored to a multiple of 2 (Qwen2-VL groups 2 frames a temporal patch);
- the frames at ``linspace(start, end, n)`` rounded.

The frames then go through `hybridrl.data.video.video_inputs` like a listed clip's (sized by the
image processor's pixel limits, not qwen_vl_utils' video ones; its size keys are refused).
Shapes: F frames of the file, n sampled.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SAMPLING_KEYS", "frame_indices", "probe_video_file", "read_video_file"]

FPS, FPS_MIN_FRAMES, FPS_MAX_FRAMES, FRAME_FACTOR = 2.0, 4, 768, 2  # qwen_vl_utils' defaults
SAMPLING_KEYS = ("fps", "nframes", "min_frames", "max_frames", "video_start", "video_end")
INSTALL = "pip install hybridrl[video] (PyAV)"


def _frame_range(entry: Mapping[str, Any], total: int, video_fps: float, where: str) -> tuple[int, int]:
    """(start, end) frame indices (inclusive) of the entry's ``video_start`` / ``video_end`` seconds."""
    start_s, end_s = entry.get("video_start"), entry.get("video_end")
    duration = total / video_fps
    start = math.ceil(max(0.0, min(float(start_s), duration)) * video_fps) if start_s is not None else 0
    end = total - 1
    if end_s is not None:
        end = min(math.floor(max(0.0, min(float(end_s), duration)) * video_fps), total - 1)
    if (start_s is not None or end_s is not None) and start >= end:
        raise ValueError(
            f"{where}: video_start={start_s} / video_end={end_s} leave no frames of a {duration:.2f} s video "
            f"({total} frames at {video_fps:g} fps)"
        )
    return start, end


def _sample_count(entry: Mapping[str, Any], total: int, video_fps: float, where: str) -> int:
    """How many frames to sample from a range of `total` frames (qwen_vl_utils' `smart_nframes`)."""
    if "fps" in entry and "nframes" in entry:
        raise ValueError(f"{where}: give a video's 'fps' or its 'nframes', not both")
    if "nframes" in entry:
        n = round(float(entry["nframes"]) / FRAME_FACTOR) * FRAME_FACTOR
    else:
        fps = float(entry.get("fps", FPS))
        lo = math.ceil(float(entry.get("min_frames", FPS_MIN_FRAMES)) / FRAME_FACTOR) * FRAME_FACTOR
        hi = (
            math.floor(float(entry.get("max_frames", min(FPS_MAX_FRAMES, total))) / FRAME_FACTOR)
            * FRAME_FACTOR
        )
        n = math.floor(min(max(total / video_fps * fps, lo), hi, total) / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= n <= total:
        raise ValueError(
            f"{where}: {n} frames to sample from a video range of {total} frames; it must lie in "
            f"[{FRAME_FACTOR}, {total}] (check nframes / fps / min_frames / max_frames)"
        )
    return int(n)


def frame_indices(entry: Mapping[str, Any], total: int, video_fps: float, where: str = "video") -> list[int]:
    """The indices of the frames to sample from a file of `total` frames at `video_fps`.

    Raises:
        ValueError: both fps and nframes, an empty time range, a count outside [2, range].
    """
    if total <= 0 or video_fps <= 0:
        raise ValueError(f"{where}: the video has {total} frames at {video_fps} fps; nothing to sample")
    start, end = _frame_range(entry, total, video_fps, where)
    n = _sample_count(entry, end - start + 1, video_fps, where)
    return torch.linspace(start, end, n).round().long().tolist()


def _check_keys(entry: Mapping[str, Any], where: str) -> None:
    extra = sorted(set(entry) - {"video", "type", *SAMPLING_KEYS})
    if extra:
        raise ValueError(
            f"{where}: video key(s) {extra} are not supported (frames are sized by the image processor's "
            f"min_pixels / max_pixels); a video file takes {list(SAMPLING_KEYS)}"
        )


def _open(path: str, where: str):
    try:
        import av
    except ImportError as exc:
        raise ValueError(
            f"{where}: the video file {path!r} needs a video reader: {INSTALL}; or extract the frames "
            "(e.g. with ffmpeg) and list them as {'video': [frame, ...]}"
        ) from exc
    if not os.path.isfile(path):
        raise ValueError(f"{where}: the video file {path!r} does not exist")
    try:
        return av.open(path)
    except (av.error.FFmpegError, OSError) as exc:
        raise ValueError(f"{where}: cannot open the video file {path!r}: {exc}") from exc


def _count_frames(path: str, where: str) -> tuple[int, float]:
    """(frames, average fps) of the file's first video stream (frames counted by decoding when
    the container does not say)."""
    with _open(path, where) as container:
        if not container.streams.video:
            raise ValueError(f"{where}: the file {path!r} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        total = int(stream.frames or 0) or sum(1 for _ in container.decode(stream))
    if not rate:
        raise ValueError(f"{where}: the video file {path!r} has no frame rate")
    return total, float(rate)


def _entry(entry: Any, where: str) -> tuple[dict[str, Any], str]:
    entry = dict(entry) if isinstance(entry, Mapping) else {"video": entry}
    _check_keys(entry, where)
    path = str(entry["video"])
    return entry, path[len("file://") :] if path.startswith("file://") else path


def probe_video_file(entry: Any, where: str) -> list[int]:
    """The start-up check of a video file entry without decoding its pictures: PyAV is there, the
    file opens and has a video stream, the sampling keys give frames. Returns the frame indices.

    Raises:
        ValueError: as `read_video_file`.
    """
    entry, path = _entry(entry, where)
    total, fps = _count_frames(path, where)
    return frame_indices(entry, total, fps, where)


def read_video_file(entry: Any, where: str) -> list[Any]:
    """The sampled frames (RGB PIL images) of a video file entry.

    Args:
        entry: ``{"video": path, **sampling keys}`` or the bare path (``file://`` stripped).

    Raises:
        ValueError: no PyAV (naming `INSTALL`), a missing or unreadable file, bad sampling keys;
            naming `where`.
    """
    entry, path = _entry(entry, where)
    total, fps = _count_frames(path, where)
    wanted = frame_indices(entry, total, fps, where)
    frames: list[Any] = [None] * len(wanted)
    import av

    try:
        with _open(path, where) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:  # decoded in order; only the sampled frames become images
                    image = frame.to_image().convert("RGB")
                    for k in (k for k, j in enumerate(wanted) if j == i):
                        frames[k] = image
                if i >= wanted[-1]:
                    break
    except av.error.FFmpegError as exc:
        raise ValueError(f"{where}: cannot decode the video file {path!r}: {exc}") from exc
    if any(f is None for f in frames):
        raise ValueError(f"{where}: the video file {path!r} decoded fewer frames than its {total}")
    return frames
