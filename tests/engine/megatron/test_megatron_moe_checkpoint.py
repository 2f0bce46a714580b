"""MoE checkpoints across expert-parallel sizes and the weight sync from EP-sharded experts.

On 2 gloo ranks (DP=2): a Qwen3-MoE actor at EP=2 takes a step, saves a distributed checkpoint
and takes another step; a fresh actor at EP=1 loads the checkpoint and takes that same step: the
losses, gradient norm and weights equal the uninterrupted EP=2 run's. Then the EP=2 weights
(each rank holds 2 of the 4 experts) stream into a Hugging Face rollout engine: every rollout
tensor equals the HF export's. The model merger turns the EP=2 checkpoint into the HF folder of
the weights at the save.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import spawn  # noqa: E402
from moe_models import batch, configs, make_moe_model_dir  # noqa: E402

TOL = 1e-6


def _actor(model_dir: str, ep: int):
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, mcfg = configs(model_dir, ep)
    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size)
    return meg, PPOActor(cfg, meg, batch_sizes=sizes)


def _step(actor, engine, data) -> dict:
    m = actor.update_policy(data)
    return {
        "pg_loss": m["actor/pg_loss"][0],
        "grad_norm": m["actor/grad_norm"][0],
        "weights": {k: v.clone() for k, v in engine.iter_full_params()},
    }


def _rollout_weights(model_dir: str, engine) -> dict[str, torch.Tensor]:
    """A HF rollout engine (random dummy weights) after a sync from `engine`."""
    from hybridrl.rollout import RolloutConfig, create_rollout
    from hybridrl.weight_sync import sync_weights

    cfg = RolloutConfig(name="hf", dtype="float32", prompt_length=8, response_length=4, load_format="dummy")
    rollout = create_rollout(cfg, model_dir, None, device="cpu")
    sync_weights(rollout, engine.iter_params(dtype=torch.float32))
    return {k: v.detach().clone() for k, v in rollout.model.state_dict().items()}


def _run(rank, world, model_dir, ckpt, export, result_dir):
    from megatron.core import parallel_state as ps

    mine = [batch(seed).chunk(world)[rank] for seed in (5, 12)]
    meg, actor = _actor(model_dir, ep=2)
    actor.update_policy(mine[0])
    meg.save_checkpoint(ckpt, global_step=1)
    out = {"saved": {k: v.clone() for k, v in meg.iter_full_params()}}  # (views of live weights)
    out["straight"] = _step(actor, meg, mine[1])
    meg.export_hf(export)
    out["rollout"] = _rollout_weights(model_dir, meg)
    del meg, actor
    ps.destroy_model_parallel()
    again, actor = _actor(model_dir, ep=1)
    again.load_checkpoint(ckpt)
    out["resumed"] = _step(actor, again, mine[1])
    out["local_experts"] = again.chunks[0].module.decoder.layers[0].mlp.num_local_experts
    ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"ckpt_rank{rank}.pt"))


def test_moe_checkpoint_ep2_resumes_at_ep1_and_syncs_rollout(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_moe_model_dir(str(tmp_path / "model"), "qwen3_moe")
    export = str(tmp_path / "export")
    spawn(_run, 2, tmp_path, model_dir, str(tmp_path / "ckpt"), export, str(tmp_path))
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).state_dict()
    for rank in range(2):
        out = torch.load(tmp_path / f"ckpt_rank{rank}.pt")
        s, r = out["straight"], out["resumed"]
        assert out["local_experts"] == 4  # the resumed actor holds every expert (EP=1)
        print(rank, "pg", s["pg_loss"], r["pg_loss"], "gn", s["grad_norm"], r["grad_norm"])
        assert abs(s["pg_loss"] - r["pg_loss"]) <= TOL * max(1.0, abs(s["pg_loss"]))
        assert abs(s["grad_norm"] - r["grad_norm"]) <= TOL * max(1.0, abs(s["grad_norm"]))
        w_diff = max(float((r["weights"][k] - v).abs().max()) for k, v in s["weights"].items())
        print(rank, "weights after the resumed step", w_diff)
        assert w_diff < TOL
        rollout = out["rollout"]
        assert set(rollout) == set(exported)
        assert all(torch.equal(rollout[k], exported[k]) for k in exported)
        # the synced weights are the trained ones (not the model folder's)
        assert not torch.equal(rollout["model.layers.0.mlp.experts.gate_up_proj"], _initial(model_dir))
    # the model merger reads the EP=2 checkpoint into the HF layout: the weights at the save
    from hybridrl.engine.megatron.merge import merge_megatron_checkpoint

    merged_dir = merge_megatron_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "merged"), model_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    saved = torch.load(tmp_path / "ckpt_rank0.pt")["saved"]
    assert set(merged) == set(saved)
    assert all(torch.equal(merged[k], saved[k]) for k in saved)


def _initial(model_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
