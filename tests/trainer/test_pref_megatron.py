"""main_rm and main_dpo with `model_engine=megatron` (TP=2 or PP=2) equal the same trainers with FSDP2 on the
same 2 gloo ranks, and a Megatron run stopped after a checkpoint resumes to the uninterrupted run's weights.

Real megatron-core on CPU, one fork per rank (fsdp_testkit.spawn). FSDP splits each batch of pairs over
the 2 ranks; Megatron splits the model over them (one data-parallel rank). Same pairs, same AdamW
(weight decay 0: Megatron exempts biases and norms from it; eps 1e-3, see test_sft_megatron.py), the
reference log-probs precomputed by each engine from the same starting weights; the reward model's new
score head drawn from the same seed (`model.megatron.seed` = `trainer.seed`). The reward models'
sequence-classification exports hold the same weights.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from fsdp_testkit import spawn  # noqa: E402
from test_sft import build_tiny_model  # noqa: E402

STEPS = 4
TOL = 1e-5


def _config(kind: str, root: str, engine: str, out: str, tp: int = 2, pp: int = 1, **trainer):
    from hybridrl.trainer.pref.config import load_pref_config

    extra = {"generation_eval": {"enable": False}} if kind == "dpo" else {}
    return load_pref_config(
        kind,
        {
            **extra,
            "model_engine": engine,
            "model": {
                "partial_pretrain": f"{root}/model",
                "megatron": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "seed": 3},
                "use_prefix_grouper": False,
            },
            "data": {
                "train_files": f"{root}/train.parquet",
                "val_files": f"{root}/val.parquet",
                "train_batch_size": 8,
                "micro_batch_size_per_gpu": 2,
            },
            "optim": {"lr": 2e-3, "weight_decay": 0.0, "eps": 1e-3},
            "trainer": {
                "total_training_steps": STEPS,
                "default_local_dir": f"{root}/{out}",
                "seed": 3,
                "logger": [],
                "resume_mode": "disable",
                "val_before_train": False,
                **trainer,
            },
        },
    )


def _trainer(cfg):
    from hybridrl.trainer.pref.data import load_pref_datasets
    from hybridrl.trainer.pref.trainer import DPOTrainer, RewardModelTrainer

    tok, train, val, val_files = load_pref_datasets(cfg)
    cls = RewardModelTrainer if hasattr(cfg, "rm") else DPOTrainer
    return cls(cfg, train, val, tok, val_files)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.engine.iter_params()}


def _run(rank, world, kind, root, tp, pp):
    out = {}
    for engine in ("dp", "megatron"):
        trainer = _trainer(_config(kind, root, engine, f"ckpt_{engine}", tp, pp))
        trainer.fit()
        out[engine] = {
            "val": trainer.validate(),
            "dp_size": trainer.dp_size,
            "engine": type(trainer.engine).__name__,
            "weights": _weights(trainer),
        }
        if kind == "rm":
            trainer.export(f"{root}/export_{engine}")
    # Megatron: 2 steps, checkpoint, resume, 2 more == 4 steps in one run
    resumable = {"save_freq": 2, "resume_mode": "auto"}
    _trainer(_config(kind, root, "megatron", "resumable", tp, pp, **resumable)).fit(stop_at_step=2)
    resumed = _trainer(_config(kind, root, "megatron", "resumable", tp, pp, **resumable))
    resumed.fit()
    out["resumed"] = {"weights": _weights(resumed), "step": resumed.global_step}
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind,tp,pp", [("dpo", 2, 1), ("dpo", 1, 2), ("rm", 2, 1), ("rm", 1, 2)])
def test_megatron_equals_fsdp_and_resumes_exactly(tmp_path, kind, tp, pp):
    """TP=2, and PP=2 (the loss on the last pipeline stage, the metrics sent to every rank)."""
    pytest.importorskip("megatron.core")
    from hybridrl.data.builtin_task import write_parquet
    from hybridrl.data.preference import make_preference_rows

    root = str(tmp_path)
    build_tiny_model(f"{root}/model")
    write_parquet(make_preference_rows(32, 0, "train"), f"{root}/train.parquet")
    write_parquet(make_preference_rows(8, 1, "val"), f"{root}/val.parquet")
    spawn(_run, 2, tmp_path, kind, root, tp, pp)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        f, m = out["dp"], out["megatron"]
        print(
            rank,
            {k: f[k] for k in ("val", "dp_size", "engine")},
            {k: m[k] for k in ("val", "dp_size", "engine")},
        )
        assert (f["engine"], f["dp_size"]) == ("FSDPEngine", 2)
        assert (m["engine"], m["dp_size"]) == ("MegatronEngine", 1)
        assert (
            f["val"]["val/loss"] < 0.6931 - 0.01
        )  # it trained (log 2 at the start; the RM's started near it)
        for key, value in f["val"].items():
            assert abs(value - m["val"][key]) <= TOL * max(1.0, abs(value)), (key, value, m["val"][key])
        for name, value in f["weights"].items():
            torch.testing.assert_close(m["weights"][name], value, atol=TOL, rtol=TOL, msg=name)
        assert out["resumed"]["step"] == STEPS
        for name, value in m["weights"].items():
            assert torch.equal(out["resumed"]["weights"][name], value), name
    if kind == "rm":
        from transformers import AutoModelForSequenceClassification

        f, m = (
            AutoModelForSequenceClassification.from_pretrained(f"{root}/export_{e}")
            for e in ("dp", "megatron")
        )
        assert type(f) is type(m)
        fs, ms = f.state_dict(), m.state_dict()
        assert set(fs) == set(ms)
        for name, value in fs.items():
            torch.testing.assert_close(ms[name], value, atol=TOL, rtol=TOL, msg=name)
