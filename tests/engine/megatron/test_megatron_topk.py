"""forward_kl_topk on Megatron: top-k and gathered log-probs over a vocabulary-parallel head.

Three tiers: the two functions of engine/megatron/vocab_parallel_topk.py against a plain
log-softmax (one process, padded columns); the same over 2 gloo ranks each holding half the
padded vocabulary (values, ids and the gradient of the logits); and the real engines on 2 ranks:
FSDP (DP=2), Megatron TP=2 and Megatron TP=1 (DP=2) give the same teacher top-k (values and ids)
and the same forward_kl_topk update (distillation loss, grad norm, updated weights), fp32.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_testkit import VOCAB, spawn  # noqa: E402
from test_megatron_engine import ROWS, _batch, _configs, _initial, _rel  # noqa: E402

from hybridrl.engine.megatron.vocab_parallel_topk import (  # noqa: E402
    vocab_parallel_gather,
    vocab_parallel_topk,
)

K, TOL = 5, 1e-5


def _logits(shape=(3, 4), padded=16, vocab=13, seed=0):
    """(shape, padded) logits whose columns >= vocab are garbage (large, to be masked)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, padded, generator=g) * 3
    x[..., vocab:] = 50.0
    return x


def test_topk_and_gather_equal_a_plain_log_softmax_without_tp():
    vocab = 13
    x = _logits(vocab=vocab).requires_grad_(True)
    ref = torch.log_softmax(x[..., :vocab].detach(), -1)
    values, ids = vocab_parallel_topk(x, K, vocab_size=vocab)
    want_v, want_i = ref.topk(K, -1)
    torch.testing.assert_close(values, want_v, atol=TOL, rtol=0)
    assert torch.equal(ids, want_i)
    gather_ids = torch.randint(0, vocab, (3, 4, 7), generator=torch.Generator().manual_seed(1))
    got = vocab_parallel_gather(x, gather_ids, vocab_size=vocab)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    (got * weights).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    want = torch.log_softmax(x_ref[..., :vocab], -1).gather(-1, gather_ids)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=TOL, rtol=0)  # padded columns: 0 in both
    with pytest.raises(ValueError, match="topk=14 exceeds the vocabulary"):
        vocab_parallel_topk(x, vocab + 1, vocab_size=vocab)


def _two_ranks(rank, world, out_dir):
    import torch.distributed as dist

    vocab, padded = 13, 16
    full = _logits(vocab=vocab, padded=padded)
    mine = full.chunk(world, -1)[rank].clone().requires_grad_(True)
    group = dist.new_group([0, 1])
    # k=7 > the 5 real columns of rank 1's slice: its padded columns are candidates that must never win
    values, ids = vocab_parallel_topk(mine, 7, vocab_size=vocab, tp_rank=rank, group=group)
    gather_ids = torch.randint(0, vocab, (3, 4, 7), generator=torch.Generator().manual_seed(1))
    got = vocab_parallel_gather(mine, gather_ids, vocab_size=vocab, tp_rank=rank, group=group)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    (got * weights).sum().backward()
    torch.save(
        {"values": values, "ids": ids, "got": got.detach(), "grad": mine.grad}, f"{out_dir}/r{rank}.pt"
    )


def test_topk_and_gather_over_two_tensor_parallel_ranks(tmp_path):
    vocab = 13
    spawn(_two_ranks, 2, tmp_path, str(tmp_path))
    r = [torch.load(tmp_path / f"r{i}.pt") for i in range(2)]
    x = _logits(vocab=vocab).requires_grad_(True)
    ref = torch.log_softmax(x[..., :vocab], -1)
    want_v, want_i = ref.detach().topk(7, -1)
    gather_ids = torch.randint(0, vocab, (3, 4, 7), generator=torch.Generator().manual_seed(1))
    want = ref.gather(-1, gather_ids)
    (want * torch.randn(want.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    for i in range(2):
        torch.testing.assert_close(r[i]["values"], want_v, atol=TOL, rtol=0)
        assert torch.equal(r[i]["ids"], want_i)
        torch.testing.assert_close(r[i]["got"], want.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(torch.cat([r[0]["grad"], r[1]["grad"]], -1), x.grad, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# the engines
# ----------------------------------------------------------------------------------------------
def _distill_batch():
    """_batch() with a synthetic teacher: log-probs of the sampled tokens and top-k (ids distinct)."""
    data = _batch()
    b, t = data.batch["responses"].shape
    g = torch.Generator().manual_seed(11)
    data.batch["teacher_log_probs"] = -3.0 + 0.3 * torch.randn(b, t, generator=g)
    data.batch["teacher_topk_ids"] = torch.rand(b, t, VOCAB, generator=g).topk(K, -1).indices
    data.batch["teacher_topk_log_probs"] = torch.log_softmax(torch.randn(b, t, K, generator=g), -1) - 0.2
    return data


def _actor(engine, cfg, dp, fsdp=False):
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes
    from hybridrl.workers.distillation_config import DistillationLossConfig

    loss = DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=K, use_task_rewards=True, log_prob_min_clamp=-10.0
    )
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=dp)
    if fsdp:
        return PPOActor(
            cfg,
            engine.module,
            engine.optimizer,
            engine.lr_scheduler,
            dp_size=dp,
            batch_sizes=sizes,
            distillation=loss,
        )
    return PPOActor(cfg, engine, batch_sizes=sizes, distillation=loss)


def _one(actor, data, mask, out, tag):
    """Teacher top-k of `data` and one forward_kl_topk update; results under `tag`."""
    res = actor.compute_log_prob(data, micro_batch_size=2, topk=K)
    out[f"{tag}_values"] = res.topk_log_probs[mask]
    out[f"{tag}_ids"] = res.topk_ids[mask]
    metrics = actor.update_policy(data)
    for name in ("distillation/loss", "actor/grad_norm", "distillation/student_mass"):
        out[f"{tag}_{name}"] = metrics[name][0]


def _run_engines(rank, world, model_dir, out_dir):
    from megatron.core import parallel_state as ps

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine

    model, cfg, _, mcfg = _configs(model_dir, 2, 1)
    cfg = dataclasses.replace(cfg, use_kl_loss=False, entropy_coeff=0.0)
    data = _distill_batch()
    rows = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    mine, mask = data.chunk(2)[rank], data.batch["response_mask"].bool()
    init, out = _initial(model_dir), {}
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    _one(_actor(fsdp, cfg, 2, fsdp=True), mine, mask[rows], out, "fsdp")
    f_w = dict(fsdp.iter_full_params())
    for tp in (2, 1):
        meg = MegatronEngine.build(
            model, dataclasses.replace(mcfg, tensor_model_parallel_size=tp), cfg.optim,
            max_grad_norm=cfg.max_grad_norm, load_tok=False,
        )  # fmt: skip
        dp = 2 // tp
        part, part_mask = (data, mask) if dp == 1 else (mine, mask[rows])
        _one(_actor(meg, cfg, dp), part, part_mask, out, f"tp{tp}")
        if dp == 1:  # this rank's rows, to compare with FSDP's
            n = int(mask[: rows.start].sum()), int(mask[rows].sum())
            out["tp2_values"] = out["tp2_values"][n[0] : n[0] + n[1]]
            out["tp2_ids"] = out["tp2_ids"][n[0] : n[0] + n[1]]
        m_w = dict(meg.iter_full_params())
        out[f"tp{tp}_weight_rel"] = max(_rel(m_w[k], f_w[k]) for k in f_w)
        out[f"tp{tp}_update_rel"] = max(_rel(m_w[k] - init[k], f_w[k] - init[k]) for k in f_w)
        del meg
        ps.destroy_model_parallel()
    out["moved"] = max(float((f_w[k] - v).abs().max()) for k, v in init.items())
    torch.save(out, os.path.join(out_dir, f"topk_rank{rank}.pt"))


def test_megatron_tp1_tp2_and_fsdp_agree_on_forward_kl_topk(tmp_path):
    """Teacher top-k values / ids and one update (loss, grad norm, weight update) through the real engines."""
    from fsdp_testkit import make_tiny_model_dir

    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_run_engines, 2, tmp_path, model_dir, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"topk_rank{rank}.pt")
        print(rank, {k: v for k, v in out.items() if not torch.is_tensor(v)})
        for tp in (1, 2):
            torch.testing.assert_close(out[f"tp{tp}_values"], out["fsdp_values"], atol=TOL, rtol=0)
            assert torch.equal(out[f"tp{tp}_ids"], out["fsdp_ids"])
            for name in ("distillation/loss", "actor/grad_norm", "distillation/student_mass"):
                f, m = out[f"fsdp_{name}"], out[f"tp{tp}_{name}"]
                assert abs(f - m) <= TOL * max(1.0, abs(f)), (tp, name, f, m)
            assert out[f"tp{tp}_weight_rel"] < TOL, out[f"tp{tp}_weight_rel"]
        assert out["fsdp_distillation/loss"] > 1e-3 and out["moved"] > 1e-4
