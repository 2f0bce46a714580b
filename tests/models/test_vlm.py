"""The tiny vision-language models built from configs (no download)."""

import pytest
import torch

from hybridrl.models.vlm import (
    PATCH_SIZE,
    VLM_FAMILIES,
    build_tiny_vlm,
    build_vlm_config,
    build_vlm_tokenizer,
    load_processor,
)

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param), request.param


def test_folder_loads_with_auto_classes_and_runs(vlm_dir):
    from transformers import AutoConfig, AutoModelForImageTextToText

    path, family = vlm_dir
    assert AutoConfig.from_pretrained(path).model_type == family
    processor = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[PIL.new("RGB", (56, 112), (255, 0, 0))], return_tensors="pt")
    # width 56 x height 112 pixels = 8 x 4 (h x w) patches of 14 = 32 patch rows; merge 2 x 2 -> 8 image
    # tokens (Qwen3-VL, patch 16: resized to 64 x 128, again 8 x 4 patches)
    patch = PATCH_SIZE[family]
    assert processor.image_processor.patch_size == model.config.vision_config.patch_size == patch
    assert enc["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert enc["pixel_values"].shape == (32, 3 * 2 * patch * patch)
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 8
    out = model(**enc)
    assert out.logits.shape == (1, enc["input_ids"].shape[1], model.config.text_config.vocab_size)


def test_text_only_folder_has_no_processor():
    from hybridrl.models.builtin import get_builtin_model_path

    assert load_processor(get_builtin_model_path()) is None


def test_config_checks():
    tok = build_vlm_tokenizer()
    with pytest.raises(ValueError, match="unknown tiny VLM family"):
        build_vlm_config("llava", tok)
    with pytest.raises(ValueError, match="must be 64"):
        build_vlm_config("qwen2_vl", tok, hidden_size=96)


def test_freeze_vision_tower_leaves_the_encoder_without_gradients(vlm_dir):
    from transformers import AutoModelForImageTextToText

    from hybridrl.models.vlm import freeze_vision_tower, vision_tower

    path, _ = vlm_dir
    processor = load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    frozen = freeze_vision_tower(model)
    assert frozen == sum(p.numel() for p in vision_tower(model).parameters()) > 0
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[PIL.new("RGB", (56, 56), (0, 0, 255))], return_tensors="pt")
    model(**enc).logits.sum().backward()
    assert all(p.grad is None for p in vision_tower(model).parameters())
    assert model.lm_head.weight.grad is not None


def test_freeze_vision_tower_refuses_a_text_model():
    from transformers import AutoModelForCausalLM

    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.models.vlm import freeze_vision_tower

    with pytest.raises(ValueError, match="has no vision tower"):
        freeze_vision_tower(AutoModelForCausalLM.from_pretrained(get_builtin_model_path()))


def test_vlm_tokenizer_round_trips_spaces_and_newlines(tmp_path):
    """The character tokenizer's byte-level space / newline (af3ee03) survive in the VLM folder."""
    from transformers import AutoTokenizer

    path = build_tiny_vlm(tmp_path / "m", "qwen2_vl")
    text = "What colour is\nthe shape?  #### dark red"
    for tok in (AutoTokenizer.from_pretrained(path), load_processor(path).tokenizer):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.slow  # ~20 s on one thread
def test_format_warm_start_teaches_the_format_not_the_colour(tmp_path):
    """After the warm start every greedy reply is '#### <colour>' (the reward's format)."""
    import re

    from hybridrl.data import visual_task
    from hybridrl.models.vlm_warm_start import format_warm_start, greedy_answers

    path = build_tiny_vlm(tmp_path / "m", "qwen2_vl", seed=0)
    info = format_warm_start(path, steps=50, seed=0, batch_size=8, lr=3e-3, num_threads=1)
    assert info["final_loss"] < 0.25
    replies = greedy_answers(path, visual_task.make_rl_rows(4, 0, split="val"))
    assert all(re.fullmatch(r"#### (red|green|blue|yellow)", r) for r in replies), replies
