"""model_merger with a vision-language model: DCP shards -> an HF folder with the processor files."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("PIL")


def _logits(model, processor):
    from hybridrl.data import visual_task
    from hybridrl.data.multimodal import process_row

    row = visual_task.make_rl_rows(1, seed=2)[0]
    _, ids, mm = process_row(processor, row["prompt"], row["images"], "row", {}, {})
    ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **mm).logits


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_merge_writes_the_processor_files(tmp_path, family):
    from transformers import AutoModelForImageTextToText

    from hybridrl.engine.checkpoint import save_checkpoint
    from hybridrl.models.vlm import build_tiny_vlm, load_processor
    from hybridrl.trainer.offline.model_merger import MergeError, merge_checkpoint

    src = build_tiny_vlm(tmp_path / "model", family, seed=0)
    processor = load_processor(src)
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():  # "trained" weights, vision tower included: the merge must take these
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    trained = _logits(model, processor)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(str(ckpt), model, contents=["model"])
    out = merge_checkpoint(str(ckpt), str(tmp_path / "hf"), hf_model_path=src)
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert names & {"processor_config.json", "preprocessor_config.json"}, names
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    reloaded = load_processor(out)
    assert type(reloaded.image_processor).__name__ == type(processor.image_processor).__name__
    assert reloaded.image_processor.patch_size == processor.image_processor.patch_size  # Qwen3-VL: 16
    torch.testing.assert_close(_logits(merged, reloaded), trained, atol=1e-5, rtol=0)
    assert not torch.allclose(_logits(AutoModelForImageTextToText.from_pretrained(src), processor), trained)
    # a source folder without the processor files: refused, with the fix
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "model" / name, bare / name)
    with pytest.raises(MergeError, match="no processor files.*--hf_model_path"):
        merge_checkpoint(str(ckpt), str(tmp_path / "hf2"), hf_model_path=str(bare))
