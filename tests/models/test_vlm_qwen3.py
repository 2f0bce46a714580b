"""Qwen3-VL specifics: patch 16 (`data.image_patch_size`) and the refusal of videos.

Qwen3-VL's processor lays a video out as one ``<t seconds><|vision_start|>...<|vision_end|>`` block per
temporal patch (its ``get_rope_index`` splits ``video_grid_thw`` per frame to match); hybridrl's
video path writes the Qwen2-VL layout, so videos with a Qwen3-VL model are refused wherever they
enter: the dataset (at start-up, with the row), a tool's videos in an agent loop, the training
forward. The forward, rollout, grouped and Ulysses paths with images are tested in the files
parametrised over `VLM_FAMILIES` (tests/workers/...).
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.data import visual_task
from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset
from hybridrl.models.vlm import build_tiny_vlm, load_processor

pytest.importorskip("PIL")
REFUSED = "videos with a Qwen3-VL model are not supported yet"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")
    return path, load_processor(path)


def test_patch_16_needs_data_image_patch_size_16(qwen3, tmp_path):
    """veRL's default `data.image_patch_size` (14) is refused with the fix; 16 (as veRL's Qwen3-VL
    scripts set it) or null is taken."""
    _, processor = qwen3
    files = visual_task.write_rl_parquet(str(tmp_path / "t.parquet"), 2, seed=0)
    with pytest.raises(
        ValueError, match="data.image_patch_size=14 .* patch size 16; set data.image_patch_size=16"
    ):
        RLHFDataset(files, processor.tokenizer, RLDataConfig(), processor=processor)
    for patch in (16, None):
        ds = RLHFDataset(
            files, processor.tokenizer, RLDataConfig(image_patch_size=patch), processor=processor
        )
        assert ds[0]["multi_modal_inputs"]["pixel_values"].shape[-1] == 3 * 2 * 16 * 16


def test_a_videos_column_is_refused_at_start_up_with_the_row(qwen3, tmp_path):
    _, processor = qwen3
    files = visual_task.write_video_parquet(str(tmp_path / "v.parquet"), 2, seed=0)
    with pytest.raises(ValueError, match=rf"file .*v.parquet' row 0 \('videos'\): {REFUSED}"):
        RLHFDataset(files, processor.tokenizer, RLDataConfig(image_patch_size=16), processor=processor)


def test_tool_videos_and_the_training_forward_refuse_videos(qwen3):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from hybridrl.agent.vision import VisionTurns
    from hybridrl.engine.multimodal import rope_positions

    path, processor = qwen3
    frames = [Image.new("RGB", (64, 64), (200, 0, 0))] * 2
    with pytest.raises(ValueError, match=f"tool response: {REFUSED}"):
        VisionTurns(processor).video_inputs([{"video": frames}], "tool response")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    ids = torch.full((1, 8), processor.tokenizer.pad_token_id)
    grids = {"video_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=f"the training forward: {REFUSED}"):
        rope_positions(model, ids, torch.ones_like(ids), grids, 4, torch.zeros(1, 4, dtype=torch.bool))
