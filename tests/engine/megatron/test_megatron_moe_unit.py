"""Unit checks of the Megatron MoE pieces: HF <-> Megatron mapping, routing layouts, plans, refusals."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_models import FAMILIES, moe_config  # noqa: E402

from hybridrl.engine.megatron.convert import arch_spec, hf_layer_to_megatron, megatron_layer_to_hf  # noqa: E402
from hybridrl.engine.megatron.moe import (  # noqa: E402
    check_moe_overrides,
    global_expert_name,
    local_expert_name,
    moe_transformer_kwargs,
)
from hybridrl.engine.megatron.routing_replay import fed_routing, routing_replay_plan, unfed_routing  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 1), (2, 2)])
def test_moe_layer_round_trip(family, tp, etp):
    from transformers import AutoModelForCausalLM

    cfg = moe_config(family)
    spec = arch_spec(cfg)
    assert spec.num_experts == 4 and spec.moe_topk == 2
    assert spec.shared_expert_ffn_hidden_size == (48 if family == "qwen2_moe" else 0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).state_dict()
    prefix = "model.layers.1."
    layer = {k[len(prefix) :]: v for k, v in hf.items() if k.startswith(prefix)}
    mg = hf_layer_to_megatron(layer, spec, tp, etp)
    assert mg["mlp.experts.local_experts.3.linear_fc2.weight"].shape == (64, 32)
    back = megatron_layer_to_hf(mg, spec, tp, etp)
    assert set(back) == set(layer)
    assert all(torch.equal(back[k], layer[k]) for k in layer)


def test_expert_names_local_and_global():
    name = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight"
    assert global_expert_name(name, ep_rank=2, local_experts=4) == name.replace(".1.linear", ".9.linear")
    assert local_expert_name(name.replace(".1.linear", ".9.linear"), 4) == (name, 2)
    assert (
        global_expert_name("decoder.layers.3.mlp.router.weight", 2, 4) == "decoder.layers.3.mlp.router.weight"
    )


def test_routing_matches_hf_rule():
    # norm_topk_prob=True (qwen3_moe) is Megatron's top-k-then-softmax; False (qwen2_moe) softmax-then-top-k
    assert moe_transformer_kwargs(arch_spec(moe_config("qwen3_moe")))["moe_router_pre_softmax"] is False
    kw = moe_transformer_kwargs(arch_spec(moe_config("qwen2_moe")))
    assert kw["moe_router_pre_softmax"] is True and kw["moe_shared_expert_gate"] is True
    assert kw["moe_aux_loss_coeff"] == 0.01  # the model's router_aux_loss_coef


def test_dense_layers_between_moe_layers_refused():
    cfg = moe_config("qwen3_moe")
    cfg.mlp_only_layers = [0]
    with pytest.raises(ValueError, match="mlp_only_layers"):
        arch_spec(cfg)


def test_cuda_only_moe_overrides_refused_on_cpu():
    for name, value in (("moe_token_dispatcher_type", "flex"), ("moe_enable_deepep", True)):
        with pytest.raises(ValueError, match=f"override_transformer_config.{name}"):
            check_moe_overrides({"num_moe_experts": 4, name: value}, "actor.megatron", on_cpu=True)
        check_moe_overrides({"num_moe_experts": 4, name: value}, "actor.megatron", on_cpu=False)


def test_replay_plans():
    assert routing_replay_plan("disabled") == routing_replay_plan("disabled")
    r2, r3 = routing_replay_plan("R2"), routing_replay_plan("R3")
    assert r2.record_old_log_prob and r2.replay_update and not r2.replay_log_prob
    assert not r3.record_old_log_prob and r3.replay_update and r3.replay_log_prob
    with pytest.raises(ValueError, match="router_replay.mode='R4'"):
        routing_replay_plan("R4")


@pytest.mark.parametrize("packed", [False, True])
def test_fed_routing_round_trip(packed):
    """(b, S, L, K) -> the fed (L, positions, rows, K) token order and back (padding zeroed)."""
    from hybridrl.engine.megatron.forward import pack_micro, pad_micro

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    micro = {"input_ids": torch.randint(3, 9, (2, 5), generator=g), "attention_mask": mask}
    routed = torch.randint(0, 4, (2, 5, 3, 2), generator=g)
    feed = pack_micro(micro, 8) if packed else pad_micro({**micro, "position_ids": mask.cumsum(-1)}, 4)
    fed = fed_routing(routed, feed)
    rows = 1 if packed else 2
    assert fed.shape == (3, feed.input_ids.shape[1], rows, 2)
    if packed:  # the packed row holds the valid tokens in order
        assert torch.equal(fed[:, :7, 0].permute(1, 0, 2), routed[mask.bool()])
    else:  # position p of row r is token p * rows + r of a router
        assert torch.equal(fed[1, 2, 1], routed[1, 2, 1])
    back = unfed_routing(fed, feed, (2, 5))
    expect = routed * mask[:, :, None, None] if packed else routed
    assert torch.equal(back, expect)
