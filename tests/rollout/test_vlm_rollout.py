"""HFRollout with a tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL: pixel inputs reach generate; rollout
log-probs == the trainer's recompute."""

from __future__ import annotations

import pytest
import torch

from hybridrl.data import visual_task
from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset, collate_fn
from hybridrl.engine.forward import forward_log_probs
from hybridrl.engine.multimodal import MM_KEY, attach_multimodal
from hybridrl.models.vlm import PATCH_SIZE, VLM_FAMILIES, build_tiny_vlm, load_processor
from hybridrl.protocol import DataProto
from hybridrl.rollout import RolloutConfig
from hybridrl.rollout.hf import HFRollout

pytest.importorskip("PIL")
P, T = 40, 8


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def setup(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_rollout")
    path = build_tiny_vlm(tmp / "model", request.param, seed=2)
    processor = load_processor(path)
    files = visual_task.write_rl_parquet(str(tmp / "train.parquet"), 4, seed=5)
    cfg = RLDataConfig(max_prompt_length=P, image_patch_size=PATCH_SIZE[request.param])  # Qwen3-VL: 16
    ds = RLHFDataset(files, processor.tokenizer, cfg, processor=processor)
    prompts = DataProto.from_single_dict(collate_fn([ds[i] for i in range(4)]))
    cfg = RolloutConfig(name="hf", dtype="float32", prompt_length=P, response_length=T, calculate_log_probs=True,
                        temperature=1.0, ignore_eos=True)  # fmt: skip
    return HFRollout(cfg, path, processor.tokenizer, device="cpu"), prompts


def test_rollout_log_probs_equal_the_trainer_recompute(setup):
    rollout, prompts = setup
    out = rollout.generate_sequences(prompts)
    assert MM_KEY in out.non_tensor_batch
    batch = attach_multimodal(
        out.batch.select("input_ids", "attention_mask", "position_ids", "responses"), out
    )
    mask = out.batch["response_mask"].bool()
    assert mask.sum() == 4 * T
    with torch.no_grad():
        for packed in (False, True):
            lp = forward_log_probs(rollout.model, batch, use_remove_padding=packed).log_probs
            torch.testing.assert_close(lp[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_generation_sees_the_pixels(setup):
    """Greedy responses computed with the images differ from those with every pixel zeroed."""
    rollout, prompts = setup
    greedy = DataProto(batch=prompts.batch, non_tensor_batch=dict(prompts.non_tensor_batch),
                       meta_info={"greedy": True})  # fmt: skip
    a = rollout.generate_sequences(greedy)
    zeroed = [
        {**m, "pixel_values": torch.zeros_like(m["pixel_values"])} for m in prompts.non_tensor_batch[MM_KEY]
    ]
    blank = DataProto(batch=prompts.batch, non_tensor_batch={**prompts.non_tensor_batch, MM_KEY: zeroed},
                      meta_info={"greedy": True})  # fmt: skip
    b = rollout.generate_sequences(blank)
    with torch.no_grad():
        la = forward_log_probs(
            rollout.model,
            attach_multimodal(a.batch.select("input_ids", "attention_mask", "position_ids", "responses"), a),
        ).log_probs
        lb = forward_log_probs(
            rollout.model,
            attach_multimodal(a.batch.select("input_ids", "attention_mask", "position_ids", "responses"), b),
        ).log_probs
    assert (la - lb).abs().max() > 1e-4  # the same tokens score differently without the image
