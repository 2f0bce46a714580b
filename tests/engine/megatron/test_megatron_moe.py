"""Mixture-of-experts models in the Megatron engine, on real megatron-core over 2 gloo ranks.

Per family (Qwen3-MoE; Qwen2-MoE with a gated shared expert), on the same 2 ranks and the same
rows: FSDP (HF model, data-parallel 2), Megatron EP=1 (DP=2, every rank all 4 experts) and
Megatron EP=2 (DP=2, each rank 2 experts, tokens exchanged by all-to-all): log-probs, one PPO
update's losses and gradient norm, the updated weights, all to 1e-5. The load-balancing
auxiliary loss is off here (moe_aux_loss_coeff=0: the HF forward in the FSDP engine adds none);
`test_megatron_moe_aux_loss` checks it on its own.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import spawn  # noqa: E402
from moe_models import FAMILIES, ROWS, batch, configs, make_moe_model_dir  # noqa: E402

TOL = 1e-5


def _megatron_actor(model, cfg, mcfg):
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size)
    return meg, PPOActor(cfg, meg, batch_sizes=sizes)


def _one_step(actor, engine, mine) -> dict:
    """Log-probs, one update's metrics and the weights after it."""
    lp = actor.compute_log_prob(mine, micro_batch_size=2).log_probs
    m = actor.update_policy(mine)
    return {
        "lp": lp * mine.batch["response_mask"],  # padded positions are undefined in either engine
        "pg_loss": m["actor/pg_loss"][0],
        "grad_norm": m["actor/grad_norm"][0],
        "weights": {k: v.clone() for k, v in engine.iter_full_params()},
    }


def _run_equivalence(rank, world, model_dir, result_dir):
    from megatron.core import parallel_state as ps

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _ = configs(model_dir)
    mine = batch().chunk(world)[rank]
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=world)
    f_actor = PPOActor(cfg, fsdp.module, fsdp.optimizer, fsdp.lr_scheduler, dp_size=world, batch_sizes=sizes)
    results = {"fsdp": _one_step(f_actor, fsdp, mine)}
    for ep in (1, 2):
        meg, actor = _megatron_actor(*configs(model_dir, ep))
        results[f"ep{ep}"] = _one_step(actor, meg, mine)
        results[f"ep{ep}"]["dp"] = meg.dp_size
        results[f"ep{ep}"]["local_experts"] = meg.chunks[0].module.decoder.layers[0].mlp.num_local_experts
        del meg, actor
        ps.destroy_model_parallel()
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))


def _run_tp2(rank, world, model_dir, result_dir):
    """TP=2 with sequence parallelism (one replica, DP=1): EP=1 (experts split by expert-TP 2) and
    EP=2 with expert-TP 1 (each TP rank holds 2 whole experts), against FSDP on the same 2 ranks."""
    from megatron.core import parallel_state as ps

    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    model, cfg, _ = configs(model_dir)
    data = batch()
    mine = data.chunk(world)[rank]
    fsdp = FSDPEngine.build(model, cfg.fsdp_config, cfg.optim, load_tok=False)
    sizes = normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=world)
    f_actor = PPOActor(cfg, fsdp.module, fsdp.optimizer, fsdp.lr_scheduler, dp_size=world, batch_sizes=sizes)
    results = {"fsdp": _one_step(f_actor, fsdp, mine)}
    for name, ep, etp in (("tp2_ep1", 1, None), ("tp2_ep2_etp1", 2, 1)):
        mcfg = configs(model_dir, ep, tensor_model_parallel_size=2, sequence_parallel=True,
                       expert_tensor_parallel_size=etp)[2]  # fmt: skip
        meg, actor = _megatron_actor(model, cfg, mcfg)
        results[name] = _one_step(actor, meg, data)
        n = ROWS // world
        results[name]["lp"] = results[name]["lp"][rank * n : rank * n + n]
        results[name]["dp"] = meg.dp_size
        del meg, actor
        ps.destroy_model_parallel()
    torch.save(results, os.path.join(result_dir, f"tp2_rank{rank}.pt"))


def test_megatron_moe_tp2_sequence_parallel_matches_fsdp(tmp_path):
    """TP=2 + SP with EP=1 (expert-TP 2) and with EP=2 x expert-TP 1 == FSDP (Qwen3-MoE: q/k norms
    under sequence parallelism, their gradients summed over TP)."""
    model_dir = make_moe_model_dir(str(tmp_path / "model"), "qwen3_moe")
    spawn(_run_tp2, 2, tmp_path, model_dir, str(tmp_path))
    for rank in range(2):
        out = torch.load(tmp_path / f"tp2_rank{rank}.pt")
        _assert_close(out, ("tp2_ep1", "tp2_ep2_etp1"), "qwen3_moe", rank)


def _assert_close(out: dict, names: tuple[str, ...], family: str, rank: int) -> None:
    f = out["fsdp"]
    for name in names:
        m = out[name]
        lp_diff = float((m["lp"] - f["lp"]).abs().max())
        w_rel = max(_rel(m["weights"][k], f["weights"][k]) for k in f["weights"])
        print(family, rank, name, "lp", lp_diff, "pg", m["pg_loss"], f["pg_loss"], "gn", m["grad_norm"],
              f["grad_norm"], "w_rel", w_rel)  # fmt: skip
        assert set(m["weights"]) == set(f["weights"])
        assert lp_diff < TOL
        assert abs(m["pg_loss"] - f["pg_loss"]) <= TOL * max(1.0, abs(f["pg_loss"]))
        assert abs(m["grad_norm"] - f["grad_norm"]) <= TOL * max(1.0, abs(f["grad_norm"]))
        assert w_rel < TOL


def initial_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_moe_ep2_equals_ep1_equals_fsdp(tmp_path, family):
    """EP=2 == EP=1 == FSDP on 2 gloo ranks: log-probs, pg loss, grad norm, weights after one step."""
    model_dir = make_moe_model_dir(str(tmp_path / "model"), family)
    spawn(_run_equivalence, 2, tmp_path, model_dir, str(tmp_path))
    init = initial_weights(model_dir)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        f = out["fsdp"]
        assert (out["ep1"]["local_experts"], out["ep2"]["local_experts"]) == (4, 2)
        assert out["ep1"]["dp"] == out["ep2"]["dp"] == 2
        for name in ("ep1", "ep2"):
            m = out[name]
            lp_diff = float((m["lp"] - f["lp"]).abs().max())
            w_rel = max(_rel(m["weights"][k], f["weights"][k]) for k in f["weights"])
            print(
                family,
                rank,
                name,
                "lp",
                lp_diff,
                "pg",
                m["pg_loss"],
                f["pg_loss"],
                "gn",
                m["grad_norm"],
                f["grad_norm"],
                "w_rel",
                w_rel,
            )
            assert set(m["weights"]) == set(f["weights"])
            assert lp_diff < TOL
            assert abs(m["pg_loss"] - f["pg_loss"]) <= TOL * max(1.0, abs(f["pg_loss"]))
            assert abs(m["grad_norm"] - f["grad_norm"]) <= TOL * max(1.0, abs(f["grad_norm"]))
            assert w_rel < TOL
        moved = max(float((f["weights"][k] - v).abs().max()) for k, v in init.items())
        assert moved > 1e-4  # the update did change the weights
