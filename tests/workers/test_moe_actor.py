"""Mixture-of-experts actors on real FSDP2 over 2 CPU processes (gloo), checked against 1 rank:
log-probs and the recorded routing, the gradient with the router load-balancing loss and R2 replay,
the MoE metrics; then a checkpoint round trip, the HF export and model_merger of the sharded model."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, spawn  # noqa: E402
from moe_testkit import FAMILIES, make_tiny_moe_dir  # noqa: E402

ROWS = 8


def _configs(model_dir, coef):
    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
        RouterReplayConfig,
    )

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    model = ModelConfig(
        path=model_dir, override_config={"output_router_logits": True, "router_aux_loss_coef": coef}
    )
    actor = ActorConfig(
        fsdp_config=fsdp, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2,
        optim=OptimConfig(lr=2e-3, clip_grad=0.0), router_replay=RouterReplayConfig(mode="R2"),
    )  # fmt: skip
    return model, fsdp, actor


def _gather_rows(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def _grads(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in module.named_parameters() if p.grad is not None}  # fmt: skip


def _checks(rank, world, model_dir, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model_cfg, fsdp, cfg = _configs(model_dir, coef=0.05)
    engine2 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, load_tok=False)
    actor2 = PPOActor(cfg, engine2, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2))
    engine1 = actor1 = None
    if rank == 0:
        mesh1 = DeviceMesh.from_group(dist.new_group([0]), "cpu", mesh_dim_names=("fsdp",))
        engine1 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, mesh=mesh1, load_tok=False)
        actor1 = PPOActor(cfg, engine1, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1))
    else:
        dist.new_group([0])

    # --- the old-log-prob pass (R2 records the routing): 2 ranks == 1 rank -----------------------
    full = DataProto.from_dict(make_batch(ROWS, seed=5))
    local = full.chunk(2)[rank]
    res2 = actor2.compute_log_prob(local, micro_batch_size=3)
    lp2, routed2 = _gather_rows(res2.log_probs), _gather_rows(res2.routed_experts)
    mask = full.batch["response_mask"].bool()
    lp1 = torch.empty_like(lp2)
    routed1 = torch.empty_like(routed2)
    if rank == 0:
        res1 = actor1.compute_log_prob(full, micro_batch_size=ROWS)
        lp1, routed1 = res1.log_probs, res1.routed_experts
        torch.testing.assert_close(lp2[mask], lp1[mask], atol=1e-5, rtol=0)
        same = (routed2 == routed1).all(-1).float().mean()
        assert same > 0.99, same
    dist.broadcast(lp1, src=0)
    dist.broadcast(routed1, src=0)

    # --- the update's gradient with the aux loss and R2 replay: 2 ranks x micro 2 == 1 rank ------
    g = torch.Generator().manual_seed(7)
    data = DataProto.from_dict(make_batch(ROWS, seed=5))
    data.batch["old_log_probs"] = lp1 + 0.3 * torch.randn(lp1.shape, generator=g)
    data.batch["advantages"] = torch.randn(ROWS, 5, generator=g)
    data.batch["routed_experts"] = routed1
    metrics2 = actor2.forward_backward(data.chunk(2)[rank])
    grads2 = _grads(engine2.module)
    if rank == 0:
        metrics1 = actor1.forward_backward(data)
        grads1 = _grads(engine1.module)
        for name, grad in grads1.items():
            torch.testing.assert_close(
                grads2[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
        for key in ("actor/pg_loss", "actor/moe/aux_loss", "actor/moe/load_max_over_mean"):
            assert metrics2[key] == pytest.approx(metrics1[key], rel=1e-5), key
        assert (
            "actor/moe/layer_1/load_max_over_mean" in metrics1 and "actor/moe/tokens_per_expert/3" in metrics1
        )
        # the aux loss is in the loss: without it the routers' gradient changes
        engine1.optimizer.zero_grad(set_to_none=True)
        engine1.module.config.output_router_logits = False
        actor1.forward_backward(data)
        router = next(n for n in grads1 if n.endswith("mlp.gate.weight"))
        assert not torch.allclose(_grads(engine1.module)[router], grads1[router])
        engine1.module.config.output_router_logits = True

    # --- a step, a checkpoint round trip, the HF export and model_merger ---------------------------
    engine2.optimizer_step(0.0)
    engine2.save_checkpoint(os.path.join(out_dir, "ckpt"), global_step=1)
    after = actor2.compute_log_prob(local, micro_batch_size=3).log_probs
    fresh = FSDPEngine.build(model_cfg, fsdp, cfg.optim, load_tok=False)
    fresh.load_checkpoint(os.path.join(out_dir, "ckpt"))
    reloaded = PPOActor(cfg, fresh).compute_log_prob(local, micro_batch_size=3).log_probs
    torch.testing.assert_close(reloaded, after, atol=0, rtol=0)
    engine2.export_hf(os.path.join(out_dir, "hf"))
    dist.barrier()
    if rank == 0:
        from transformers import AutoModelForCausalLM

        from hybridrl.engine.module_engine import ModuleEngine
        from hybridrl.trainer.offline.model_merger import merge_checkpoint

        merged = merge_checkpoint(
            os.path.join(out_dir, "ckpt"), os.path.join(out_dir, "merged"), hf_model_path=model_dir
        )
        for folder in (os.path.join(out_dir, "hf"), merged):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            got = PPOActor(cfg, ModuleEngine(model)).compute_log_prob(local).log_probs
            torch.testing.assert_close(got, after, atol=1e-5, rtol=0)
    dist.barrier()


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_actor_two_ranks_equal_one_rank(family, tmp_path):
    model_dir = make_tiny_moe_dir(str(tmp_path / "model"), family)
    spawn(_checks, 2, tmp_path, model_dir, str(tmp_path))
