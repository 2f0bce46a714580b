"""`actor.use_prefix_grouper` with a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

The shared prompt holds image / video tokens and 3-D (mrope) positions: the grouped forward
computes each group's prompt, and its pixels, once, and must still give what the plain forward
gives row by row: log-probs, entropy and the gradient of every parameter, vision tower included
(fp32). The batch mixes groups with an image, the same text with another picture (equal token
ids, so the pixels must keep the groups apart), a text-only prompt, a two-image prompt, a video
prompt, a response that samples an image token (fed as text) and a response with a tool image
(an agent loop's fed image tokens). Qwen3-VL refuses videos (hybridrl.data.video.NO_VIDEO_FAMILIES):
its fifth prompt holds a third picture size instead of the video, and the refusal is tested.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from hybridrl.data.multimodal import process_row
from hybridrl.data.video import NO_VIDEO_FAMILIES
from hybridrl.engine.forward import forward_log_probs
from hybridrl.engine.multimodal import FED_KEY, MM_KEY, prompt_media_keys
from hybridrl.engine.prefix_group import build_prefix_layout, model_refusal
from hybridrl.models.vlm import VLM_FAMILIES, build_tiny_vlm, load_processor

pytest.importorskip("PIL")
P, T = 48, 10
RED, BLUE, GREEN = (200, 0, 0), (0, 0, 200), (0, 200, 0)


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    path = build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=4)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return model.train(False), load_processor(path)


def _picture(colour, size=(56, 56)):
    from PIL import Image

    im = Image.new("RGB", size, (255, 255, 255))
    im.paste(Image.new("RGB", (size[0] // 2, size[1] // 2), colour), (size[0] // 4, size[1] // 4))
    return im


def _prompts(processor):
    """(ids, multi_modal_inputs) of five prompts: red / blue picture with the same text (equal
    ids), text only, two pictures, a 3-frame video."""
    q = [{"role": "user", "content": "<image>What colour is the shape?"}]
    out = [process_row(processor, q, [_picture(c)], "row", {}, {})[1:] for c in (RED, BLUE)]
    assert out[0][0] == out[1][0]  # equal token ids, different pixels
    text = [{"role": "user", "content": "no picture here"}]
    out.append(
        (processor.tokenizer.apply_chat_template(text, add_generation_prompt=True, return_dict=False), {})
    )
    two = [{"role": "user", "content": "<image>and<image>which is larger?"}]
    out.append(process_row(processor, two, [_picture(GREEN, (84, 56)), _picture(RED)], "row", {}, {})[1:])
    vid = [{"role": "user", "content": "<video>Where does it go?"}]
    clip = {"video": [_picture(c, (56, 84)) for c in (RED, GREEN, BLUE)]}
    if processor.hybridrl_model_type in NO_VIDEO_FAMILIES:  # videos refused: a third picture size
        with pytest.raises(ValueError, match="videos with a Qwen3-VL model are not supported yet"):
            process_row(processor, vid, [], "row", {}, {}, videos=[clip])
        pic = [{"role": "user", "content": "<image>Where does it go?"}]
        out.append(process_row(processor, pic, [_picture(BLUE, (56, 84))], "row", {}, {})[1:])
        return out
    out.append(process_row(processor, vid, [], "row", {}, {}, videos=[clip])[1:])
    return out


def _tool_response(processor, g):
    """A response with a tool turn's picture in it: (ids (T,), its pixel inputs, fed positions)."""
    tok = processor.tokenizer
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    enc = processor.image_processor(images=[_picture(BLUE)], return_tensors="pt")
    n = int(enc["image_grid_thw"][0].prod()) // 4
    ids = [*torch.randint(10, 90, (2,), generator=g).tolist(), tok.convert_tokens_to_ids("<|vision_start|>")]
    ids += [pad] * n + [tok.convert_tokens_to_ids("<|vision_end|>"), 40, 41]
    fed = torch.arange(3, 3 + n)
    return (
        torch.tensor(ids),
        {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]},
        fed,
    )


def vlm_batch(processor):
    """Rows of 5 prompts (group sizes 3, 2, 2, 2, 2), interleaved; responses of several lengths."""
    prompts = _prompts(processor)
    tok = processor.tokenizer
    g = torch.Generator().manual_seed(0)
    rows = [k for k, n in enumerate((3, 2, 2, 2, 2)) for _ in range(n)]
    order = [0, 3, 5, 7, 9, 1, 4, 6, 8, 10, 2]
    rows = [rows[i] for i in order]
    b = len(rows)
    input_ids = torch.full((b, P + T), tok.pad_token_id)
    mask = torch.zeros(b, P + T, dtype=torch.long)
    mms = []
    for i, k in enumerate(rows):
        ids, mm = prompts[k]
        input_ids[i, P - len(ids) : P] = torch.tensor(ids)
        n = [T, 3, 7, 1, 5, 8][i % 6]
        resp = torch.randint(10, 90, (n,), generator=g)
        mm = dict(mm)
        if i == 2:  # the policy sampled an image token: a text token to the trainer
            resp[0] = tok.convert_tokens_to_ids("<|image_pad|>")
        if i == 3:  # a tool turn's picture in the response (agent loop): fed as an image
            resp, tool_mm, fed = _tool_response(processor, g)
            n = len(resp)
            mm = {k: torch.cat([torch.as_tensor(mm[k]), tool_mm[k]]) for k in tool_mm}
            mm[FED_KEY] = fed
        input_ids[i, P : P + n] = resp
        mask[i, P - len(ids) : P + n] = 1
        mms.append(mm)
    from tensordict import NonTensorStack

    td = TensorDict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
         "responses": input_ids[:, P:]}, batch_size=[b],
    )  # fmt: skip
    td[MM_KEY] = NonTensorStack(*mms)
    return td


def _run(model, batch, *, grouped, packed=True, fused=True):
    model.zero_grad(set_to_none=True)
    res = forward_log_probs(
        model, batch, temperature=0.7, use_remove_padding=packed, calculate_entropy=True, fused=fused,
        prefix_group=grouped,
    )  # fmt: skip
    mask = batch["attention_mask"][:, P:].bool()
    ((res.log_probs + 0.1 * res.entropy) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return res.log_probs[mask].detach(), res.entropy[mask].detach(), grads


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_vlm_forward_equals_the_plain_one_with_gradients(vlm, fused):
    model, processor = vlm
    batch = vlm_batch(processor)
    plain = _run(model, batch, grouped=False, fused=fused)
    grouped = _run(model, batch, grouped=True, fused=fused)
    padded = _run(model, batch, grouped=False, packed=False, fused=fused)
    for a, b, c in zip(plain[:2], grouped[:2], padded[:2]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        torch.testing.assert_close(b, c, atol=1e-5, rtol=0)
    assert plain[2].keys() == grouped[2].keys()
    assert any(n.startswith("model.visual") for n in grouped[2]), "the vision tower gets a gradient"
    for name in plain[2]:
        torch.testing.assert_close(grouped[2][name], plain[2][name], atol=1e-5, rtol=1e-4, msg=name)


def test_pixels_keep_groups_apart_and_run_once_per_group(vlm):
    """Equal ids with different pictures are two groups; the vision tower sees each group's
    pictures once (plus the tool image), not once per row."""
    model, processor = vlm
    batch = vlm_batch(processor)
    t = batch["responses"].shape[1]
    layout = build_prefix_layout(batch["input_ids"], batch["attention_mask"], t)
    assert layout.num_groups == 4  # the red and blue rows merge on ids alone
    keyed = build_prefix_layout(
        batch["input_ids"], batch["attention_mask"], t, prompt_media_keys(model, batch)
    )
    assert keyed.num_groups == 5
    seen = []
    hook = model.model.visual.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            forward_log_probs(model, batch, use_remove_padding=True, prefix_group=False)
            plain, seen[:] = sum(seen), []
            forward_log_probs(model, batch, use_remove_padding=True, prefix_group=True)
    finally:
        hook.remove()
    pixel_rows = [
        sum(len(v) for k, v in mm.items() if k.startswith("pixel")) for _, mm in _prompts(processor)
    ]
    tool = len(batch[MM_KEY].tolist()[3]["pixel_values"]) - pixel_rows[3]  # row 3: prompt 3 + a tool image
    assert tool > 0 and sum(seen) == sum(pixel_rows) + tool < plain


def test_model_refusal_takes_the_qwen_vl_families_only(tmp_path):
    from transformers import LlavaConfig, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    from hybridrl.trainer.ppo.vlm_setup import _check_grouper
    from hybridrl.utils.config_loader import ConfigError

    assert model_refusal(Qwen2VLConfig()) is None and model_refusal(Qwen2_5_VLConfig()) is None
    assert model_refusal(Qwen3VLConfig()) is None
    assert "vision-language model of model_type='llava'" in model_refusal(LlavaConfig())
    LlavaConfig().save_pretrained(tmp_path)  # use_prefix_grouper=true with it fails at start-up
    with pytest.raises(
        ConfigError, match=r"use_prefix_grouper=True: a vision-language model of model_type='llava'"
    ):
        _check_grouper(str(tmp_path), trust_remote_code=False)
    Qwen2VLConfig().save_pretrained(tmp_path)
    _check_grouper(str(tmp_path), trust_remote_code=False)  # taken
