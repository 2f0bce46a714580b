"""PPO actor and critic on real FSDP2 over 2 CPU processes (gloo), checked against 1 rank.

One spawn runs every check: log-probs on 1 rank == on 2 ranks (fixed and dynamic micro-batches);
the accumulated gradient is the same for every micro-batching and equals the un-split mini-batch
on one rank (for several loss aggregations); update_policy lowers the PPO loss on a fixed batch;
the critic's update lowers the value loss.
"""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

ROWS = 8  # global batch; 4 rows per rank


def _configs(**actor_kwargs):
    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    kwargs = dict(
        ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=2e-3, clip_grad=0.0)
    )
    kwargs.update(actor_kwargs)
    return ModelConfig(), fsdp, ActorConfig(fsdp_config=fsdp, **kwargs)


def _gather_rows(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def _grads(module):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in module.named_parameters()
    }


def _train_batch(full_lp):
    from hybridrl.protocol import DataProto

    g = torch.Generator().manual_seed(7)
    batch = make_batch(ROWS, seed=5)
    # old / ref log-probs away from the current policy, so clipping and the KL term both act
    batch["old_log_probs"] = full_lp + 0.3 * torch.randn(full_lp.shape, generator=g)
    batch["ref_log_prob"] = full_lp + 0.2 * torch.randn(full_lp.shape, generator=g)
    batch["advantages"] = torch.randn(ROWS, 5, generator=g)
    return DataProto.from_dict(batch)


def _actor_checks(rank, model_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hybridrl.engine.fsdp import FSDPEngine, create_device_mesh
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model_cfg, fsdp, cfg = _configs(use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.01)
    model_cfg = dataclasses.replace(model_cfg, path=model_dir)
    one_rank = dist.new_group([0])
    engine2 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, load_tok=False)
    sizes2 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2)
    engine1 = actor1 = None
    if rank == 0:
        mesh1 = DeviceMesh.from_group(one_rank, "cpu", mesh_dim_names=("fsdp",))
        engine1 = FSDPEngine.build(model_cfg, fsdp, cfg.optim, mesh=mesh1, load_tok=False)
        sizes1 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1)
        actor1 = PPOActor(cfg, engine1.module, engine1.optimizer, dp_size=1, batch_sizes=sizes1)

    # --- log-probs: 2 ranks (fixed and dynamic micro-batches) == 1 rank on the whole batch ---------
    full = DataProto.from_dict(make_batch(ROWS, seed=5))
    local = full.chunk(2)[rank]
    actor2 = PPOActor(
        cfg,
        engine2.module,
        engine2.optimizer,
        engine2.lr_scheduler,
        dp_size=2,
        batch_sizes=sizes2,
        peak_flops=1e11,
    )
    _res = actor2.compute_log_prob(local, calculate_entropy=True, micro_batch_size=3)
    lp_fixed, ent_fixed = _res.log_probs, _res.entropy
    lp_dyn = actor2.compute_log_prob(local, use_dynamic_bsz=True, max_token_len=16).log_probs
    lp2, ent2 = _gather_rows(lp_fixed), _gather_rows(ent_fixed)
    mask = full.batch["response_mask"].bool()
    local_mask = local.batch["response_mask"].bool()
    torch.testing.assert_close(lp_dyn[local_mask], lp_fixed[local_mask], atol=1e-6, rtol=0)
    lp1 = torch.empty_like(lp2)
    if rank == 0:
        _res = actor1.compute_log_prob(full, calculate_entropy=True, micro_batch_size=ROWS)
        lp1, ent1 = _res.log_probs, _res.entropy
        torch.testing.assert_close(lp2[mask], lp1[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent2[mask], ent1[mask], atol=1e-5, rtol=0)
    dist.broadcast(lp1, src=0)

    # --- gradients: every micro-batching on 2 ranks == the un-split mini-batch on 1 rank ----------
    data = _train_batch(lp1)
    local = data.chunk(2)[rank]
    variants = {  # name -> (engine, per-rank sizes, remove padding)
        "micro=1": (engine2, dataclasses.replace(sizes2, micro_batch_size=1), False),
        "micro=2": (engine2, dataclasses.replace(sizes2, micro_batch_size=2), False),
        "micro=4": (engine2, dataclasses.replace(sizes2, micro_batch_size=4), False),
        "dynamic": (engine2, dataclasses.replace(sizes2, use_dynamic_bsz=True, max_token_len=16), False),
        "dynamic+packed": (
            engine2,
            dataclasses.replace(sizes2, use_dynamic_bsz=True, max_token_len=20),
            True,
        ),
    }
    hsdp = FSDPEngine.build(
        model_cfg, fsdp, cfg.optim, mesh=create_device_mesh(2, fsdp_size=1), load_tok=False
    )
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        mode_cfg = dataclasses.replace(cfg, loss_agg_mode=mode)
        reference = ref_metrics = None
        if rank == 0:
            actor1.config = mode_cfg
            engine1.optimizer.zero_grad(set_to_none=True)
            ref_metrics = actor1.forward_backward(data)
            reference = _grads(engine1.module)
            engine1.optimizer.zero_grad(set_to_none=True)
        if mode == "token-mean":  # hybrid sharding (replicate 2 x shard 1) averages over both ranks too
            variants["hsdp"] = (hsdp, sizes2, False)
        for name, (engine, sizes, packed) in variants.items():
            actor = PPOActor(
                mode_cfg,
                engine.module,
                engine.optimizer,
                dp_size=2,
                batch_sizes=sizes,
                use_remove_padding=packed,
            )
            metrics = actor.forward_backward(local)
            grads = _grads(engine.module)
            engine.optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                for pname, g in grads.items():
                    torch.testing.assert_close(
                        g,
                        reference[pname],
                        rtol=1e-4,
                        atol=1e-6,
                        msg=lambda m, p=pname, n=name, md=mode: f"{md} {n} {p}: {m}",
                    )
                for key in (
                    "actor/pg_loss",
                    "actor/kl_loss",
                    "actor/pg_clipfrac",
                    "actor/ppo_kl",
                    "actor/entropy",
                ):
                    assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), (
                        mode,
                        name,
                        key,
                    )
        variants.pop("hsdp", None)
        if rank == 0:
            assert 0 < ref_metrics["actor/pg_clipfrac"] < 1  # the check covers clipped and unclipped tokens
    del hsdp

    _on_policy_checks(rank, cfg, engine2, sizes2, data)
    _trimmed_padding_checks(rank, cfg, engine2, sizes2, data)

    # --- update_policy lowers the PPO loss on a fixed batch (epochs, shuffle, several mini-batches) --
    upd_cfg = dataclasses.replace(
        cfg,
        use_kl_loss=False,
        entropy_coeff=0.0,
        ppo_mini_batch_size=4,
        ppo_epochs=2,
        shuffle=True,
        data_loader_seed=3,
    )
    upd_sizes = normalize_actor_batch_sizes(upd_cfg, rollout_n=1, dp_size=2)
    assert upd_sizes.mini_batch_size == 2
    data.batch["old_log_probs"] = lp1.clone()  # on-policy start: ratio 1
    local = data.chunk(2)[rank]
    actor = PPOActor(
        upd_cfg,
        engine2.module,
        engine2.optimizer,
        engine2.lr_scheduler,
        dp_size=2,
        batch_sizes=upd_sizes,
        peak_flops=1e11,
    )
    history = []
    for step in range(3):
        local.meta_info["global_steps"] = step
        history.append(actor.update_policy(local))
        assert (
            len(history[-1]["actor/pg_loss"]) == 4 and len(history[-1]["actor/lr"]) == 1
        )  # 2 epochs x 2 minis
    first = history[0]
    assert first["actor/pg_clipfrac"][0] == 0.0 and first["actor/grad_norm"][0] > 0  # on-policy start
    assert 0 < first["perf/mfu/actor"][0] < 1
    losses = [sum(m["actor/pg_loss"][:2]) / 2 for m in history]  # first epoch covers the whole batch
    assert losses[-1] < losses[0] - 0.05, losses


def _on_policy_checks(rank, cfg, engine, sizes, data):
    """Exactly on-policy (one epoch, one mini-batch): an update without old_log_probs, which takes
    the detached log-probs of its own forward, gives the gradient and metrics of an update with
    recomputed ones; an update that is not on-policy refuses a batch without them."""
    from hybridrl.workers.actor import PPOActor

    for entropy_coeff in (0.01, 0.0):
        op_cfg = dataclasses.replace(cfg, entropy_coeff=entropy_coeff)
        actor = PPOActor(op_cfg, engine.module, engine.optimizer, dp_size=2, batch_sizes=sizes)
        local = data.chunk(2)[rank]
        assert actor.is_on_policy(len(local))
        current = actor.compute_log_prob(local, micro_batch_size=4).log_probs
        with_old = local.select(deepcopy=True)
        with_old.batch["old_log_probs"] = current
        without = local.select(deepcopy=True)
        without.pop(batch_keys=["old_log_probs"])
        m_with = actor.forward_backward(with_old)
        g_with = _grads(engine.module)
        engine.optimizer.zero_grad(set_to_none=True)
        m_without = actor.forward_backward(without)
        g_without = _grads(engine.module)
        engine.optimizer.zero_grad(set_to_none=True)
        for pname, g in g_with.items():
            torch.testing.assert_close(
                g_without[pname], g, rtol=1e-5, atol=1e-7, msg=lambda m, p=pname: f"{p}: {m}"
            )
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert m_without[key] == pytest.approx(m_with[key], rel=1e-5, abs=1e-7), key
        assert m_without["actor/pg_clipfrac"] == 0.0
        # the entropy metric the skipped old-log-prob pass would have given comes from the update
        assert m_without["actor/entropy"] > 0
        assert ("actor/entropy" in m_with) == (entropy_coeff != 0)
    two_epochs = dataclasses.replace(sizes, epochs=2)
    actor = PPOActor(cfg, engine.module, engine.optimizer, dp_size=2, batch_sizes=two_epochs)
    assert not actor.is_on_policy(len(without))
    with pytest.raises(KeyError, match="not exactly on-policy"):
        actor.update_policy(without)


def _trimmed_padding_checks(rank, cfg, engine, sizes, data):
    """The trainer cuts all-padding response columns (trim_right_padding); the update on the cut
    batch has the gradient of the update on the padded one, for every loss aggregation, because
    the generation budget travels in meta_info (seq-mean-token-sum-norm divides by it)."""
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.ppo.padding import trim_right_padding
    from hybridrl.workers.actor import PPOActor

    extra = 3  # widen the responses by 3 all-padding columns, as a rollout padded to its limit
    tensors = {}
    for key, value in data.batch.items():
        pad = torch.zeros(value.shape[0], extra, dtype=value.dtype)
        tensors[key] = torch.cat([value, pad], 1) if value.dim() == 2 else value
    padded = DataProto.from_dict(tensors)
    cut = trim_right_padding(padded.select(deepcopy=True))
    assert cut.batch["responses"].shape[1] == data.batch["responses"].shape[1]
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        actor = PPOActor(
            dataclasses.replace(cfg, loss_agg_mode=mode),
            engine.module,
            engine.optimizer,
            dp_size=2,
            batch_sizes=sizes,
        )
        grads = []
        for batch in (padded, cut):
            actor.forward_backward(batch.chunk(2)[rank])
            grads.append(_grads(engine.module))
            engine.optimizer.zero_grad(set_to_none=True)
        for pname, g in grads[0].items():
            torch.testing.assert_close(
                grads[1][pname], g, rtol=1e-5, atol=1e-7, msg=lambda m, p=pname, md=mode: f"{md} {p}: {m}"
            )


def _critic_checks(rank, model_dir):
    from hybridrl.config.roles import CriticConfig, CriticModelConfig, OptimConfig
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.protocol import DataProto
    from hybridrl.workers.batch_sizes import normalize_critic_batch_sizes
    from hybridrl.workers.critic import PPOCritic

    _, fsdp, _ = _configs()
    cfg = CriticConfig(
        model=CriticModelConfig(path=model_dir, fsdp_config=fsdp),
        ppo_mini_batch_size=ROWS,
        ppo_micro_batch_size_per_gpu=2,
        optim=OptimConfig(lr=1e-3),
        cliprange_value=0.5,
    )
    engine = FSDPEngine.build(cfg.model, fsdp, cfg.optim, role="critic", key="critic.model", load_tok=False)
    sizes = normalize_critic_batch_sizes(cfg, dp_size=2)
    critic = PPOCritic(
        cfg, engine.module, engine.optimizer, engine.lr_scheduler, dp_size=2, batch_sizes=sizes
    )
    packed = PPOCritic(cfg, engine.module, dp_size=2, use_remove_padding=True)
    batch = make_batch(ROWS, seed=9)
    data = DataProto.from_dict(batch).chunk(2)[rank]
    values = critic.compute_values(data)
    mask = data.batch["response_mask"]
    assert values.shape == mask.shape and bool((values[mask == 0] == 0).all())
    torch.testing.assert_close(packed.compute_values(data, micro_batch_size=3), values, atol=1e-5, rtol=0)
    data.batch["values"] = values
    data.batch["returns"] = torch.linspace(0.5, 1.5, 5).expand(4, 5) * mask
    losses = []
    for _ in range(5):
        metrics = critic.update_critic(data)
        losses.append(metrics["critic/vf_loss"][0])
        data.batch["values"] = critic.compute_values(data)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in metrics
    assert losses[-1] < 0.5 * losses[0], losses


def _checks(rank, world, model_dir):
    _actor_checks(rank, model_dir)
    _critic_checks(rank, model_dir)


def test_actor_and_critic_two_ranks(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_checks, 2, tmp_path, model_dir)
