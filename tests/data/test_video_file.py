"""Video files (``{"video": "clip.mp4"}``) read with PyAV, frames sampled as qwen_vl_utils samples them.

A real clip is written with PyAV in the test (a coloured square moving right, one colour per frame)
with a lossless codec (libx264rgb at qp 0 in mp4; FFV1 in Matroska, whose stream does not state
its frame count), read back through `hybridrl.data.video_file` and through a geo3k-like parquet
with a videos column and the dataset, and compared with the frames written.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from hybridrl.data.video_file import frame_indices, read_video_file

H, W, N, FPS = 84, 56, 12, 6  # 12 frames at 6 fps: a 2-second clip


def frames_written(n=N):
    """(n, H, W, 3) uint8: a 16 x 20 square moving 3 pixels a frame, its colour changing."""
    out = np.full((n, H, W, 3), 255, np.uint8)
    for i in range(n):
        out[i, 20:40, 2 + 3 * i : 18 + 3 * i] = (40 + 17 * i, 200 - 13 * i, (90 * i) % 256)
    return out


def write_clip(path, codec="libx264rgb", fmt="rgb24", options=None):
    av = pytest.importorskip("av")
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = W, H, fmt
        stream.options = options if options is not None else {"qp": "0"}
        for a in frames_written():
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24").reformat(format=fmt)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


def test_frame_indices_follow_qwen_vl_utils():
    """Worked by hand from qwen_vl_utils' smart_nframes / calculate_video_frame_range."""
    assert frame_indices({}, 12, 6.0) == [0, 4, 7, 11]  # 2 s at fps 2 -> 4 frames, linspace(0, 11, 4)
    assert frame_indices({"fps": 6}, 12, 6.0) == list(range(12))
    assert frame_indices({"nframes": 6}, 12, 6.0) == [0, 2, 4, 7, 9, 11]
    assert frame_indices({"fps": 0.5}, 12, 6.0) == [0, 4, 7, 11]  # 1 frame, raised to min_frames 4
    assert frame_indices({"fps": 6, "max_frames": 7}, 12, 6.0) == [0, 2, 4, 7, 9, 11]  # 7 -> 6
    assert frame_indices({"video_start": 0.5, "video_end": 1.5}, 12, 6.0) == [3, 5, 7, 9]
    assert len(frame_indices({}, 600, 30.0)) == 40  # 20 s at 2 fps
    with pytest.raises(ValueError, match="'fps' or its 'nframes', not both"):
        frame_indices({"fps": 2, "nframes": 4}, 12, 6.0)
    with pytest.raises(ValueError, match=r"40 frames to sample from a video range of 12"):
        frame_indices({"nframes": 40}, 12, 6.0)
    with pytest.raises(ValueError, match="leave no frames"):
        frame_indices({"video_start": 1.9, "video_end": 1.9}, 12, 6.0)


@pytest.mark.parametrize(
    "name, codec, fmt, options", [("clip.mp4", "libx264rgb", "rgb24", None), ("clip.mkv", "ffv1", "bgr0", {})]
)
def test_read_back_equals_the_frames_written(tmp_path, name, codec, fmt, options):
    path = write_clip(tmp_path / name, codec, fmt, options)
    want = frames_written()
    for entry, idx in [
        ({"video": path}, [0, 4, 7, 11]),  # fps 2.0 (veRL's default)
        (f"file://{path}", [0, 4, 7, 11]),  # a bare file:// path
        ({"video": f"file://{path}", "fps": 6.0}, list(range(12))),
        ({"video": path, "nframes": 2, "video_start": 1.0}, [6, 11]),
    ]:
        got = np.stack([np.asarray(f) for f in read_video_file(entry, "row 0 video 0")])
        assert got.shape == (len(idx), H, W, 3)
        np.testing.assert_array_equal(got, want[idx])  # lossless codec: exact


def test_bad_files_fail_with_the_row(tmp_path, monkeypatch):
    pytest.importorskip("av")
    with pytest.raises(ValueError, match=r"row 3 video 0: the video file '/no/clip.mp4' does not exist"):
        read_video_file({"video": "/no/clip.mp4"}, "row 3 video 0")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video" * 50)
    with pytest.raises(ValueError, match=r"row 3 video 0: cannot open the video file"):
        read_video_file(str(junk), "row 3 video 0")
    path = write_clip(tmp_path / "clip.mp4")
    with pytest.raises(ValueError, match=r"video key\(s\) \['max_pixels'\] are not supported"):
        read_video_file({"video": path, "max_pixels": 1000}, "row 3 video 0")
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed: `import av` raises ImportError
    with pytest.raises(
        ValueError, match=r"row 3 video 0: .*needs a video reader: pip install hybridrl\[video\]"
    ):
        read_video_file({"video": path}, "row 3 video 0")


def test_a_parquet_with_a_video_file_column_goes_through_the_dataset(tmp_path):
    """geo3k-like rows whose videos are files: the dataset's pixel inputs are the sampled written
    frames through the image processor (`video_inputs`), and the prompt holds their tokens."""
    from PIL import Image

    from hybridrl.data.builtin_task import write_parquet
    from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset
    from hybridrl.data.video import video_inputs
    from hybridrl.engine.multimodal import MM_KEY
    from hybridrl.models.vlm import build_tiny_vlm, load_processor

    path = write_clip(tmp_path / "clip.mp4")
    processor = load_processor(build_tiny_vlm(tmp_path / "model", "qwen2_vl", seed=0))
    rows = [
        {"prompt": [{"role": "user", "content": "<video>Where does the square go?"}],
         "videos": [{"video": f"file://{path}", "fps": fps}], "data_source": "clip",
         "reward_model": {"style": "rule", "ground_truth": "right"}, "extra_info": {"index": i}}
        for i, fps in enumerate([2.0, 6.0])
    ]  # fmt: skip
    ds = RLHFDataset(
        write_parquet(rows, str(tmp_path / "v.parquet")), processor.tokenizer, RLDataConfig(max_prompt_length=512),
        processor=processor,
    )  # fmt: skip
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for i, idx in enumerate([[0, 4, 7, 11], list(range(12))]):
        item = ds[i]
        mm = item[MM_KEY]
        want = video_inputs(processor.image_processor, [Image.fromarray(a) for a in frames_written()[idx]])
        torch.testing.assert_close(mm["pixel_values_videos"], want["pixel_values_videos"], atol=0, rtol=0)
        assert mm["video_grid_thw"].tolist() == [[len(idx) // 2, 6, 4]]  # 84 x 56 pixels: 6 x 4 patches
        ids = item["input_ids"][item["attention_mask"].bool()]
        assert int((ids == video_id).sum()) == len(idx) // 2 * 6 * 4 // 4
