"""Routing replay in the Megatron engine (megatron-core's RouterReplay), on 2 gloo ranks.

Each rank records the routing of a forward over its rows; the recorded experts are checked
against the Hugging Face model's own router (same weights: every valid token, every layer), then
the router weights are redrawn (the weights have moved: free routing now picks other experts)
and a forward whose micro-batches carry the recording as `routed_experts` is observed at the
routers: 100% of its choices are the recorded ones. Padded rows at EP=1, packed rows
(`use_remove_padding`) at EP=2.
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
from moe_models import batch, configs, make_moe_model_dir  # noqa: E402

MICRO = 2


def _observe_routers(engine) -> tuple[list, list]:
    """Forward hooks on every router: the top-k expert sets it used, per forward, in layer order."""
    seen: list = []
    handles = []
    for chunk in engine.chunks:
        for layer in getattr(chunk, "module", chunk).decoder.layers:

            def hook(module, inputs, output):
                _, routing_map = output  # (tokens, E) bool
                seen.append(routing_map.detach().clone())

            handles.append(layer.mlp.router.register_forward_hook(hook))
    return seen, handles


def _hf_routing(model_dir: str, data) -> torch.Tensor:
    """(B, S, L_moe, K) the HF model's own top-k experts (sorted ids) of every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    picked = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: picked.append(o[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(
            input_ids=data.batch["input_ids"],
            attention_mask=data.batch["attention_mask"],
            position_ids=data.batch["position_ids"],
        )
    for h in hooks:
        h.remove()
    b, s = data.batch["input_ids"].shape
    return torch.stack([p.reshape(b, s, -1) for p in picked], dim=2).sort(dim=-1).values


def _micros(data, routed=None):
    keys = ["input_ids", "attention_mask", "position_ids", "responses"]
    td = data.batch.select(*keys)
    if routed is not None:
        td = td.clone()
        td["routed_experts"] = routed
    return list(td.split(MICRO))


def _run(rank, world, model_dir, ep, packed, result_dir):
    from megatron.core import parallel_state as ps

    from hybridrl.engine.base import LogProbRequest
    from hybridrl.engine.megatron.engine import MegatronEngine

    model, cfg, mcfg = configs(model_dir, ep)
    model = dataclasses.replace(model, use_remove_padding=packed)
    meg = MegatronEngine.build(model, mcfg, cfg.optim, load_tok=False)
    mine = batch().chunk(world)[rank]
    request = LogProbRequest()
    with meg.recording_routing():
        free = meg.forward(_micros(mine), request)
    recorded = torch.cat(meg.take_recorded_routing())
    via_request = meg.forward(_micros(mine), LogProbRequest(record_routing=True))  # the actor's way
    replayed_same = meg.forward(_micros(mine, recorded), request)
    with torch.no_grad():  # move the weights: every router redrawn
        for chunk in meg.chunks:
            for layer in chunk.module.decoder.layers:
                layer.mlp.router.weight.normal_(0.0, 0.3)
    seen, handles = _observe_routers(meg)
    meg.forward(_micros(mine), request)
    moved_free = list(seen)
    seen.clear()
    meg.forward(_micros(mine, recorded), request)
    for h in handles:
        h.remove()
    out = {
        "recorded": recorded,
        "via_request": torch.cat([o.routed_experts for o in via_request]),
        "valid": mine.batch["attention_mask"].bool(),
        "lp_free": torch.cat([o.log_probs for o in free]),
        "lp_replayed": torch.cat([o.log_probs for o in replayed_same]),
        "moved_free": moved_free,
        "moved_replayed": list(seen),
        "num_layers": meg.routing_replay.num_layers,
    }
    ps.destroy_model_parallel()
    torch.save(out, os.path.join(result_dir, f"replay_rank{rank}.pt"))


def _fed_choices(maps: list[torch.Tensor], out: dict, packed: bool) -> torch.Tensor:
    """Router maps of the micro-batch forwards -> (B, S, L_moe, K) sorted expert ids (valid positions)."""
    from hybridrl.engine.megatron.routing_replay import unfed_routing

    layers = out["num_layers"]
    valid = out["valid"]
    rows = []
    for m, start in enumerate(range(0, valid.shape[0], MICRO)):
        per_layer = maps[m * layers : (m + 1) * layers]
        ids = torch.stack([pm.nonzero()[:, 1].reshape(pm.shape[0], -1) for pm in per_layer])  # (L, tokens, K)
        v = valid[start : start + MICRO]
        if packed:
            from hybridrl.engine.megatron.forward import PackedMicro

            feed = PackedMicro(None, None, v)
            rec = ids.reshape(layers, -1, 1, ids.shape[-1])
        else:
            feed = None
            rec = ids.reshape(layers, v.shape[1], v.shape[0], ids.shape[-1])
        rows.append(unfed_routing(rec, feed, tuple(v.shape)))
    return torch.cat(rows)


@pytest.mark.parametrize("ep,packed", [(1, False), (2, True)])
def test_megatron_routing_replay(tmp_path, ep, packed):
    model_dir = make_moe_model_dir(str(tmp_path / "model"), "qwen3_moe")
    spawn(_run, 2, tmp_path, model_dir, ep, packed, str(tmp_path))
    hf = _hf_routing(model_dir, batch())
    for rank in range(2):
        out = torch.load(tmp_path / f"replay_rank{rank}.pt")
        valid, recorded = out["valid"], out["recorded"]
        rows = slice(rank * valid.shape[0], (rank + 1) * valid.shape[0])
        assert recorded.shape == (*valid.shape, 2, 2) and out["num_layers"] == 2
        # the recording is the model's own routing (HF's router on the same weights)
        assert torch.equal(recorded.sort(dim=-1).values[valid], hf[rows][valid])
        assert torch.equal(out["via_request"], recorded)  # LogProbRequest(record_routing=True)
        # replaying the recording at unchanged weights changes nothing
        assert torch.equal(out["lp_free"], out["lp_replayed"])
        want = recorded.sort(dim=-1).values[valid]
        replayed = _fed_choices(out["moved_replayed"], out, packed)[valid]
        free = _fed_choices(out["moved_free"], out, packed)[valid]
        match = float((replayed == want).all(dim=-1).float().mean())
        differ = float((free != want).any(dim=-1).any(dim=-1).float().mean())
        print(
            rank,
            f"replayed choices equal to the recorded: {match:.2%}; tokens routed elsewhere without replay: {differ:.2%}",
        )
        assert match == 1.0
        assert differ > 0.2  # the weights did move the free routing
