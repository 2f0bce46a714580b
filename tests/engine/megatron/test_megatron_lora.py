"""Megatron LoRA (veRL's model.lora.*) vs the FSDP engine's PEFT LoRA, on real megatron-core over 2 gloo ranks.

Both engines adapt o_proj / down_proj (Megatron's linear_proj / linear_fc2, one linear each, so the two
parametrisations are the same) with rank 4; Megatron's factors are set to PEFT's (A drawn by PEFT, B
random, the same in both). One PPO update on the same rows: log-probs, pg_loss, grad norm (over the factors only) and
the merged weights after the update agree to 1e-5, at TP=2 (A sharded along the input) and at TP=1
(DP=2), so TP=2 equals TP=1. The base model (`disable_adapter`, the reference of a LoRA actor) gives
the FSDP base model's log-probs after the update, and the base weights stay frozen.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_testkit import make_tiny_model_dir, spawn  # noqa: E402
from test_megatron_engine import _batch, _configs, _rel  # noqa: E402

TOL = 1e-5
HF_TO_MEGATRON = {"self_attn.o_proj": "self_attention.linear_proj", "mlp.down_proj": "mlp.linear_fc2"}


def _peft_factors(fsdp) -> dict[str, torch.Tensor]:
    """{'<layer>.<hf linear>.lora_A' / '.lora_B': full tensor} of the FSDP engine's PEFT model."""
    out = {}
    for name, p in fsdp.module.named_parameters():
        if ".lora_" in name:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            layer = name.split("layers.", 1)[1].split(".", 1)[0]
            linear = next(h for h in HF_TO_MEGATRON if f".{h}." in name)
            out[f"{layer}.{HF_TO_MEGATRON[linear]}.{'lora_A' if '.lora_A.' in name else 'lora_B'}"] = (
                full.detach()
            )
    return out


def _random_b(fsdp) -> None:
    """PEFT's B (zero at init) set to the same random values on every rank, so the first update moves A too."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(11)
    for name, p in sorted(fsdp.module.named_parameters()):
        if ".lora_B." in name:
            full = 0.05 * torch.randn(p.shape, generator=gen)
            with torch.no_grad():
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())


def _set_megatron_factors(meg, seed: int) -> None:
    """Every factor from a generator seeded by its name, full-size then cut to this rank's shard."""
    from hybridrl.engine.megatron.model import global_param_name

    chunk = getattr(meg.chunks[0], "module", meg.chunks[0])
    for name, mod in chunk.named_modules():
        if not hasattr(mod, "lora_A"):
            continue
        tp, rank = mod.tp_group.size(), mod.tp_group.rank()
        gen = torch.Generator().manual_seed(seed + sum(map(ord, global_param_name(f"{name}.weight", chunk))))
        for attr, dim in (
            ("lora_A", None if mod.lora_column else 1),
            ("lora_B", 0 if mod.lora_column else None),
        ):
            local = getattr(mod, attr)
            shape = list(local.shape)
            if dim is not None:
                shape[dim] *= tp
            full = 0.05 * torch.randn(shape, generator=gen)
            if dim is not None and name.endswith("linear_fc1"):  # each TP rank holds [gate_r; up_r]
                part = torch.cat([half.chunk(tp, 0)[rank] for half in full.chunk(2, 0)])
            else:
                part = full if dim is None else full.chunk(tp, dim)[rank]
            with torch.no_grad():
                local.copy_(part)


def _set_factors(meg, factors: dict[str, torch.Tensor]) -> int:
    """Copy PEFT's full factors into Megatron's (row-parallel: A is cut along the input)."""
    chunk = getattr(meg.chunks[0], "module", meg.chunks[0])
    done = 0
    for name, mod in chunk.named_modules():
        if not hasattr(mod, "lora_A"):
            continue
        layer, rest = name.split("layers.", 1)[1].split(".", 1)
        a, b = factors[f"{layer}.{rest}.lora_A"], factors[f"{layer}.{rest}.lora_B"]
        tp, rank = mod.tp_group.size(), mod.tp_group.rank()
        n = a.shape[1] // tp
        with torch.no_grad():
            mod.lora_A.copy_(a[:, rank * n : (rank + 1) * n])
            mod.lora_B.copy_(b)
        done += 1
    return done


def _run(rank, world, model_dir, tp, result_dir):
    import torch.distributed as dist

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _, mcfg = _configs(model_dir, tp, 1)
    model = dataclasses.replace(model, lora_rank=4, lora_alpha=8, target_modules=["o_proj", "down_proj"])
    data = _batch()
    mine = data.chunk(world)[rank]
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    f_actor = PPOActor(cfg, fsdp.module, fsdp.optimizer, fsdp.lr_scheduler, dp_size=world,
                       batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=world))  # fmt: skip
    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    dp = meg.dp_size
    m_data = data if dp == 1 else mine
    _random_b(fsdp)
    out = {"adapted": _set_factors(meg, _peft_factors(fsdp))}
    chunk = getattr(meg.chunks[0], "module", meg.chunks[0])
    out["trained"] = sorted({n.rsplit(".", 1)[-1] for n, p in chunk.named_parameters() if p.requires_grad})
    base_before = {n: p.detach().clone() for n, p in chunk.named_parameters() if not p.requires_grad}
    m_actor = PPOActor(cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=dp))

    f_metrics = f_actor.update_policy(mine)
    m_metrics = m_actor.update_policy(m_data)
    out["pg_loss"] = (f_metrics["actor/pg_loss"][0], m_metrics["actor/pg_loss"][0])
    out["grad_norm"] = (f_metrics["actor/grad_norm"][0], m_metrics["actor/grad_norm"][0])
    f_lp = f_actor.compute_log_prob(mine, micro_batch_size=2).log_probs
    m_lp = m_actor.compute_log_prob(m_data, micro_batch_size=2).log_probs
    f_all = [torch.empty_like(f_lp) for _ in range(world)]
    dist.all_gather(f_all, f_lp)
    f_lp = torch.cat(f_all) if dp == 1 else f_lp
    mask = (data if dp == 1 else mine).batch["response_mask"].bool()
    out["lp_diff"] = float((f_lp - m_lp)[mask].abs().max())
    with fsdp.disable_adapter():
        f_base = f_actor.compute_log_prob(mine, micro_batch_size=2).log_probs
    with meg.disable_adapter():
        m_base = m_actor.compute_log_prob(m_data, micro_batch_size=2).log_probs
    f_all = [torch.empty_like(f_base) for _ in range(world)]
    dist.all_gather(f_all, f_base)
    f_base = torch.cat(f_all) if dp == 1 else f_base
    out["base_lp_diff"] = float((f_base - m_base)[mask].abs().max())
    out["adapter_moved_lp"] = float((m_lp - m_base)[mask].abs().max())
    out["base_frozen"] = all(
        torch.equal(p, base_before[n]) for n, p in chunk.named_parameters() if n in base_before
    )
    f_w = dict(fsdp.iter_full_params())
    m_w = dict(meg.iter_full_params())
    assert set(f_w) == set(m_w), sorted(set(f_w) ^ set(m_w))
    out["weight_rel"] = max(_rel(m_w[k], f_w[k]) for k in f_w)
    out.update(_all_linear(model, cfg, mcfg, data, mine))
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


def _all_linear(model, cfg, mcfg, data, mine) -> dict:
    """Megatron alone with every linear adapted (the fused linear_qkv / linear_fc1 too, column-parallel:
    B sharded, A replicated), random factors: one update's results, compared across TP sizes."""
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model = dataclasses.replace(model, target_modules="all-linear")
    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    _set_megatron_factors(meg, seed=3)
    actor = PPOActor(cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size))
    metrics = actor.update_policy(data if meg.dp_size == 1 else mine)
    return {
        "all_pg_loss": metrics["actor/pg_loss"][0],
        "all_grad_norm": metrics["actor/grad_norm"][0],
        "all_weights": dict(meg.iter_full_params()),
    }


def test_megatron_lora_matches_fsdp_peft_lora_at_tp2_and_tp1(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    runs = {}
    for tp in (2, 1):
        (tmp_path / f"tp{tp}").mkdir()
        spawn(_run, 2, tmp_path, model_dir, tp, str(tmp_path / f"tp{tp}"))
        runs[tp] = [torch.load(tmp_path / f"tp{tp}" / f"rank{r}.pt") for r in range(2)]
    two, one = runs[2][0], runs[1][0]  # every linear adapted: TP=2 == TP=1
    assert two["all_pg_loss"] == pytest.approx(one["all_pg_loss"], abs=TOL)
    assert two["all_grad_norm"] == pytest.approx(one["all_grad_norm"], rel=TOL)
    assert max(_rel(two["all_weights"][k], v) for k, v in one["all_weights"].items()) < TOL
    for out in runs[2] + runs[1]:
        print({k: v for k, v in out.items() if k != "all_weights"})
        assert out["adapted"] > 0
        assert out["trained"] == ["lora_A", "lora_B"]
        assert out["base_frozen"]
        assert out["pg_loss"][1] == pytest.approx(out["pg_loss"][0], abs=TOL)
        assert out["grad_norm"][1] == pytest.approx(out["grad_norm"][0], rel=TOL)
        assert out["lp_diff"] < TOL and out["base_lp_diff"] < TOL
        assert out["adapter_moved_lp"] > 1e-4  # the update changed the adapted model, not the base
        assert out["weight_rel"] < TOL


def _lora_actor(model_dir, tp):
    from hybridrl.config.roles import OptimConfig
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _, mcfg = _configs(model_dir, tp, 1)
    model = dataclasses.replace(model, lora_rank=4, lora_alpha=8)
    cfg = dataclasses.replace(
        cfg, optim=OptimConfig(lr=2e-3, lr_warmup_steps=3, clip_grad=1.0, weight_decay=0.01)
    )
    engine = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    return engine, PPOActor(
        cfg, engine, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=engine.dp_size)
    )


def _run_checkpoint(rank, world, model_dir, ckpt, result_dir):
    from megatron.core import parallel_state as ps
    from test_megatron_checkpoint import _export_check

    out = {}
    engine, actor = _lora_actor(model_dir, tp=2)
    _set_megatron_factors(engine, seed=5)
    batches = [_batch(seed=s) for s in (11, 12, 13)]
    actor.update_policy(batches[0])
    engine.save_checkpoint(ckpt, global_step=1)
    out["export"] = _export_check(engine, actor, batches[1], os.path.join(result_dir, "hf"), rank)
    out["straight"] = [actor.update_policy(b)["actor/pg_loss"][0] for b in batches[1:]]
    ps.destroy_model_parallel()
    engine, actor = _lora_actor(model_dir, tp=1)
    engine.load_checkpoint(ckpt)
    mine = [b if engine.dp_size == 1 else b.chunk(engine.dp_size)[rank] for b in batches[1:]]
    out["resumed"] = [actor.update_policy(b)["actor/pg_loss"][0] for b in mine]
    ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"ckpt_rank{rank}.pt"))


def test_megatron_lora_checkpoint_saved_at_tp2_resumes_at_tp1(tmp_path):
    from test_megatron_checkpoint import _check_merger

    """Factors and their Adam state in the distributed checkpoint (the sharded factor cut along the
    weight's TP dimension): the next two updates equal the uninterrupted run's; the HF export (merged
    weights) loads in transformers and gives the engine's log-probs, and `model_merger --backend megatron`
    on the checkpoint writes the same weights."""
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_run_checkpoint, 2, tmp_path, model_dir, str(tmp_path / "ckpt"), str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"ckpt_rank{rank}.pt")
        print(rank, out)
        for a, b in zip(out["straight"], out["resumed"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (out["straight"], out["resumed"])
        assert out["export"] <= 1e-5
    _check_merger(tmp_path, model_dir)  # model_merger merges the checkpoint's factors like the export


def _run_moe(rank, world, model_dir, result_dir):
    """Qwen3-MoE, every linear adapted (the routed experts' too), random factors: EP=1 and EP=2 (DP=2)."""
    from megatron.core import parallel_state as ps
    from moe_models import batch, configs

    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    mine = batch().chunk(world)[rank]
    out = {}
    for ep in (1, 2):
        model, cfg, mcfg = configs(model_dir, ep)
        model = dataclasses.replace(model, lora_rank=4, lora_alpha=8)
        meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
        _set_megatron_factors(meg, seed=7)
        actor = PPOActor(
            cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size)
        )
        chunk = meg.chunks[0].module
        m = actor.update_policy(mine)
        out[ep] = {
            "expert_factors": sum(
                ".experts." in n and n.endswith("lora_A") for n, _ in chunk.named_parameters()
            ),
            "pg_loss": m["actor/pg_loss"][0],
            "grad_norm": m["actor/grad_norm"][0],
            "weights": dict(meg.iter_full_params()),
        }
        del meg, actor
        ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"moe_rank{rank}.pt"))


def test_megatron_lora_on_moe_experts_ep2_equals_ep1(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe_models import make_moe_model_dir

    model_dir = make_moe_model_dir(str(tmp_path / "model"), "qwen3_moe")
    spawn(_run_moe, 2, tmp_path, model_dir, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"moe_rank{rank}.pt")
        one, two = out[1], out[2]
        print({ep: {k: v for k, v in r.items() if k != "weights"} for ep, r in out.items()})
        assert one["expert_factors"] == 2 * two["expert_factors"] > 0  # 4 experts / 2 per EP rank, x fc1 fc2
        assert two["pg_loss"] == pytest.approx(one["pg_loss"], abs=TOL)
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=TOL)
        assert max(_rel(two["weights"][k], v) for k, v in one["weights"].items()) < TOL
