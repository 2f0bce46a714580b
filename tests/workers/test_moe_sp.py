"""Mixture-of-experts actors under Ulysses sequence parallelism on real FSDP2 over 2 CPU processes
(gloo): SP=2 == SP=1. SP=1 on 2 ranks splits the rows (dp=2); SP=2 gives both ranks every row and
splits each packed sequence, so every router sees half of the tokens. The recorded routing (R2's
old-log-prob pass), the log-probs, the gradient with the router load-balancing loss and R2 replay,
the losses and the MoE metrics must agree (fp32)."""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, spawn  # noqa: E402
from moe_testkit import FAMILIES, make_tiny_moe_dir  # noqa: E402

ROWS = 8
TOL = dict(atol=1e-5, rtol=1e-5)


def _gather_rows(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def _grads(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in module.named_parameters() if p.grad is not None}  # fmt: skip


def _actors(model_dir):
    """(SP=1 actor over dp=2, SP=2 actor over dp=1): same weights, the router loss on, R2."""
    import torch.distributed as dist

    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
        RouterReplayConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.ulysses import SPGroup, parallelize_sp
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    model = ModelConfig(path=model_dir, use_remove_padding=True,
                        override_config={"output_router_logits": True, "router_aux_loss_coef": 0.05})  # fmt: skip
    cfg = ActorConfig(
        fsdp_config=fsdp, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2,
        optim=OptimConfig(lr=2e-3, clip_grad=0.0), router_replay=RouterReplayConfig(mode="R2"),
        ulysses_sequence_parallel_size=2,
    )  # fmt: skip
    e1 = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    e2 = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    cfg1 = dataclasses.replace(cfg, ulysses_sequence_parallel_size=1)
    s1 = normalize_actor_batch_sizes(cfg1, rollout_n=1, dp_size=2)
    a1 = PPOActor(cfg1, e1.module, e1.optimizer, e1.lr_scheduler, dp_size=2, batch_sizes=s1,
                  use_remove_padding=True)  # fmt: skip
    sp = SPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    parallelize_sp(e2.module, sp)
    s2 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2)
    a2 = PPOActor(cfg, e2.module, e2.optimizer, e2.lr_scheduler, dp_size=1, batch_sizes=s2,
                  use_remove_padding=True, sp=sp)  # fmt: skip
    return (e1, a1), (e2, a2)


def _checks(rank, world, model_dir):
    from hybridrl.protocol import DataProto

    (e1, a1), (e2, a2) = _actors(model_dir)
    full = DataProto.from_dict(make_batch(ROWS, prompt_len=7, response_len=6, seed=5))
    mask = full.batch["response_mask"].bool()

    # the old-log-prob pass (R2 records the routing): SP=2 (every row) == SP=1 (rows split)
    res1 = a1.compute_log_prob(full.chunk(2)[rank], micro_batch_size=2)
    lp1, routed1 = _gather_rows(res1.log_probs), _gather_rows(res1.routed_experts)
    res2 = a2.compute_log_prob(full, micro_batch_size=3)
    torch.testing.assert_close(res2.log_probs[mask], lp1[mask], **TOL)
    valid = full.batch["attention_mask"].bool()
    assert routed1.shape == res2.routed_experts.shape == (*valid.shape, 2, 2)
    assert (routed1[valid] >= 0).all() and (routed1[~valid] == -1).all()
    same = (res2.routed_experts == routed1).all(-1).all(-1)[valid].float().mean()
    assert same > 0.99, same  # the same tokens through the same routers; only exact ties may flip

    # the update's gradient with the router loss and R2 replay of the recorded routing
    g = torch.Generator().manual_seed(7)
    data = DataProto.from_dict(make_batch(ROWS, prompt_len=7, response_len=6, seed=5))
    data.batch["old_log_probs"] = lp1 + 0.3 * torch.randn(lp1.shape, generator=g)
    data.batch["advantages"] = torch.randn(lp1.shape, generator=g)
    data.batch["routed_experts"] = routed1
    m1 = a1.forward_backward(data.chunk(2)[rank])
    g1 = _grads(e1.module)
    m2 = a2.forward_backward(data)
    g2 = _grads(e2.module)
    assert g1.keys() == g2.keys() and any(n.endswith("mlp.gate.weight") for n in g1)
    for name, grad in g1.items():
        torch.testing.assert_close(g2[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for key in ("actor/pg_loss", "actor/moe/aux_loss", "actor/moe/load_max_over_mean", "actor/moe/tokens",
                "actor/moe/tokens_per_expert/0", "actor/moe/layer_1/load_max_over_mean"):  # fmt: skip
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    # every SP rank holds the same full result
    both = _gather_rows(res2.routed_experts[None])
    assert torch.equal(both[0], both[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_actor_sp2_equals_sp1(family, tmp_path):
    model_dir = make_tiny_moe_dir(str(tmp_path / "model"), family)
    spawn(_checks, 2, tmp_path, model_dir)
