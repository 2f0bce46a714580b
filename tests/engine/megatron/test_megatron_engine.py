"""Megatron engine vs the FSDP engine and vs Hugging Face, on real megatron-core over 2 gloo ranks.

One spawn per layout, each checked against FSDP on the same 2 ranks: log-probs and entropy, one
PPO update (same loss, KL loss, grad norm and updated weights), the critic's values and update.
Layouts: TP=2, PP=2 (1F1B) and PP=2 x VPP=2 (interleaved 1F1B, on a 4-layer model: one layer per
virtual stage). The VPP layout once updated wrongly while its forward matched: batched p2p at PP=2
crossed an activation and a gradient of the same shape; the update check is what caught it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

ROWS = 8
TOL = 1e-5


def _batch(seed: int = 5):
    from hybridrl.protocol import DataProto

    g = torch.Generator().manual_seed(7)
    b = make_batch(ROWS, seed=seed)
    t = b["responses"].shape[1]
    b["old_log_probs"] = -3.0 + 0.3 * torch.randn(ROWS, t, generator=g)
    b["ref_log_prob"] = -3.0 + 0.2 * torch.randn(ROWS, t, generator=g)
    b["advantages"] = torch.randn(ROWS, t, generator=g)
    b["values"] = 0.1 * torch.randn(ROWS, t, generator=g)
    b["returns"] = torch.randn(ROWS, t, generator=g)
    return DataProto.from_dict(b)


def _configs(
    model_dir: str,
    tp: int,
    pp: int,
    vpp: int | None = None,
    packed: bool = False,
    sp: bool = False,
    cp: int = 1,
):
    from hybridrl.config.megatron import MegatronConfig
    from hybridrl.config.roles import (
        ActorConfig,
        CriticConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    # eps 1e-3: Adam's first step is ~lr * sign(g); with eps 1e-8 the float round-off of gradients that
    # are 0 in exact arithmetic (e.g. the key bias's) would be amplified to ~lr-sized moves in both engines.
    # weight_decay 0: Megatron exempts biases and norms from weight decay, the FSDP engine does not.
    optim = OptimConfig(lr=2e-3, clip_grad=0.5, weight_decay=0.0, eps=1e-3)
    actor = ActorConfig(
        ppo_mini_batch_size=ROWS,
        ppo_micro_batch_size_per_gpu=2,
        optim=optim,
        fsdp_config=fsdp,
        use_kl_loss=True,
        kl_loss_coef=0.5,
        entropy_coeff=0.01,
    )
    model = ModelConfig(path=model_dir, use_remove_padding=packed)
    critic = CriticConfig(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, optim=optim)
    critic = dataclasses.replace(
        critic,
        model=dataclasses.replace(critic.model, path=model_dir, fsdp_config=fsdp, use_remove_padding=packed),
    )
    mcfg = MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp,
        context_parallel_size=cp,
        dtype="float32",
    )
    return model, actor, critic, mcfg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _check_actor(rank, model_dir, tp, pp, out, vpp=None, packed=False, sp=False, cp=1):
    import torch.distributed as dist

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _, mcfg = _configs(model_dir, tp, pp, vpp, packed, sp, cp)
    data = _batch()
    world = dist.get_world_size()  # FSDP: every rank data-parallel; Megatron: one replica (DP=1)
    mine, n = data.chunk(world)[rank], ROWS // world
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    f_actor = PPOActor(
        cfg,
        fsdp.module,
        fsdp.optimizer,
        fsdp.lr_scheduler,
        dp_size=world,
        batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=world),
    )
    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    assert meg.dp_size == 1
    out["cp_attention"] = {
        type(c.module.decoder.layers[0].self_attention.core_attention).__name__ for c in meg.chunks
    }
    m_actor = PPOActor(cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1))

    _res = f_actor.compute_log_prob(mine, calculate_entropy=True, micro_batch_size=2)
    f_lp, f_ent = _res.log_probs, _res.entropy
    f_lp_all = [torch.empty_like(f_lp) for _ in range(world)]
    dist.all_gather(f_lp_all, f_lp)
    _res = m_actor.compute_log_prob(data, calculate_entropy=True, micro_batch_size=3 if vpp is None else 2)
    m_lp, m_ent = _res.log_probs, _res.entropy
    mask = data.batch["response_mask"].bool()
    out["lp_diff"] = float((torch.cat(f_lp_all) - m_lp)[mask].abs().max())
    out["ent_diff"] = float(
        (f_ent - m_ent[rank * n : rank * n + n])[mask[rank * n : rank * n + n]].abs().max()
    )

    f_metrics = f_actor.update_policy(mine)
    m_metrics = m_actor.update_policy(data)
    out["pg_loss"] = (f_metrics["actor/pg_loss"][0], m_metrics["actor/pg_loss"][0])
    out["kl_loss"] = (f_metrics["actor/kl_loss"][0], m_metrics["actor/kl_loss"][0])
    out["grad_norm"] = (f_metrics["actor/grad_norm"][0], m_metrics["actor/grad_norm"][0])
    f_w = dict(fsdp.iter_full_params())
    m_w = dict(meg.iter_full_params())
    assert set(f_w) == set(m_w), sorted(set(f_w) ^ set(m_w))
    out["weight_rel"] = max(_rel(m_w[k], f_w[k]) for k in f_w)
    init = _initial(model_dir)
    out["update_rel"] = max(_rel(m_w[k] - init[k], f_w[k] - init[k]) for k in f_w)
    out["weight_moved"] = max(float((m_w[k] - v).abs().max()) for k, v in init.items() if k in m_w)


def _initial(model_dir):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


def _check_critic(rank, model_dir, tp, pp, out, vpp=None, packed=False, sp=False, cp=1):
    import torch.distributed as dist

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.batch_sizes import normalize_critic_batch_sizes
    from hybridrl.workers.critic import PPOCritic

    _, _, cfg, mcfg = _configs(model_dir, tp, pp, vpp, packed, sp, cp)
    data = _batch()
    world = dist.get_world_size()
    mine, n = data.chunk(world)[rank], ROWS // world
    # The fresh value head: Megatron's is initialised under megatron.seed (whatever the global RNG, here
    # moved on by the FSDP build); give FSDP's the same draw.
    torch.manual_seed(mcfg.seed)
    fsdp = FSDPEngine.build(
        cfg.model, cfg.model.fsdp_config, cfg.optim, role="critic", key="critic.model", load_tok=False
    )
    meg = MegatronEngine.build(
        cfg.model,
        mcfg,
        cfg.optim,
        role="critic",
        key="critic.megatron",
        model_key="critic.model",
        max_grad_norm=cfg.max_grad_norm,
        load_tok=False,
    )
    f = PPOCritic(
        cfg,
        fsdp.module,
        fsdp.optimizer,
        fsdp.lr_scheduler,
        dp_size=world,
        batch_sizes=normalize_critic_batch_sizes(cfg, dp_size=world),
    )
    m = PPOCritic(cfg, meg, batch_sizes=normalize_critic_batch_sizes(cfg, dp_size=1))
    head = dict(meg.iter_full_params())["score.weight"]
    torch.manual_seed(1234)  # another global RNG state (a Ray worker's starts at random): the same head
    again = MegatronEngine.build(
        cfg.model, mcfg, None, role="critic", key="critic.megatron", model_key="critic.model", load_tok=False
    )
    out["head_seeded"] = torch.equal(dict(again.iter_full_params())["score.weight"], head)
    del again
    fv = f.compute_values(mine)
    mv = m.compute_values(data)[rank * n : rank * n + n]
    out["value_diff"] = float((fv - mv).abs().max())
    fm = f.update_critic(mine)
    mm = m.update_critic(data)
    out["vf_loss"] = (fm["critic/vf_loss"][0], mm["critic/vf_loss"][0])
    f_w = dict(fsdp.iter_full_params())
    m_w = dict(meg.iter_full_params())
    assert set(f_w) == set(m_w), sorted(set(f_w) ^ set(m_w))
    out["critic_weight_rel"] = max(_rel(m_w[k], f_w[k]) for k in f_w)


def _run(rank, world, model_dir, tp, pp, vpp, packed, sp, cp, result_dir):
    out: dict = {}
    _check_actor(rank, model_dir, tp, pp, out, vpp, packed, sp, cp)
    _check_critic(rank, model_dir, tp, pp, out, vpp, packed, sp, cp)
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


def _four_layer_model(path: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tiny_model_dir(path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.num_hidden_layers = 4
    cfg.layer_types = ["full_attention"] * 4
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "tp,pp,vpp,packed,sp,cp",
    [
        (2, 1, None, False, False, 1),
        (1, 2, None, False, False, 1),
        (1, 2, 2, False, False, 1),
        (2, 1, None, True, False, 1),
        (1, 2, 2, True, False, 1),
        (2, 1, None, False, True, 1),
        (2, 1, None, True, True, 1),
        (1, 1, None, False, False, 2),
        (1, 1, None, True, False, 2),
    ],
)
def test_megatron_matches_fsdp(tmp_path, tp, pp, vpp, packed, sp, cp):
    """packed: model.use_remove_padding=True on both engines (Megatron packs each micro-batch into
    one row with a block-diagonal causal mask; FSDP into varlen sequences). sp: Megatron's
    sequence parallelism at TP=2 (the batch's 11 tokens per row: the padded path pads to 12).
    cp: Megatron's context parallelism on the 2 ranks (one replica, DP=1, each rank two of the
    four load-balanced chunks of every row: the padded path pads the 11 tokens to 12)."""
    path = str(tmp_path / "model")
    model_dir = make_tiny_model_dir(path) if vpp is None else _four_layer_model(path)
    spawn(_run, 2, tmp_path, model_dir, tp, pp, vpp, packed, sp, cp, str(tmp_path))
    _assert_matches(tmp_path, 2, cp)


def _assert_matches(tmp_path, world: int, cp: int) -> None:
    """Every rank's Megatron results equal FSDP's (on the same `world` ranks) to TOL."""
    for rank in range(world):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        print(rank, out)
        assert out["lp_diff"] < TOL and out["ent_diff"] < TOL
        for name in ("pg_loss", "kl_loss", "grad_norm", "vf_loss"):
            f, m = out[name]
            assert abs(f - m) <= TOL * max(1.0, abs(f)), (name, f, m)
        assert out["weight_moved"] > 1e-4  # the update did change the weights
        assert out["weight_rel"] < TOL, out["weight_rel"]
        assert out["critic_weight_rel"] < TOL
        assert out["value_diff"] < TOL
        assert out["head_seeded"]
        assert out["cp_attention"] == {"ContextParallelAttention" if cp > 1 else "DotProductAttention"}


def _run_bf16(rank, world, model_dir, result_dir):
    """megatron.dtype=bfloat16 (TP=2) vs FSDP with param_dtype bf16 on 2 ranks: same batch, one update."""
    from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _, mcfg = _configs(model_dir, 2, 1)
    mcfg = dataclasses.replace(mcfg, dtype="bfloat16")
    cfg = dataclasses.replace(
        cfg, fsdp_config=FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    )
    data = _batch()
    mine, rows = data.chunk(2)[rank], slice(rank * 4, rank * 4 + 4)
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2)
    f_actor = PPOActor(cfg, fsdp.module, fsdp.optimizer, fsdp.lr_scheduler, dp_size=2, batch_sizes=sizes)
    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    m_actor = PPOActor(cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1))
    out = {
        "model_dtypes": {str(p.dtype) for c in meg.chunks for p in c.parameters()},
        "main_dtypes": {str(p.dtype) for g in meg.optimizer.param_groups for p in g["params"]},
    }
    f_lp = f_actor.compute_log_prob(mine, micro_batch_size=2).log_probs
    m_lp = m_actor.compute_log_prob(data, micro_batch_size=2).log_probs
    mask = data.batch["response_mask"].bool()[rows]
    out["lp_diff"] = float((f_lp - m_lp[rows])[mask].abs().max())
    fm, mm = f_actor.update_policy(mine), m_actor.update_policy(data)
    for name in ("pg_loss", "grad_norm"):
        out[name] = (fm[f"actor/{name}"][0], mm[f"actor/{name}"][0])
    f_w, m_w = dict(fsdp.iter_full_params()), dict(meg.iter_full_params())
    # bf16 storage rounds each weight to ~0.4%; tiny biases (max |b| ~1e-4) are left out of the relative check
    out["weight_rel"] = max(_rel(m_w[k].float(), f_w[k].float()) for k in f_w if f_w[k].abs().max() > 1e-2)
    init = _initial(model_dir)
    out["weight_moved"] = max(float((m_w[k].float() - v).abs().max()) for k, v in init.items() if k in m_w)
    out["straight"], out["resumed"] = _bf16_resume(
        meg, m_actor, model, cfg, mcfg, os.path.join(result_dir, "ckpt")
    )
    torch.save(out, os.path.join(result_dir, f"bf16_rank{rank}.pt"))


def _bf16_resume(meg, m_actor, model, cfg, mcfg, ckpt) -> tuple[float, float]:
    """Save, step on; rebuild, load, step: the fp32 main params and Adam state come back exactly."""
    from megatron.core import parallel_state as ps

    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    meg.save_checkpoint(ckpt, global_step=1)
    straight = m_actor.update_policy(_batch(seed=12))["actor/pg_loss"][0]
    ps.destroy_model_parallel()
    again = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    again.load_checkpoint(ckpt)
    actor = PPOActor(cfg, again, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=1))
    resumed = actor.update_policy(_batch(seed=12))["actor/pg_loss"][0]
    ps.destroy_model_parallel()
    return straight, resumed


def test_megatron_bf16_close_to_fsdp_bf16(tmp_path):
    """bf16 parameters with fp32 main params / grads: loose tolerances (bf16 has 8 mantissa bits).

    Measured (2 ranks, tiny model): log-probs 3.9e-3 apart (|log-prob| ~4.3), pg_loss rel 2e-4,
    grad norm rel 1.7e-3, weights after one update rel 5.7e-3 (one bf16 rounding). Then a checkpoint
    round trip at the same layout: the next update's loss is bit-identical.
    """
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_run_bf16, 2, tmp_path, model_dir, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"bf16_rank{rank}.pt")
        print(rank, out)
        assert out["model_dtypes"] == {"torch.bfloat16"} and out["main_dtypes"] == {"torch.float32"}
        assert out["lp_diff"] < 2e-2
        for name, tol in (("pg_loss", 2e-3), ("grad_norm", 1e-2)):
            f, m = out[name]
            assert abs(f - m) <= tol * abs(f), (name, f, m)
        assert out["weight_rel"] < 2e-2
        assert out["weight_moved"] > 1e-4
        assert out["resumed"] == out["straight"]  # same layout (TP=2): bit-exact, even in bf16


@pytest.mark.parametrize(
    "packed,vpp",
    [(False, None), (True, None), (False, 2)],
)
def test_megatron_pp2_cp2_matches_fsdp(tmp_path, packed, vpp):
    """PP=2 x CP=2 on 4 gloo ranks (one replica: stage 0 on ranks 0-1, stage 1 on ranks 2-3, each
    stage's two CP ranks two of the four load-balanced chunks of every row) == FSDP on the same 4
    ranks: log-probs, entropy, losses, grad norm, updated weights, the critic's values and update.
    Megatron's schedules send (L / CP, b, hidden) activations between the stages (get_tensor_shapes
    divides the fed length L by CP). Padded: 11 tokens padded to 12. vpp=2: interleaved 1F1B on the
    4-layer model. 3.5-4.5 s each (the spawn) on 2 shared cores."""
    path = str(tmp_path / "model")
    model_dir = make_tiny_model_dir(path) if vpp is None else _four_layer_model(path)
    spawn(_run, 4, tmp_path, model_dir, 1, 2, vpp, packed, False, 2, str(tmp_path))
    _assert_matches(tmp_path, 4, 2)
