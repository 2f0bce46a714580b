"""`model.use_fused_kernels=True` on Megatron: log-probs from the hidden states, chunk by chunk (fused_head.py).

One process: the chunked function against a plain log-softmax of the full logits (values and
gradients). Two gloo ranks: the Megatron engine with the fused head against the same engine without
it (log-probs, entropy, one PPO update: losses, grad norm, weights), at TP=2 with and without
sequence parallelism, DP=2 and CP=2, fp32.
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

from hybridrl.engine.megatron.fused_head import fused_logprobs_entropy  # noqa: E402

TOL = 1e-5
LAYOUTS = ((2, 1, False), (2, 1, True), (1, 1, False), (1, 2, False))  # (TP, CP, SP) on 2 ranks


def test_chunked_log_probs_equal_a_full_log_softmax():
    g = torch.Generator().manual_seed(0)
    vocab, padded, hidden = 13, 16, 8
    h = torch.randn(3, 5, hidden, generator=g, requires_grad=True)
    w = torch.randn(padded, hidden, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    lp, ent = fused_logprobs_entropy(
        h, w, targets, temperature=0.7, vocab_size=vocab, tp_rank=0, group=None, chunk=2
    )
    (lp.sum() + 0.3 * ent.sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    logp = torch.log_softmax((h2 @ w2.T)[..., :vocab] / 0.7, -1)
    want_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    (want_lp.sum() + 0.3 * want_ent.sum()).backward()
    torch.testing.assert_close(lp, want_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=TOL, rtol=0)
    torch.testing.assert_close(h.grad, h2.grad, atol=TOL, rtol=0)
    torch.testing.assert_close(w.grad, w2.grad, atol=TOL, rtol=0)


def _one(engine_cls, model, cfg, mcfg, data, out, tag, fused):
    from megatron.core import parallel_state as ps

    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model = dataclasses.replace(model, use_fused_kernels=fused)
    meg = engine_cls.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    assert meg.fused_head is fused
    actor = PPOActor(cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size))
    mine = data if meg.dp_size == 1 else data.chunk(meg.dp_size)[meg.dp_rank]
    res = actor.compute_log_prob(mine, calculate_entropy=True, micro_batch_size=2)
    out[f"{tag}_lp"], out[f"{tag}_ent"] = res.log_probs, res.entropy
    metrics = actor.update_policy(mine)
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        out[f"{tag}_{name}"] = metrics[name][0]
    out[f"{tag}_w"] = dict(meg.iter_full_params())
    del meg, actor
    ps.destroy_model_parallel()


def _run(rank, world, model_dir, out_dir):
    from hybridrl.engine.megatron.engine import MegatronEngine

    data, out = _batch(), {}
    for tp, cp, sp in LAYOUTS:
        model, cfg, _, mcfg = _configs(model_dir, tp, 1, cp=cp, sp=sp)
        for fused in (False, True):
            _one(MegatronEngine, model, cfg, mcfg, data, out, f"tp{tp}cp{cp}sp{int(sp)}_{int(fused)}", fused)
    torch.save(out, os.path.join(out_dir, f"fused_rank{rank}.pt"))


def test_fused_head_equals_logits_path_on_two_ranks(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_run, 2, tmp_path, model_dir, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"fused_rank{rank}.pt")
        for layout in [f"tp{tp}cp{cp}sp{int(sp)}" for tp, cp, sp in LAYOUTS]:
            a, b = f"{layout}_0", f"{layout}_1"
            mask = torch.ones_like(out[f"{a}_lp"], dtype=torch.bool)
            lp_diff = float((out[f"{a}_lp"] - out[f"{b}_lp"])[mask].abs().max())
            ent_diff = float((out[f"{a}_ent"] - out[f"{b}_ent"]).abs().max())
            w_rel = max(_rel(out[f"{b}_w"][k], out[f"{a}_w"][k]) for k in out[f"{a}_w"])
            print(layout, rank, "lp", lp_diff, "ent", ent_diff, "w", w_rel,
                  [(out[f"{a}_{n}"], out[f"{b}_{n}"]) for n in ("actor/pg_loss", "actor/grad_norm")])  # fmt: skip
            assert lp_diff < TOL and ent_diff < TOL, (layout, lp_diff, ent_diff)
            for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
                f, u = out[f"{b}_{name}"], out[f"{a}_{name}"]
                assert abs(f - u) <= TOL * max(1.0, abs(u)), (layout, name, f, u)
            assert w_rel < TOL, (layout, w_rel)
