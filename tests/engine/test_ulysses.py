"""Ulysses sequence parallelism on real FSDP2 over CPU processes (gloo): SP=2 == SP=1.

SP=1 on 2 ranks splits the rows (dp=2); SP=2 on the same 2 ranks gives both ranks every row and
splits each packed sequence (dp=1). Log-probs, entropy, values, the accumulated gradients and the
weights after one actor and one critic update must agree (fp32). Also: the plain (unfused) head
path, dynamic micro-batches, repeated KV heads (GQA with fewer KV heads than SP ranks), the
start-up checks, and 4 ranks as {dp: 2, sp: 2} with the workers' groups == 4 data-parallel ranks
(the loss normalisation runs over the dp group, not WORLD).
"""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

from hybridrl.engine.ulysses import check_sp_heads, check_sp_layout  # noqa: E402

ROWS = 8
TOL = dict(atol=1e-5, rtol=1e-5)
# Adam's first step is lr * g / (|g| + eps): with the default eps=1e-8 a gradient of ~1e-9 that
# differs in its last bits flips the whole step; a larger eps keeps the step smooth in g.
OPTIM_KW = dict(lr=1e-2, clip_grad=0.0, eps=1e-3)


def _gather_rows(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def _full(module):
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in module.named_parameters()
    }


def _grads(module):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in module.named_parameters()
    }


def _assert_same(a, b, what):
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _sp_group():
    import torch.distributed as dist

    from hybridrl.engine.ulysses import SPGroup

    return SPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def _actor_pair(model_dir, world=2):
    """(SP=1 actor over dp=world, SP=2 actor over dp=1), same weights, both FSDP over all ranks;
    for world != 2 the second engine is returned unwrapped (the caller applies its own layout)."""
    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.ulysses import parallelize_sp
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    model = ModelConfig(path=model_dir, use_remove_padding=True)
    cfg = ActorConfig(
        fsdp_config=fsdp,
        ppo_mini_batch_size=ROWS,
        ppo_micro_batch_size_per_gpu=2,
        use_kl_loss=True,
        kl_loss_coef=0.5,
        entropy_coeff=0.01,
        optim=OptimConfig(**OPTIM_KW),
        ulysses_sequence_parallel_size=2,
    )
    e1 = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    e2 = FSDPEngine.build(model, fsdp, cfg.optim, load_tok=False)
    s1 = normalize_actor_batch_sizes(
        dataclasses.replace(cfg, ulysses_sequence_parallel_size=1), rollout_n=1, dp_size=world
    )
    a1 = PPOActor(
        cfg, e1.module, e1.optimizer, e1.lr_scheduler, dp_size=world, batch_sizes=s1, use_remove_padding=True
    )
    if world != 2:
        return (e1, a1), (e2, None)
    sp = _sp_group()
    parallelize_sp(e2.module, sp)
    s2 = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=2)
    assert (s1.dp_size, s1.mini_batch_size, s2.dp_size, s2.mini_batch_size) == (2, 4, 1, 8)
    a2 = PPOActor(
        cfg,
        e2.module,
        e2.optimizer,
        e2.lr_scheduler,
        dp_size=1,
        batch_sizes=s2,
        use_remove_padding=True,
        sp=sp,
    )
    return (e1, a1), (e2, a2)


def _train_batch(lp):
    from hybridrl.protocol import DataProto

    g = torch.Generator().manual_seed(7)
    batch = make_batch(ROWS, prompt_len=7, response_len=6, seed=5)
    batch["old_log_probs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    batch["ref_log_prob"] = lp + 0.2 * torch.randn(lp.shape, generator=g)
    batch["advantages"] = torch.randn(lp.shape, generator=g)
    return DataProto.from_dict(batch)


def _actor_checks(rank, world, model_dir):
    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.protocol import DataProto

    (e1, a1), (e2, a2) = _actor_pair(model_dir)
    full = DataProto.from_dict(make_batch(ROWS, prompt_len=7, response_len=6, seed=5))
    mask = full.batch["response_mask"].bool()
    local = full.chunk(2)[rank]
    # log-probs and entropy: SP=1 (rows split) == SP=2 (every rank, every row)
    _res = a1.compute_log_prob(local, calculate_entropy=True, micro_batch_size=2)
    lp1, ent1 = _res.log_probs, _res.entropy
    lp1, ent1 = _gather_rows(lp1), _gather_rows(ent1)
    _res = a2.compute_log_prob(full, calculate_entropy=True, micro_batch_size=3)
    lp2, ent2 = _res.log_probs, _res.entropy
    torch.testing.assert_close(lp2[mask], lp1[mask], **TOL)
    torch.testing.assert_close(ent2[mask], ent1[mask], **TOL)
    # sum_v pi^2 (the optimal token baseline's statistic) through the SP head as well
    _res = a1.compute_log_prob(local, micro_batch_size=2, calculate_sum_pi_squared=True)
    sps1 = _res.sum_pi_squared
    _res = a2.compute_log_prob(
        full, calculate_entropy=True, micro_batch_size=3, calculate_sum_pi_squared=True
    )
    ent_s, sps2 = _res.entropy, _res.sum_pi_squared
    torch.testing.assert_close(sps2[mask], _gather_rows(sps1)[mask], **TOL)
    torch.testing.assert_close(ent_s[mask], ent1[mask], **TOL)
    lp_dyn = a2.compute_log_prob(full, use_dynamic_bsz=True, max_token_len=30).log_probs
    torch.testing.assert_close(lp_dyn[mask], lp1[mask], **TOL)
    with torch.no_grad():  # the plain head path (full logits gathered over the slices)
        _res = forward_log_probs(
            e2.module,
            full.batch,
            use_remove_padding=True,
            calculate_entropy=True,
            fused=False,
            sp=a2.engine.sp,
        )
        plain, plain_ent = _res.log_probs, _res.entropy
    torch.testing.assert_close(plain[mask], lp1[mask], **TOL)
    torch.testing.assert_close(plain_ent[mask], ent1[mask], **TOL)

    # gradients of one mini-batch, then one update: the same weights
    data = _train_batch(lp1)
    for mode in ("token-mean", "seq-mean-token-mean"):
        a1.config = a2.config = dataclasses.replace(a1.config, loss_agg_mode=mode)
        m1 = a1.forward_backward(data.chunk(2)[rank])
        g1 = _grads(e1.module)
        m2 = a2.forward_backward(data)
        g2 = _grads(e2.module)
        e1.optimizer.zero_grad(set_to_none=True)
        e2.optimizer.zero_grad(set_to_none=True)
        _assert_same(g2, g1, f"{mode} grad")
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (mode, key)
    before = _full(e2.module)
    m1 = a1.update_policy(data.chunk(2)[rank])
    m2 = a2.update_policy(data)
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    after1, after2 = _full(e1.module), _full(e2.module)
    _assert_same(after2, after1, "updated weight")
    assert not torch.allclose(
        before["model.embed_tokens.weight"], after2["model.embed_tokens.weight"], atol=1e-3
    )
    # every SP rank returns the same full result
    other = _gather_rows(lp2[None])
    torch.testing.assert_close(other[0], other[1], atol=0, rtol=0)


def _critic_checks(rank, world, model_dir):
    from hybridrl.config.roles import (
        CriticConfig,
        CriticModelConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        OptimConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.ulysses import parallelize_sp
    from hybridrl.protocol import DataProto
    from hybridrl.workers.batch_sizes import normalize_critic_batch_sizes
    from hybridrl.workers.critic import PPOCritic

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    mc = CriticModelConfig(path=model_dir, use_remove_padding=True, fsdp_config=fsdp)
    cfg = CriticConfig(
        model=mc,
        ppo_mini_batch_size=ROWS,
        ppo_micro_batch_size_per_gpu=2,
        optim=OptimConfig(**OPTIM_KW),
        ulysses_sequence_parallel_size=2,
    )
    torch.manual_seed(0)  # the fresh value head
    e1 = FSDPEngine.build(mc, fsdp, cfg.optim, role="critic", key="critic.model", load_tok=False)
    torch.manual_seed(0)
    e2 = FSDPEngine.build(mc, fsdp, cfg.optim, role="critic", key="critic.model", load_tok=False)
    _assert_same(_full(e2.module), _full(e1.module), "initial critic")
    sp = _sp_group()
    parallelize_sp(e2.module, sp, key="critic")
    s1 = normalize_critic_batch_sizes(dataclasses.replace(cfg, ulysses_sequence_parallel_size=1), dp_size=2)
    s2 = normalize_critic_batch_sizes(cfg, dp_size=2)
    c1 = PPOCritic(
        cfg, e1.module, e1.optimizer, e1.lr_scheduler, dp_size=2, batch_sizes=s1, use_remove_padding=True
    )
    c2 = PPOCritic(
        cfg,
        e2.module,
        e2.optimizer,
        e2.lr_scheduler,
        dp_size=1,
        batch_sizes=s2,
        use_remove_padding=True,
        sp=sp,
    )
    batch = make_batch(ROWS, prompt_len=7, response_len=6, seed=9)
    full = DataProto.from_dict(batch)
    v1 = _gather_rows(c1.compute_values(full.chunk(2)[rank]))
    v2 = c2.compute_values(full)
    torch.testing.assert_close(v2, v1, **TOL)
    before = _full(e2.module)
    g = torch.Generator().manual_seed(3)
    full.batch["values"] = v1 + 0.1 * torch.randn(v1.shape, generator=g)
    full.batch["returns"] = torch.randn(v1.shape, generator=g)
    m1 = c1.update_critic(full.chunk(2)[rank])
    m2 = c2.update_critic(full)
    assert m2["critic/vf_loss"] == pytest.approx(m1["critic/vf_loss"], rel=1e-5)
    after = _full(e2.module)
    _assert_same(after, _full(e1.module), "updated critic")
    assert not torch.allclose(before["score.weight"], after["score.weight"], atol=1e-3)


def _gqa_checks(rank, world):
    """4 query heads over 1 KV head on 2 SP ranks: the KV head is repeated; plain modules."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybridrl.engine.forward import forward_log_probs
    from hybridrl.engine.ulysses import parallelize_sp

    cfg = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_config(Qwen2Config(**cfg)).float().eval()
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg)).float().eval()
    parallelize_sp(model, _sp_group())
    batch = make_batch(4, prompt_len=5, response_len=4, seed=2)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        want = forward_log_probs(ref, batch, use_remove_padding=True).log_probs
        got = forward_log_probs(model, batch, use_remove_padding=True, sp=_sp_group()).log_probs
    torch.testing.assert_close(got[mask], want[mask], **TOL)


def _all_checks(rank, world, model_dir):
    _actor_checks(rank, world, model_dir)
    _critic_checks(rank, world, model_dir)
    _gqa_checks(rank, world)


@pytest.mark.timeout(600)
def test_ulysses_sp2_equals_sp1(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_all_checks, 2, tmp_path, model_dir)


def test_sp_checks_name_the_fix():
    check_sp_layout("actor_rollout_ref.actor", 2, 4, use_remove_padding=True)
    check_sp_heads("actor_rollout_ref.actor", 2, 4, 1)  # KV heads repeated
    with pytest.raises(ValueError, match=r"does not divide the 3 ranks.*use one of \[1, 3\]"):
        check_sp_layout("actor_rollout_ref.actor", 2, 3, use_remove_padding=True)
    with pytest.raises(ValueError, match="use_remove_padding=True"):
        check_sp_layout("critic", 2, 2, use_remove_padding=False)
    with pytest.raises(ValueError, match="context_parallel_size"):
        check_sp_layout("critic", 2, 2, use_remove_padding=True, strategy="megatron")
    with pytest.raises(ValueError, match=r"does not divide the model's 6 attention heads.*\[1, 2, 3, 6\]"):
        check_sp_heads("actor_rollout_ref.actor", 4, 6, 6)


def _dp2_sp2_checks(rank, world, model_dir):
    """4 ranks as {dp: 2, sp: 2} (the workers' groups, `ulysses.apply_sp`) == 4 data-parallel ranks."""
    from hybridrl.engine.ulysses import apply_sp
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes
    from hybridrl.workers.parallel_dims import ParallelDims

    (e1, a1), (e2, _) = _actor_pair(model_dir, world=4)
    layout = ParallelDims(4, sp=2).train_mesh()
    apply_sp(e2, layout, rank, "actor_rollout_ref.actor")
    cfg = a1.config
    a2 = PPOActor(
        cfg,
        e2.module,
        e2.optimizer,
        batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=4),
        use_remove_padding=True,
        dp_size=e2.dp_size,
        dp_group=e2.dp_group,
        sp=e2.sp,
    )
    assert (a2.dp_size, e2.sp.rank, layout.dp_rank(rank)) == (2, rank % 2, rank // 2)
    full = DataProto.from_dict(make_batch(ROWS, prompt_len=7, response_len=6, seed=5))
    mask = full.batch["response_mask"].bool()
    lp1 = _gather_rows(a1.compute_log_prob(full.chunk(4)[rank], micro_batch_size=2).log_probs)
    lp2 = a2.compute_log_prob(full.chunk(2)[rank // 2], micro_batch_size=2).log_probs
    gathered = _gather_rows(lp2)  # ranks 0, 1 hold dp group 0's rows; ranks 2, 3 group 1's
    lp2 = torch.cat([gathered[: ROWS // 2], gathered[ROWS:][: ROWS // 2]])
    torch.testing.assert_close(lp2[mask], lp1[mask], **TOL)
    data = _train_batch(lp1)
    m1 = a1.forward_backward(data.chunk(4)[rank])
    m2 = a2.forward_backward(data.chunk(2)[rank // 2])
    _assert_same(_grads(e2.module), _grads(e1.module), "dp2 x sp2 grad")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key


@pytest.mark.timeout(900)
def test_ulysses_dp2_sp2_equals_dp4(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_dp2_sp2_checks, 4, tmp_path, model_dir)
