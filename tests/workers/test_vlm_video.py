"""Videos with a tiny Qwen2-VL: veRL's `videos` column (frames drawn in code) through the dataset, the
HF rollout and the training forward (pixel_values_videos, video_grid_thw, 3-D rotary positions)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.data import visual_task
from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset, collate_fn
from hybridrl.data.video import video_inputs
from hybridrl.engine.forward import forward_log_probs
from hybridrl.engine.multimodal import MM_KEY, attach_multimodal
from hybridrl.protocol import DataProto

pytest.importorskip("PIL")
P, T = 64, 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from hybridrl.models.vlm import build_tiny_vlm, load_processor
    from hybridrl.rollout import RolloutConfig
    from hybridrl.rollout.hf import HFRollout

    tmp = tmp_path_factory.mktemp("vlm_video")
    path = build_tiny_vlm(tmp / "model", "qwen2_vl", seed=2)
    processor = load_processor(path)
    files = visual_task.write_video_parquet(str(tmp / "video.parquet"), 4, seed=1, frames=3)
    ds = RLHFDataset(files, processor.tokenizer, RLDataConfig(max_prompt_length=P), processor=processor)
    cfg = RolloutConfig(name="hf", dtype="float32", prompt_length=P, response_length=T, calculate_log_probs=True,
                        temperature=1.0, ignore_eos=True)  # fmt: skip
    return HFRollout(cfg, path, processor.tokenizer, device="cpu"), processor, ds, tmp


def _frames(colours):
    from PIL import Image

    return [Image.new("RGB", (56, 84), c) for c in colours]


def test_video_patches_follow_qwen2_vl_layout(setup):
    """The hand-written layout: normalised frames (F, C, H, W) -> rows (t, h/m, w/m, m, m), columns
    (C, temporal, p, p), the odd last frame repeated; a static 2-frame clip == the image's patches."""
    _, processor, _, _ = setup
    ip = processor.image_processor
    frames = _frames([(200, 0, 0), (0, 200, 0), (0, 0, 200)])
    out = video_inputs(ip, frames)
    assert out["video_grid_thw"].tolist() == [[2, 6, 4]]  # 84 x 56 pixels: 6 x 4 patches, 3 frames -> t = 2
    x = torch.stack(
        [torch.tensor(list(f.getdata()), dtype=torch.float32).view(84, 56, 3) for f in frames + frames[-1:]]
    )
    x = (x / 255.0 - torch.tensor(ip.image_mean)) / torch.tensor(ip.image_std)  # (F, H, W, C)
    x = x.permute(0, 3, 1, 2)  # (F, C, H, W)
    p, m = 14, 2
    ref = x.view(2, 2, 3, 6 // m, m, p, 4 // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(2 * 24, -1)
    torch.testing.assert_close(out["pixel_values_videos"], ref, atol=1e-5, rtol=0)
    still = video_inputs(ip, frames[:1] * 2)
    image = ip(images=frames[:1], return_tensors="pt")
    torch.testing.assert_close(still["pixel_values_videos"], image["pixel_values"], atol=0, rtol=0)


def test_dataset_rows_carry_video_inputs_and_tokens(setup):
    _, processor, ds, _ = setup
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i in range(2):
        item = ds[i]
        mm = item[MM_KEY]
        grid = mm["video_grid_thw"]
        assert grid.tolist() == [[2, 4, 4]]  # 3 frames of 56 x 56
        assert mm["pixel_values_videos"].shape[0] == 32
        ids = item["input_ids"][item["attention_mask"].bool()]
        assert int((ids == video_id).sum()) == 8  # 2 * 4 * 4 / 2**2
        assert int((ids == image_id).sum()) == (4 if i % 2 == 0 else 0)
        assert ("pixel_values" in mm) == (i % 2 == 0)


def test_bad_videos_fail_with_the_row(setup, tmp_path):
    from hybridrl.data.builtin_task import write_parquet

    _, processor, _, _ = setup
    rows = visual_task.make_video_rows(2, seed=0)
    for row in rows:  # (parquet cannot mix a file name and frame lists in one column)
        row["videos"] = [{"video": "clip.mp4"}]
    path = write_parquet(rows, str(tmp_path / "bad.parquet"))
    missing = r"row 0 video 0: the video file 'clip.mp4' (does not exist|needs a video reader: pip install hybridrl\[video\])"
    with pytest.raises(ValueError, match=missing):
        RLHFDataset(path, processor.tokenizer, RLDataConfig(max_prompt_length=P), processor=processor)
    rows = visual_task.make_video_rows(2, seed=0)
    rows[0]["videos"] = []
    path = write_parquet(rows, str(tmp_path / "count.parquet"))
    with pytest.raises(ValueError, match=r"row 0: the prompt has 1 <video> placeholder\(s\)"):
        RLHFDataset(path, processor.tokenizer, RLDataConfig(max_prompt_length=P), processor=processor)


def test_rollout_log_probs_equal_the_trainer_recompute_with_videos(setup):
    """HF generate sees the videos (3-D positions of image + video + text); the trainer's padded and
    packed recompute give the same log-probs; the frames change them."""
    rollout, _, ds, _ = setup
    prompts = DataProto.from_single_dict(collate_fn([ds[i] for i in range(4)]))
    out = rollout.generate_sequences(prompts)
    batch = attach_multimodal(
        out.batch.select("input_ids", "attention_mask", "position_ids", "responses"), out
    )
    mask = out.batch["response_mask"].bool()
    with torch.no_grad():
        for packed in (False, True):
            lp = forward_log_probs(rollout.model, batch, use_remove_padding=packed).log_probs
            torch.testing.assert_close(lp[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)
        flipped = [
            {**m, "pixel_values_videos": -m["pixel_values_videos"]} for m in out.non_tensor_batch[MM_KEY]
        ]
        other = DataProto(batch=out.batch, non_tensor_batch={**out.non_tensor_batch, MM_KEY: flipped})
        moved = attach_multimodal(
            out.batch.select("input_ids", "attention_mask", "position_ids", "responses"), other
        )
        lp2 = forward_log_probs(rollout.model, moved, use_remove_padding=True).log_probs
    assert float((lp2 - lp)[mask].abs().max()) > 1e-4


def test_video_row_alone_equals_the_batch(setup):
    """Each row alone through the model's own position computation (mm_token_type_ids 1 / 2) ==
    the padded batch forward."""
    rollout, processor, ds, _ = setup
    model = rollout.model
    items = [ds[i] for i in range(2)]
    prompts = collate_fn(items)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(10, 40, (2, T), generator=g)
    ids = torch.cat([prompts["input_ids"], responses], 1)
    attn = torch.cat([prompts["attention_mask"], torch.ones(2, T, dtype=torch.long)], 1)
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
         "responses": responses}, non_tensors={MM_KEY: prompts[MM_KEY]},
    )  # fmt: skip
    with torch.no_grad():
        lp = forward_log_probs(model, attach_multimodal(data.batch.clone(), data)).log_probs
        for i, item in enumerate(items):
            row = ids[i][attn[i].bool()][None]
            cfg = model.config
            types = (row == cfg.image_token_id).int() + 2 * (row == cfg.video_token_id).int()
            logits = model(input_ids=row, mm_token_type_ids=types, **item[MM_KEY]).logits[0]
            ref = torch.log_softmax(logits[-T - 1 : -1].float(), -1).gather(-1, responses[i, :, None])[:, 0]
            torch.testing.assert_close(lp[i], ref, atol=1e-5, rtol=0)
