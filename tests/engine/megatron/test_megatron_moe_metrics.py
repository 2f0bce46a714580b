"""`actor/moe/*` metrics from the Megatron engine (moe_metrics.py) equal the FSDP engine's.

Same model (Qwen3-MoE and Qwen2-MoE with a shared expert, 4 experts, top-2), same padded rows on 2
gloo ranks: FSDP (DP=2), Megatron EP=1 and EP=2 (DP=2), padded and packed (`use_remove_padding`).
One PPO update each; every metric of every micro-batch (aux loss, per-layer load max/mean, tokens
per expert, tokens) agrees to 1e-5.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import spawn  # noqa: E402
from moe_models import FAMILIES, batch, configs, make_moe_model_dir  # noqa: E402

TOL = 1e-5


def _moe_metrics(actor, mine) -> dict:
    m = actor.update_policy(mine)
    return {k: list(v) for k, v in m.items() if k.startswith("actor/moe/")}


def _run(rank, world, model_dir, result_dir):
    from megatron.core import parallel_state as ps

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _ = configs(model_dir)
    mine = batch().chunk(world)[rank]
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=world)
    f_actor = PPOActor(cfg, fsdp.module, fsdp.optimizer, fsdp.lr_scheduler, dp_size=world, batch_sizes=sizes)
    out = {"fsdp": _moe_metrics(f_actor, mine), "mask": mine.batch["attention_mask"]}
    for ep in (1, 2):
        for packed in (False, True):
            model, cfg, mcfg = configs(model_dir, ep)
            model = dataclasses.replace(model, use_remove_padding=packed)
            meg = MegatronEngine.build(
                model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False
            )
            actor = PPOActor(
                cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size)
            )
            out[f"ep{ep}_packed{int(packed)}"] = _moe_metrics(actor, mine)
            del meg, actor
            ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"metrics_rank{rank}.pt"))


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_moe_metrics_equal_fsdp(tmp_path, family):
    model_dir = make_moe_model_dir(str(tmp_path / "model"), family)
    spawn(_run, 2, tmp_path, model_dir, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"metrics_rank{rank}.pt")
        f = out["fsdp"]
        assert not bool(out["mask"].all())  # the rows are padded: padding must not be counted
        assert {"actor/moe/aux_loss", "actor/moe/load_max_over_mean", "actor/moe/tokens"} <= set(f)
        assert "actor/moe/layer_1/load_max_over_mean" in f and "actor/moe/tokens_per_expert/3" in f
        for name in ("ep1_packed0", "ep1_packed1", "ep2_packed0", "ep2_packed1"):
            m = out[name]
            assert set(m) == set(f), (name, sorted(set(m) ^ set(f)))
            for key, want in f.items():
                got = m[key]
                assert len(got) == len(want), (name, key)
                for a, b in zip(got, want, strict=True):
                    assert abs(float(a) - float(b)) <= TOL * max(1.0, abs(float(b))), (name, key, a, b)
        print(
            family,
            rank,
            {k: f[k] for k in ("actor/moe/aux_loss", "actor/moe/load_max_over_mean", "actor/moe/tokens")},
        )
