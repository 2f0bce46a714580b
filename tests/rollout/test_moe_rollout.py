"""Mixture-of-experts models in the HF rollout: weight sync, and rollout routing replay (R3): the
rollout records each token's experts, the training forward replays them exactly, and replaying
brings the training log-probs closer to the rollout's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rollout_testlib import make_char_tokenizer, make_prompts

from hybridrl.engine.base import LogProbRequest
from hybridrl.engine.module_engine import ModuleEngine
from hybridrl.rollout import RolloutConfig, create_rollout, vllm_routing
from hybridrl.weight_sync import sync_weights
from tests.moe_testkit import FAMILIES, make_tiny_moe

TEXTS = ["12+34=", "7+1=", "abc", "9", "5*5=", "ab+cd="]
T = 12


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = make_tiny_moe(request.param, seed=1)
    model.config.eos_token_id = 1
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path, model


def _rollout(path, tok, **kw):
    cfg = dict(name="hf", dtype="float32", prompt_length=8, response_length=T, load_format="auto",
               enable_rollout_routing_replay=True, calculate_log_probs=True, temperature=1.0, ignore_eos=True)  # fmt: skip
    return create_rollout(RolloutConfig(**{**cfg, **kw}), path, tok, device="cpu")


def _tokenizer(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return tok


def test_weight_sync_into_a_dummy_moe_rollout_gives_the_trained_models_greedy_tokens(moe_dir):
    path, model = moe_dir
    tok = _tokenizer(path)
    dummy = create_rollout(
        RolloutConfig(name="hf", dtype="float32", prompt_length=8, response_length=T, load_format="dummy",
                      ignore_eos=True), path, tok, device="cpu",
    )  # fmt: skip
    sync_weights(dummy, model.state_dict().items())
    prompts = make_prompts(tok, TEXTS, {"validate": True, "greedy": True})
    got = dummy.generate_sequences(prompts).batch["responses"]
    enc = prompts.batch
    want = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=T,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[:, enc["input_ids"].shape[1]:]  # fmt: skip
    assert torch.equal(got, want)


def test_recorded_routing_is_what_the_training_forward_routes_and_replays_exactly(moe_dir):
    path, model = moe_dir
    tok = _tokenizer(path)
    out = _rollout(path, tok).generate_sequences(make_prompts(tok, TEXTS)).batch
    routed = out["routed_experts"]
    assert routed.shape == (*out["input_ids"].shape, 2, 2)
    fed = (routed >= 0).all(-1).all(-1)  # every valid token but each row's last one
    mask = out["attention_mask"].bool()
    assert torch.equal(fed, mask & (mask.long().cumsum(-1) < mask.sum(-1, keepdim=True)))
    assert not (routed[~mask] >= 0).any()
    engine = ModuleEngine(model, use_remove_padding=True)
    batch = {
        k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "routed_experts")
    }
    free = engine.forward([batch], LogProbRequest(record_routing=True))[0].routed_experts
    same = (free[fed] == routed[fed]).all(-1).all(-1).float().mean()
    assert same > 0.95  # fp32 KV-cache decode vs one packed forward: only near-ties may flip
    replayed = engine.forward([batch], LogProbRequest(record_routing=True, replay_routing=True))[
        0
    ].routed_experts
    assert torch.equal(replayed[fed], routed[fed])  # 100% of tokens and layers


def test_vllms_routed_experts_land_where_the_hf_rollout_records_them(moe_dir):
    """vLLM returns (S, L, K) per request for its S fed tokens (prompt, then every generated token
    but the last); aligned to the batch they give the HF rollout's (B, P + T, L, K) layout exactly."""
    path, _ = moe_dir
    tok = _tokenizer(path)
    out = _rollout(path, tok).generate_sequences(make_prompts(tok, TEXTS)).batch
    routed, P = out["routed_experts"], out["prompts"].shape[1]
    prompt_lens = out["attention_mask"][:, :P].sum(-1).tolist()
    fed_lens = [p + int(n) - 1 for p, n in zip(prompt_lens, out["response_mask"].sum(-1))]
    per_request = [
        routed[i, P - p : P - p + s].numpy() for i, (p, s) in enumerate(zip(prompt_lens, fed_lens))
    ]
    assert all((r >= 0).all() for r in per_request)
    got = vllm_routing.align_routed_experts(per_request, prompt_lens, P, T)
    got = got.masked_fill(~out["attention_mask"].bool()[..., None, None], -1)  # as the rollout base does
    assert torch.equal(got, routed)
    with pytest.raises(RuntimeError, match="no routed experts for rows \\[1\\]"):
        vllm_routing.routed_experts_of([SimpleNamespace(routed_experts=routed[0]), None], [[3], [4, 5]])
    with pytest.raises(NotImplementedError, match="enable_prefix_caching=true"):
        vllm_routing.engine_kwargs(enable_prefix_caching=False)
    assert vllm_routing.engine_kwargs(enable_prefix_caching=True) == {"enable_return_routed_experts": True}


def test_rollout_routing_replay_brings_training_log_probs_closer_to_the_rollouts(moe_dir):
    """The rollout in bf16, training in fp32: routers disagree on some tokens; R3 removes that part."""
    path, model = moe_dir
    tok = _tokenizer(path)
    out = _rollout(path, tok, dtype="bfloat16").generate_sequences(make_prompts(tok, TEXTS * 4)).batch
    batch = {
        k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "routed_experts")
    }
    engine = ModuleEngine(model, use_remove_padding=True)
    rmask = out["response_mask"].bool()
    fed = (out["routed_experts"] >= 0).all(-1).all(-1)
    rows = {}
    for replay in (False, True):
        res = engine.forward([batch], LogProbRequest(record_routing=True, replay_routing=replay))[0]
        dist = (res.log_probs - out["rollout_log_probs"]).abs()[rmask].mean()
        differ = (res.routed_experts[fed] != out["routed_experts"][fed]).any(-1).any(-1).float().mean()
        rows[replay] = (float(dist), float(differ))
    print(
        f"\n{type(model).__name__}: mean |log p_train - log p_rollout| without replay {rows[False][0]:.5f}, "
        f"with R3 {rows[True][0]:.5f}; tokens whose experts differ in >= 1 layer: {rows[False][1]:.1%} -> {rows[True][1]:.1%}"
    )
    assert rows[True][1] == 0.0
    assert rows[False][1] > 0.0
    assert rows[True][0] < rows[False][0]
