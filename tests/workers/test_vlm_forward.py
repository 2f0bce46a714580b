"""Vision-language forward: 3-D rotary positions and pixel inputs in the padded and packed paths."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from hybridrl.data import visual_task
from hybridrl.data.multimodal import process_row
from hybridrl.engine.forward import forward_log_probs
from hybridrl.engine.multimodal import MM_KEY, attach_multimodal
from hybridrl.models.vlm import VLM_FAMILIES, build_tiny_vlm, load_processor
from hybridrl.protocol import DataProto

pytest.importorskip("PIL")
T = 5


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_processor(path)


def _batch(processor, p_len=40):
    """3 rows: two images of different sizes, one text-only; left-padded prompts, right-padded responses."""
    from PIL import Image

    rows = visual_task.make_rl_rows(2, seed=3)
    rows[1]["images"] = [Image.new("RGB", (84, 56), (0, 200, 0))]
    tok = processor.tokenizer
    ids, mms, text_row = [], [], [{"role": "user", "content": "no picture here"}]
    for r in rows:
        _, row_ids, mm = process_row(processor, r["prompt"], r["images"], "row", {}, {})
        ids.append(row_ids)
        mms.append(mm)
    ids.append(
        tok.apply_chat_template(text_row, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    mms.append({})
    g = torch.Generator().manual_seed(0)
    b = len(ids)
    input_ids = torch.full((b, p_len + T), tok.pad_token_id)
    mask = torch.zeros(b, p_len + T, dtype=torch.long)
    resp_lens = [T, 3, 4]
    for i, row in enumerate(ids):
        input_ids[i, p_len - len(row) : p_len] = torch.tensor(row)
        mask[i, p_len - len(row) : p_len + resp_lens[i]] = 1
        input_ids[i, p_len : p_len + resp_lens[i]] = torch.randint(10, 90, (resp_lens[i],), generator=g)
    td = TensorDict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
         "responses": input_ids[:, p_len:]}, batch_size=[b],
    )  # fmt: skip
    data = DataProto(batch=td, non_tensor_batch={MM_KEY: mms})
    return data, ids, mms, resp_lens


def _reference(model, ids, mms, resp_lens, data):
    """Each row alone, unpadded, through the model's own position computation (mm_token_type_ids)."""
    out = torch.zeros(len(ids), T)
    p_len = data.batch["input_ids"].shape[1] - T
    for i, (row, mm) in enumerate(zip(ids, mms)):
        full = torch.cat([torch.tensor(row), data.batch["responses"][i, : resp_lens[i]]])[None]
        types = (full == model.config.image_token_id).int()
        logits = model(input_ids=full, mm_token_type_ids=types, **mm).logits[0].float()
        lp = torch.log_softmax(logits[len(row) - 1 : -1], -1)
        out[i, : resp_lens[i]] = lp.gather(-1, full[0, len(row) :, None])[:, 0]
    assert p_len  # the prompt width is the padded batch's
    return out


@pytest.mark.parametrize("fused", [True, False])
def test_padded_equals_packed_equals_one_row_at_a_time(vlm, fused):
    model, processor = vlm
    data, ids, mms, resp_lens = _batch(processor)
    batch = attach_multimodal(data.batch.clone(), data)
    mask = data.batch["attention_mask"][:, -T:].bool()
    with torch.no_grad():
        ref = _reference(model, ids, mms, resp_lens, data)
        padded = forward_log_probs(
            model, batch, use_remove_padding=False, fused=fused, calculate_entropy=True
        )
        packed = forward_log_probs(model, batch, use_remove_padding=True, fused=fused, calculate_entropy=True)
    torch.testing.assert_close(padded.log_probs[mask], ref[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.log_probs[mask], padded.log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.entropy[mask], padded.entropy[mask], atol=1e-5, rtol=0)


def test_pixels_matter_and_micro_batches_split_them(vlm):
    """The image changes the log-probs (the pixels reach the model), and the actor's micro-batch
    split carries each row's pixels with it (micro-batch 1 == the whole batch)."""
    from hybridrl.workers.actor import PPOActor

    model, processor = vlm
    data, *_ = _batch(processor)
    mask = data.batch["attention_mask"][:, -T:].bool()
    actor = PPOActor(None, model, use_remove_padding=True)
    whole = actor.compute_log_prob(data, micro_batch_size=3).log_probs
    ones = actor.compute_log_prob(data, micro_batch_size=1).log_probs
    torch.testing.assert_close(ones[mask], whole[mask], atol=1e-5, rtol=0)
    dynamic = actor.compute_log_prob(data, use_dynamic_bsz=True, max_token_len=60).log_probs  # rows regrouped
    torch.testing.assert_close(dynamic[mask], whole[mask], atol=1e-5, rtol=0)
    swapped = DataProto(batch=data.batch, non_tensor_batch={MM_KEY: data.non_tensor_batch[MM_KEY].copy()})
    flipped = dict(swapped.non_tensor_batch[MM_KEY][0])
    flipped["pixel_values"] = -flipped["pixel_values"]
    swapped.non_tensor_batch[MM_KEY][0] = flipped
    other = actor.compute_log_prob(swapped, micro_batch_size=3).log_probs
    assert (other[0] - whole[0]).abs().max() > 1e-4
    torch.testing.assert_close(other[1:][mask[1:]], whole[1:][mask[1:]], atol=1e-5, rtol=0)


def test_visual_task_scorer():
    assert visual_task.compute_score("#### red", "red") == 1.0
    assert visual_task.compute_score("Red it is", "red") == 1.0
    assert visual_task.compute_score("#### blue", "red") == 0.0
    assert visual_task.compute_score("", "red") == 0.0
