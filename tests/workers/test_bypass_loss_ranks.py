"""The bypass-mode loss (REINFORCE, sequence IS weights normalised over the batch, KL-estimator
rejection) on 2 FSDP2 ranks equals the un-split batch on 1 rank: the IS-weight batch mean is taken
over the data-parallel ranks (real FSDP2, gloo)."""

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

ROWS = 8


def _grads(module):
    """Full gradients: DTensors on the 2-rank mesh, plain tensors on the one-rank reference (which
    `fsdp_config.shard_one_rank` auto keeps unsharded on one CPU rank)."""
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in grads.items()}


def _checks(rank, world, model_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
        PolicyLossConfig,
        PolicyLossRolloutCorrection,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    rc = PolicyLossRolloutCorrection(
        loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.8_1.25,0.5",
    )  # fmt: skip
    cfg = ActorConfig(
        ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=ROWS, optim=OptimConfig(lr=1e-3, clip_grad=0.0),
        fsdp_config=fsdp, policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc),
    )  # fmt: skip
    model_cfg = ModelConfig(path=model_dir)
    one_rank = dist.new_group([0])
    full = DataProto.from_dict(make_batch(ROWS, seed=5))
    g = torch.Generator().manual_seed(3)
    full.batch["advantages"] = torch.randn(ROWS, 5, generator=g)

    grads1 = None
    if rank == 0:
        mesh1 = DeviceMesh.from_group(one_rank, "cpu", mesh_dim_names=("fsdp",))
        engine1 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, mesh=mesh1, load_tok=False)
        actor1 = PPOActor(cfg, engine1.module, engine1.optimizer, dp_size=1,
                          batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1))  # fmt: skip
        lp = actor1.compute_log_prob(full, micro_batch_size=ROWS).log_probs
        # the "rollout" log-probs: the current ones moved, so weights and rejection both act
        full.batch["old_log_probs"] = lp + 0.2 * torch.randn(lp.shape, generator=g)
        engine1.module.zero_grad(set_to_none=True)
        m1 = actor1.forward_backward(full)
        grads1 = _grads(engine1.module)
        assert 0 < m1["actor/rollout_rs_masked_fraction"] < 1, m1
    olp = full.batch["old_log_probs"] if rank == 0 else torch.zeros(ROWS, 5)
    dist.broadcast(olp, src=0)
    full.batch["old_log_probs"] = olp

    engine2 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, load_tok=False)
    cfg2 = dataclasses.replace(cfg, ppo_micro_batch_size_per_gpu=ROWS // 2)  # one micro-batch per rank
    sizes2 = normalize_actor_batch_sizes(cfg2, rollout_n=1, dp_size=2)
    actor2 = PPOActor(cfg2, engine2.module, engine2.optimizer, dp_size=2, batch_sizes=sizes2)
    engine2.module.zero_grad(set_to_none=True)
    actor2.forward_backward(full.chunk(2)[rank])
    grads2 = _grads(engine2.module)
    if rank == 0:
        assert set(grads1) == set(grads2)
        for name in grads1:
            torch.testing.assert_close(grads2[name], grads1[name], atol=1e-6, rtol=1e-5, msg=name)


def test_bypass_loss_two_ranks_equals_one(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_checks, 2, tmp_path, model_dir)
