"""Megatron checkpoints: save at TP=2, resume at TP=1 (DP=2), and the next steps equal the uninterrupted run.

Two updates after the save are compared: the first depends on the restored weights, the second
also on the restored Adam moments and per-parameter `step` counts (Megatron's distributed
optimizer shares one `step` tensor after a load unless it is cloned) and on the lr schedule
(a warm-up makes the lr differ per step). The HF export of the checkpointed engine loads in
transformers and gives the engine's log-probs; `model_merger merge --backend megatron` on the
checkpoint writes the same weights (and logits).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_testkit import make_tiny_model_dir, spawn  # noqa: E402
from test_megatron_engine import ROWS, _batch, _configs, _four_layer_model  # noqa: E402


def _actor(model_dir, tp, distributed_optimizer=True, pp=1, vpp=None):
    from hybridrl.config.roles import OptimConfig
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _, mcfg = _configs(model_dir, tp, pp, vpp)
    cfg = dataclasses.replace(
        cfg, optim=OptimConfig(lr=2e-3, lr_warmup_steps=3, clip_grad=1.0, weight_decay=0.01)
    )
    mcfg = dataclasses.replace(mcfg, use_distributed_optimizer=distributed_optimizer)
    engine = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=engine.dp_size)
    return engine, PPOActor(cfg, engine, batch_sizes=sizes)


def _mine(data, engine, rank):
    return data if engine.dp_size == 1 else data.chunk(engine.dp_size)[rank]


def _run(rank, world, model_dir, ckpt, result_dir):
    from megatron.core import parallel_state as ps

    out = {}
    engine, actor = _actor(model_dir, tp=2)
    batches = [_batch(seed=s) for s in (11, 12, 13)]
    actor.update_policy(batches[0])
    engine.save_checkpoint(ckpt, global_step=1, extra={"k": 1})
    out["export"] = _export_check(engine, actor, batches[1], os.path.join(result_dir, "hf"), rank)
    out["straight"] = [actor.update_policy(b)["actor/pg_loss"][0] for b in batches[1:]]
    ps.destroy_model_parallel()
    engine, actor = _actor(model_dir, tp=1)
    assert engine.dp_size == 2
    state = engine.load_checkpoint(ckpt)
    out["extra"] = state["extra"]
    out["resumed"] = [actor.update_policy(_mine(b, engine, rank))["actor/pg_loss"][0] for b in batches[1:]]
    ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


def _export_check(engine, actor, data, hf_dir, rank) -> float:
    from transformers import AutoModelForCausalLM

    from hybridrl.algos.utils import logprobs_from_logits
    from hybridrl.engine.megatron.checkpoint import export_hf_folder

    export_hf_folder(engine, hf_dir)
    lp = actor.compute_log_prob(data, micro_batch_size=4).log_probs
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    b = data.batch
    t = b["responses"].shape[1]
    with torch.no_grad():
        logits = hf(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    ref = logprobs_from_logits(logits[:, -t - 1 : -1], b["responses"])
    return float((lp - ref)[b["response_mask"].bool()].abs().max())


def test_save_tp2_resume_tp1(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_run, 2, tmp_path, model_dir, str(tmp_path / "ckpt"), str(tmp_path))
    assert os.path.isdir(tmp_path / "ckpt") and not os.path.exists(str(tmp_path / "ckpt") + ".tmp")
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        print(rank, out)
        assert out["extra"] == {"k": 1}
        for a, b in zip(out["straight"], out["resumed"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (out["straight"], out["resumed"])
        assert out["export"] <= 1e-5
    assert ROWS == 8
    _check_merger(tmp_path, model_dir)


def _check_merger(tmp_path, model_dir):
    """model_merger --backend megatron writes the weights the engine exported at the save."""
    from transformers import AutoModelForCausalLM

    from hybridrl.model_merger import main

    merged_dir = str(tmp_path / "merged")
    args = [
        "merge",
        "--backend",
        "megatron",
        "--local_dir",
        str(tmp_path / "ckpt"),
        "--target_dir",
        merged_dir,
    ]
    assert main([*args, "--hf_model_path", model_dir]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    a, b = merged.state_dict(), exported.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(3, 60, (2, 9))
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, exported(input_ids=ids).logits)


def _run_vpp(rank, world, model_dir, ckpt, result_dir):
    from megatron.core import parallel_state as ps

    out = {}
    engine, actor = _actor(model_dir, tp=1, pp=2, vpp=2)
    assert len(engine.chunks) == 2
    batches = [_batch(seed=s) for s in (11, 12, 13)]
    actor.update_policy(batches[0])
    engine.save_checkpoint(ckpt, global_step=1)
    out["straight"] = [actor.update_policy(b)["actor/pg_loss"][0] for b in batches[1:]]
    ps.destroy_model_parallel()
    engine, actor = _actor(model_dir, tp=1)
    engine.load_checkpoint(ckpt)
    out["resumed"] = [actor.update_policy(_mine(b, engine, rank))["actor/pg_loss"][0] for b in batches[1:]]
    ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"vpp_rank{rank}.pt"))


def test_save_pp2_vpp2_resume_dp2(tmp_path):
    """A checkpoint of the interleaved layout (two chunks per rank) resumes without virtual stages."""
    model_dir = _four_layer_model(str(tmp_path / "model"))
    spawn(_run_vpp, 2, tmp_path, model_dir, str(tmp_path / "ckpt"), str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"vpp_rank{rank}.pt")
        print(rank, out)
        for a, b in zip(out["straight"], out["resumed"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (out["straight"], out["resumed"])
