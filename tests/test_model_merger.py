"""model_merger: DCP shards of a trained checkpoint -> a plain Hugging Face folder."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest
import torch

from hybridrl.trainer.offline.model_merger import (
    MergeError,
    compare_with_hf,
    main,
    merge_checkpoint,
    merge_lora,
)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    from hybridrl.data.builtin_task import make_sft_rows
    from hybridrl.models.builtin import build_model_config
    from hybridrl.models.tokenizer_builder import build_tokenizer

    root = tmp_path_factory.mktemp("merge")
    model = str(root / "model")
    tok = build_tokenizer(model)
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        build_model_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    ).save_pretrained(model)
    train = str(root / "train.parquet")
    pd.DataFrame(make_sft_rows(32, seed=0, split="train")).to_parquet(train)
    return {"root": root, "model": model, "train": train}


def train(tiny, out_dir, **model_extra):
    """Two SFT steps with a checkpoint at step 2; returns (trainer, checkpoint folder)."""
    from hybridrl.trainer.sft.config import load_sft_config
    from hybridrl.trainer.sft.launch import init_distributed
    from hybridrl.trainer.sft.trainer import SFTTrainer

    config = load_sft_config(
        {
            "model": {"partial_pretrain": tiny["model"], **model_extra},
            "data": {
                "train_files": tiny["train"],
                "train_batch_size": 16,
                "micro_batch_size_per_gpu": 16,
                "max_length": 32,
            },
            "optim": {"lr": 1e-2},
            "trainer": {
                "total_training_steps": 2,
                "save_freq": 2,
                "default_local_dir": str(out_dir),
                "logger": [],
                "resume_mode": "disable",
            },
        }
    )
    init_distributed(config)
    trainer = SFTTrainer(config)
    trainer.fit()
    return trainer, out_dir / "global_step_2"


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    trainer, ckpt = train(tiny, tmp_path_factory.mktemp("run"))
    ids = torch.tensor([[1, 5, 20, 30, 12, 40, 7, 2]])
    with torch.no_grad():
        logits = trainer.engine.module(input_ids=ids).logits.detach().clone()
    return {"ckpt": ckpt, "ids": ids, "logits": logits}


def logits_of(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_model_reproduces_the_trained_logits(trained, tmp_path):
    out = merge_checkpoint(str(trained["ckpt"]), str(tmp_path / "hf"))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).exists(), name
    torch.testing.assert_close(logits_of(out, trained["ids"]), trained["logits"], rtol=0, atol=1e-5)


def test_merge_reads_the_shards_not_the_hf_export(trained, tiny, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained["ckpt"], ckpt)
    # replace the exported weights with the untrained model's: the merge must not use them
    shutil.copy(f"{tiny['model']}/model.safetensors", ckpt / "huggingface" / "model.safetensors")
    out = merge_checkpoint(str(ckpt), str(tmp_path / "hf"))
    torch.testing.assert_close(logits_of(out, trained["ids"]), trained["logits"], rtol=0, atol=1e-5)
    assert not torch.allclose(logits_of(ckpt / "huggingface", trained["ids"]), trained["logits"], atol=1e-3)


def test_cli_merge_and_test_subcommands(trained, tiny, tmp_path, capsys):
    assert (
        main(
            [
                "merge",
                "--backend",
                "fsdp",
                "--local_dir",
                str(trained["ckpt"]),
                "--target_dir",
                str(tmp_path / "hf"),
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).dtype == torch.bfloat16
    assert (
        main(
            [
                "test",
                "--local_dir",
                str(trained["ckpt"]),
                "--test_hf_dir",
                str(trained["ckpt"] / "huggingface"),
            ]
        )
        == 0
    )
    with pytest.raises(MergeError, match="differs"):
        compare_with_hf(str(trained["ckpt"]), tiny["model"])


def test_missing_config_and_bad_folder(trained, tiny, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained["ckpt"], ckpt)
    shutil.rmtree(ckpt / "huggingface")
    with pytest.raises(MergeError, match="--hf_model_path"):
        merge_checkpoint(str(ckpt), str(tmp_path / "out"))
    out = merge_checkpoint(str(ckpt), str(tmp_path / "out"), hf_model_path=tiny["model"])
    torch.testing.assert_close(logits_of(out, trained["ids"]), trained["logits"], rtol=0, atol=1e-5)
    assert main(["merge", "--local_dir", str(tmp_path), "--target_dir", str(tmp_path / "x")]) == 2
    assert "no torch.distributed.checkpoint shards" in capsys.readouterr().err


def test_merge_lora_by_hand():
    w = torch.ones(2, 3)
    a = torch.tensor([[1.0, 0.0, 2.0]])  # (r=1, in=3)
    b = torch.tensor([[1.0], [-1.0]])  # (out=2, r=1)
    state = {
        "base_model.model.layer.base_layer.weight": w,
        "base_model.model.layer.base_layer.bias": torch.zeros(2),
        "base_model.model.layer.lora_A.default.weight": a,
        "base_model.model.layer.lora_B.default.weight": b,
        "base_model.model.norm.weight": torch.ones(3),
    }
    out = merge_lora(state, scaling=0.5)
    assert set(out) == {"layer.weight", "layer.bias", "norm.weight"}
    torch.testing.assert_close(out["layer.weight"], torch.tensor([[1.5, 1.0, 2.0], [0.5, 1.0, 0.0]]))


def test_lora_checkpoint_merges_into_the_base_weights(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    _, ckpt = train(tiny, tmp_path / "run", lora_rank=4, lora_alpha=8)
    out = merge_checkpoint(str(ckpt), str(tmp_path / "hf"))
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(str(ckpt / "huggingface")).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny["model"]).state_dict()
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], base[q])
    for name in exported:
        torch.testing.assert_close(merged[name], exported[name], rtol=1e-6, atol=1e-6)
    (ckpt / "lora_adapter" / "adapter_config.json").unlink()
    with pytest.raises(MergeError, match="adapter_config.json"):
        merge_checkpoint(str(ckpt), str(tmp_path / "hf2"))
