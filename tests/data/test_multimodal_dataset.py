"""RLHFDataset with a processor: veRL's multimodal rows (images column, <image> placeholders)."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch

from hybridrl.data import visual_task
from hybridrl.data.multimodal import decode_image, multimodal_messages
from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset, collate_fn
from hybridrl.models.vlm import build_tiny_vlm, load_processor
from hybridrl.protocol import DataProto

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), "qwen2_vl")
    processor = load_processor(path)
    return path, processor


def _png(colour=(255, 0, 0), size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _write(tmp_path, rows, name="mm.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path, index=False)
    return str(path)


def test_geo3k_rows_give_pixel_inputs_and_expanded_image_tokens(vlm, tmp_path):
    path, processor = vlm
    files = visual_task.write_rl_parquet(str(tmp_path / "train.parquet"), 4, seed=0)
    ds = RLHFDataset(files, processor.tokenizer, RLDataConfig(max_prompt_length=48), processor=processor)
    item = ds[0]
    mm = item["multi_modal_inputs"]
    # a 56 x 56 image: 4 x 4 patches -> 16 rows of 3*2*14*14 pixel values, 4 image tokens
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert mm["pixel_values"].shape == (16, 1176)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((item["input_ids"] == image_id).sum()) == 4
    assert "images" not in item  # the raw images are consumed, not passed through
    assert item["input_ids"].shape == (48,) and item["attention_mask"].sum() == len(item["raw_prompt_ids"])
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(4)]))
    assert batch.non_tensor_batch["multi_modal_inputs"].shape == (4,)
    assert batch.non_tensor_batch["multi_modal_inputs"][3]["pixel_values"].shape == (16, 1176)


def test_every_image_form_decodes_the_same(tmp_path):
    png = _png((0, 255, 0))
    (tmp_path / "a.png").write_bytes(png)
    forms = [{"bytes": png}, png, str(tmp_path / "a.png"), {"path": str(tmp_path / "a.png")},
             Image.open(io.BytesIO(png))]  # fmt: skip
    arrays = [np.asarray(decode_image(f, "row 0")) for f in forms]
    for a in arrays[1:]:
        assert np.array_equal(a, arrays[0])
    assert arrays[0][0, 0].tolist() == [0, 255, 0]


@pytest.mark.parametrize(
    "images, match",
    [
        ([{"bytes": b"not a png"}], "row 1 image 0: cannot decode"),
        (["/nonexistent/x.png"], "row 1 image 0: image file not found"),
        ([12], "row 1 image 0: an image must be"),
        ([], r"row 1: the prompt has 1 <image> placeholder\(s\) but column 'images' holds 0"),
    ],
)
def test_bad_images_fail_at_construction_with_the_row(vlm, tmp_path, images, match):
    _, processor = vlm
    good = {"prompt": [{"role": "user", "content": "no image"}], "images": None}
    bad = {"prompt": [{"role": "user", "content": "<image>hi"}], "images": images}
    if images and isinstance(images[0], dict):  # bytes need parquet
        files = _write(tmp_path, [good, bad])
    else:
        files = str(tmp_path / "x.jsonl")
        pd.DataFrame([good, bad]).to_json(files, orient="records", lines=True)
    with pytest.raises(ValueError, match=match):
        RLHFDataset(files, processor.tokenizer, RLDataConfig(max_prompt_length=48), processor=processor)


def test_patch_size_mismatch_and_video_files_are_refused(vlm, tmp_path):
    _, processor = vlm
    files = visual_task.write_rl_parquet(str(tmp_path / "t.parquet"), 2, seed=0)
    with pytest.raises(ValueError, match="data.image_patch_size=16 .* patch size 14"):
        RLHFDataset(files, processor.tokenizer, RLDataConfig(image_patch_size=16), processor=processor)
    rows = [{"prompt": [{"role": "user", "content": "<video>what?"}], "videos": ["/x.mp4"]}]
    # a video file: refused at start-up with the row, for its missing file (PyAV installed) or the
    # missing reader (`pip install hybridrl[video]`); tests/data/test_video_file.py reads real ones
    missing = r"row 0 video 0: the video file '/x.mp4' (does not exist|needs a video reader: pip install hybridrl\[video\])"
    with pytest.raises(ValueError, match=missing):
        RLHFDataset(
            _write(tmp_path, rows, "v.parquet"), processor.tokenizer, RLDataConfig(), processor=processor
        )


def test_overlong_multimodal_prompt_is_never_truncated(vlm, tmp_path):
    _, processor = vlm
    files = visual_task.write_rl_parquet(str(tmp_path / "t.parquet"), 2, seed=0)
    cfg = RLDataConfig(max_prompt_length=8, truncation="left")
    ds = RLHFDataset(files, processor.tokenizer, cfg, processor=processor)
    with pytest.raises(ValueError, match="never truncated"):
        ds[0]


def test_text_rows_beside_image_rows(vlm, tmp_path):
    _, processor = vlm
    rows = [
        {"prompt": [{"role": "user", "content": "<image>hi"}], "images": [{"bytes": _png()}]},
        {"prompt": [{"role": "user", "content": "plain"}], "images": None},
    ]
    ds = RLHFDataset(
        _write(tmp_path, rows), processor.tokenizer, RLDataConfig(max_prompt_length=48), processor=processor
    )
    assert ds[1]["multi_modal_inputs"] == {}
    text = processor.tokenizer.decode(ds[1]["raw_prompt_ids"])
    assert text == "<s><|user|>plain<|assistant|>"


def test_placeholders_become_content_parts():
    msgs = multimodal_messages([{"role": "user", "content": "a<image>b<image>"}], [1, 2])
    assert msgs[0]["content"] == [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}, {"type": "image"},
    ]  # fmt: skip
    assert torch.is_tensor(torch.zeros(1))
