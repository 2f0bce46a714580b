"""Mixture-of-experts forwards in the HF engine: padded == packed == shared-prompt, routing recorded and
replayed exactly (also after the weights moved), the load-balancing loss against Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engine.base import LogProbRequest
from hybridrl.engine.module_engine import ModuleEngine
from hybridrl.models.moe import find_routers, is_moe, load_balancing_loss
from tests.fsdp_testkit import make_batch
from tests.moe_testkit import FAMILIES, make_tiny_moe


def _engine(model, packed: bool) -> ModuleEngine:
    return ModuleEngine(model, use_remove_padding=packed)


def _shared_prompt_batch(seed: int = 0):
    batch = make_batch(6, prompt_len=6, response_len=5, seed=seed)
    for key in ("input_ids", "attention_mask", "position_ids"):
        batch[key][1::2, :6] = batch[key][0::2, :6]  # rows 2i and 2i+1 share their prompt
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


def _valid(routed, mask):
    return routed[mask.bool()]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_packed_and_shared_prompt_forwards_agree(family):
    model = make_tiny_moe(family)
    batch = _shared_prompt_batch()
    req = LogProbRequest(record_routing=True)
    padded = _engine(model, False).forward([batch], req)[0]
    packed = _engine(model, True).forward([batch], req)[0]
    grouped = _engine(model, True).forward([batch], LogProbRequest(record_routing=True, prefix_group=True))[0]
    rmask = batch["response_mask"].bool()
    torch.testing.assert_close(packed.log_probs[rmask], padded.log_probs[rmask], atol=1e-5, rtol=0)
    torch.testing.assert_close(grouped.log_probs[rmask], padded.log_probs[rmask], atol=1e-5, rtol=0)
    mask = batch["attention_mask"]
    assert padded.routed_experts.shape == (6, 11, 2, 2)
    assert (padded.routed_experts[~mask.bool()] == -1).all() and (
        packed.routed_experts[~mask.bool()] == -1
    ).all()
    same = (_valid(packed.routed_experts, mask) == _valid(padded.routed_experts, mask)).all(-1).float().mean()
    assert same > 0.98  # near-ties may flip between layouts (float sums in another order)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_replay_reproduces_recorded_routing_after_weights_moved(family, layout):
    model = make_tiny_moe(family)
    batch = _shared_prompt_batch(seed=1)
    engine = _engine(model, layout != "padded")
    grouped = layout == "shared_prompt"
    recorded = engine.forward([batch], LogProbRequest(record_routing=True, prefix_group=grouped))[0]
    batch["routed_experts"] = recorded.routed_experts
    replayed = engine.forward(
        [batch], LogProbRequest(record_routing=True, replay_routing=True, prefix_group=grouped)
    )[0]
    mask = batch["attention_mask"].bool()
    assert torch.equal(replayed.routed_experts, recorded.routed_experts)
    torch.testing.assert_close(replayed.log_probs, recorded.log_probs, atol=0, rtol=0)

    with torch.no_grad():  # move the weights: the routers now choose differently
        for router in find_routers(model):
            router.weight.add_(torch.randn_like(router.weight) * router.weight.std() * 3)
    free = engine.forward([batch], LogProbRequest(record_routing=True, prefix_group=grouped))[0]
    forced = engine.forward(
        [batch], LogProbRequest(record_routing=True, replay_routing=True, prefix_group=grouped)
    )[0]
    differ = (free.routed_experts[mask] != recorded.routed_experts[mask]).any(-1).float().mean()
    match = (forced.routed_experts[mask] == recorded.routed_experts[mask]).all(-1).float().mean()
    print(
        f"{family} {layout}: after the move {float(differ):.0%} of (token, layer) choices differ; replay matches {float(match):.0%}"
    )
    assert differ > 0.1
    assert match == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_weights_keep_the_router_gradient(family):
    model = make_tiny_moe(family)
    batch = make_batch(4, seed=2)
    engine = _engine(model, True)
    batch["routed_experts"] = engine.forward([batch], LogProbRequest(record_routing=True))[0].routed_experts
    model.train()
    out = engine._output(batch, LogProbRequest(replay_routing=True, router_aux_loss=True))
    (out.log_probs.sum() + out.router_aux_loss).backward()
    for router in find_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert out.moe_metrics["moe/load_max_over_mean"] >= 1.0
    assert set(out.moe_metrics) >= {"moe/layer_0/load_max_over_mean", "moe/tokens_per_expert/3"}


def test_load_balancing_loss_equals_hugging_face():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = make_tiny_moe("qwen3_moe")
    batch = make_batch(4, seed=3)
    engine = _engine(model, False)
    out = engine._output(batch, LogProbRequest(router_aux_loss=True, record_routing=True))
    hf = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
    )
    want = load_balancing_loss_func(hf.router_logits, 4, 2, batch["attention_mask"])
    torch.testing.assert_close(out.router_aux_loss, want.float(), atol=1e-6, rtol=1e-5)
    tokens = torch.ones(8, 2, dtype=torch.long)
    uniform = load_balancing_loss([torch.zeros(8, 4)] * 2, torch.stack([tokens * 0, tokens * 1], 1), 4)
    assert float(uniform) == pytest.approx(2.0)  # a uniform router gives K (= 2), whatever the choice


def test_dense_model_is_refused_for_routing():
    from transformers import AutoModelForCausalLM, Qwen2Config

    model = AutoModelForCausalLM.from_config(
        Qwen2Config(
            vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )
    assert not is_moe(model)
    with pytest.raises(ValueError, match="router_replay.mode=disabled"):
        _engine(model, True).forward([make_batch(2)], LogProbRequest(replay_routing=True))


def test_replay_without_routing_in_the_batch_names_the_key():
    engine = _engine(make_tiny_moe("qwen3_moe"), True)
    with pytest.raises(KeyError, match="enable_rollout_routing_replay"):
        engine.forward([make_batch(2)], LogProbRequest(replay_routing=True))
