"""HFRollout on a tiny Qwen2: contract, EOS handling, weight sync, seeds, log-probs."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_testlib import EOS_ID, PAD_ID, make_prompts

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.rollout.hf import HFRollout
from hybridrl.weight_sync import sync_weights

TEXTS = ["12+34=", "7+1=", "abc", "9"]
T = 10


def _cfg(**kw):
    base = dict(name="hf", dtype="float32", prompt_length=8, response_length=T, load_format="dummy")
    base.update(kw)
    return RolloutConfig(**base)


def _synced(tiny_model_dir, tokenizer, source_model, **kw):
    rollout = create_rollout(_cfg(**kw), tiny_model_dir, tokenizer, device="cpu")
    sync_weights(rollout, source_model.state_dict().items())
    return rollout


def _reference_greedy(model, tokenizer, texts, max_new_tokens, eos=EOS_ID):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD_ID, eos_token_id=eos
    )
    return out[:, enc["input_ids"].shape[1] :]


def _recomputed_log_probs(model, out, temperature):
    """log_softmax(logits / temperature) of each response token, by one forward pass."""
    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits
    P = out.batch["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, P - 1 : -1].float() / temperature, dim=-1)
    return lp.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_dir, tokenizer, source_model):
    return _synced(tiny_model_dir, tokenizer, source_model, calculate_log_probs=True)


def test_output_contract_shapes_masks_positions(hf_rollout, tokenizer):
    prompts = make_prompts(tokenizer, TEXTS, {"validate": True})
    out = hf_rollout.generate_sequences(prompts)
    b = out.batch
    P = prompts.batch["input_ids"].shape[1]
    assert b["responses"].shape == (4, T) and b["input_ids"].shape == (4, P + T)
    assert torch.equal(b["prompts"], prompts.batch["input_ids"])
    assert torch.equal(b["input_ids"][:, P:], b["responses"])
    assert torch.equal(
        b["attention_mask"], torch.cat([prompts.batch["attention_mask"], b["response_mask"]], 1)
    )
    # response positions continue from the last prompt position, one per step
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(b["position_ids"][:, P:], last + torch.arange(1, T + 1))
    # row 3 ("9") is a 1-token prompt padded on the left: its first response position is 1
    assert b["position_ids"][3, P].item() == 1
    # the mask is a prefix of ones; padding after it is the pad id
    for row, m in zip(b["responses"], b["response_mask"]):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        assert (row[n:] == PAD_ID).all()
    assert list(out.non_tensor_batch["raw_prompt"]) == TEXTS
    assert out.meta_info["metrics"]["rollout/num_response_tokens"] == int(b["response_mask"].sum())


def test_eos_cuts_the_response_and_is_kept(tiny_model_dir, tokenizer, source_model):
    free = _synced(tiny_model_dir, tokenizer, source_model, ignore_eos=True)
    prompts = make_prompts(tokenizer, TEXTS[:2], {"validate": True})
    unstopped = free.generate_sequences(prompts).batch["responses"]
    assert unstopped.shape == (2, T)  # ignore_eos: every row runs the full budget
    # Make the 3rd greedy token of row 0 an EOS (if it does not occur earlier in the row).
    stop_tok = int(unstopped[0, 2])
    assert stop_tok not in unstopped[0, :2].tolist()
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = tok.convert_ids_to_tokens(stop_tok)
    stopping = HFRollout(_cfg(), tiny_model_dir, tok, device="cpu")
    sync_weights(stopping, source_model.state_dict().items())
    assert set(stopping.eos_token_ids) == {stop_tok, EOS_ID}
    b = stopping.generate_sequences(prompts).batch
    expected_rows = []
    for row in unstopped.tolist():  # hand rule: keep tokens up to and including the first EOS
        cut = next((j + 1 for j, t in enumerate(row) if t in (stop_tok, EOS_ID)), T)
        expected_rows.append(row[:cut] + [PAD_ID] * (T - cut))
    assert b["responses"].tolist() == expected_rows
    assert b["response_mask"][0].tolist() == [1, 1, 1] + [0] * (T - 3)


def test_greedy_after_sync_equals_source_generate(hf_rollout, tokenizer, source_model):
    out = hf_rollout.generate_sequences(make_prompts(tokenizer, TEXTS, {"validate": True}))
    ref = _reference_greedy(source_model, tokenizer, TEXTS, T)
    for got, want, m in zip(out.batch["responses"], ref, out.batch["response_mask"]):
        n = int(m.sum())
        assert got[:n].tolist() == want[:n].tolist()


def test_dummy_rollout_differs_before_sync(tiny_model_dir, tokenizer, source_model):
    torch.manual_seed(5)
    raw = create_rollout(_cfg(), tiny_model_dir, tokenizer, device="cpu")
    prompts = make_prompts(tokenizer, TEXTS, {"validate": True})
    before = raw.generate_sequences(prompts).batch["responses"]
    metrics = sync_weights(raw, source_model.state_dict().items(), bucket_megabytes=0.001)
    after = raw.generate_sequences(prompts).batch["responses"]
    assert not torch.equal(before, after)
    # ~1 KiB buckets: every tensor of the state dict is sent, in many buckets
    assert metrics["weight_sync/num_tensors"] == len(source_model.state_dict())
    assert metrics["weight_sync/num_buckets"] > 10
    ref = _reference_greedy(source_model, tokenizer, TEXTS, T)
    b = raw.generate_sequences(prompts).batch
    for got, want, m in zip(b["responses"], ref, b["response_mask"]):
        assert got[: int(m.sum())].tolist() == want[: int(m.sum())].tolist()


def test_seeded_sampling_is_reproducible(tiny_model_dir, tokenizer, source_model):
    prompts = make_prompts(tokenizer, TEXTS)
    r1 = _synced(tiny_model_dir, tokenizer, source_model, seed=3)
    r2 = _synced(tiny_model_dir, tokenizer, source_model, seed=3)
    r3 = _synced(tiny_model_dir, tokenizer, source_model, seed=4)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a1, a2 = r1.generate_sequences(prompts), r1.generate_sequences(prompts)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    b1 = r2.generate_sequences(prompts)
    c1 = r3.generate_sequences(prompts)
    assert torch.equal(a1.batch["responses"], b1.batch["responses"])
    assert not torch.equal(a1.batch["responses"], a2.batch["responses"])  # next call, new seeds
    assert not torch.equal(a1.batch["responses"], c1.batch["responses"])


def test_greedy_meta_flag_forces_greedy(hf_rollout, tokenizer, source_model):
    ref = hf_rollout.generate_sequences(make_prompts(tokenizer, TEXTS, {"validate": True})).batch["responses"]
    for meta in ({"greedy": True}, {"do_sample": False}):  # hybridrl's flag and veRL's
        out = hf_rollout.generate_sequences(make_prompts(tokenizer, TEXTS, meta))
        assert torch.equal(out.batch["responses"], ref)
    sampled = hf_rollout.generate_sequences(make_prompts(tokenizer, TEXTS)).batch["responses"]
    assert not torch.equal(sampled, ref)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_a_forward_pass(tiny_model_dir, tokenizer, source_model, temperature):
    rollout = _synced(
        tiny_model_dir, tokenizer, source_model, calculate_log_probs=True, temperature=temperature
    )
    out = rollout.generate_sequences(make_prompts(tokenizer, TEXTS))
    mask = out.batch["response_mask"].bool()
    want = _recomputed_log_probs(source_model, out, temperature)
    got = out.batch["rollout_log_probs"]
    torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=1e-4)
    assert (got[~mask] == 0).all()


def test_greedy_log_probs_use_temperature_one(hf_rollout, tokenizer, source_model):
    out = hf_rollout.generate_sequences(make_prompts(tokenizer, TEXTS, {"validate": True}))
    mask = out.batch["response_mask"].bool()
    want = _recomputed_log_probs(source_model, out, 1.0)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], want[mask], atol=1e-4, rtol=1e-4)


def test_micro_batches_give_the_same_greedy_output(tiny_model_dir, tokenizer, source_model, hf_rollout):
    prompts = make_prompts(tokenizer, TEXTS, {"validate": True})
    small = _synced(tiny_model_dir, tokenizer, source_model, log_prob_micro_batch_size_per_gpu=1)
    assert small._rows_per_micro_batch(8) == 1
    assert torch.equal(
        small.generate_sequences(prompts).batch["responses"],
        hf_rollout.generate_sequences(prompts).batch["responses"],
    )
    dyn = HFRollout(
        _cfg(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=40), tiny_model_dir, tokenizer
    )
    assert dyn._rows_per_micro_batch(10) == 2  # 40 // (10 + T)


def test_update_weights_rejects_unknown_names_and_shapes(hf_rollout):
    with pytest.raises(KeyError, match="no weight named 'model.nope.weight'"):
        hf_rollout.update_weights([("model.nope.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape"):
        hf_rollout.update_weights([("model.norm.weight", torch.zeros(3))])


def test_update_weights_accepts_wrapped_names_and_tied_heads(tiny_model_dir, tokenizer, source_model):
    rollout = create_rollout(_cfg(), tiny_model_dir, tokenizer, device="cpu")
    assert rollout.tied_embeddings
    # named_parameters(): tied lm_head appears once; names carry a torch.compile prefix
    stream = (("_orig_mod." + n, p) for n, p in source_model.named_parameters())
    sync_weights(rollout, stream)
    for name, p in source_model.state_dict().items():
        assert torch.equal(rollout.model.state_dict()[name], p), name


def test_ignore_eos_runs_every_row_to_the_limit_with_a_model_that_stops():
    """The built-in model answers in ~9 tokens then emits EOS; ignore_eos must not stop there."""
    from transformers import AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path

    path = get_builtin_model_path()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("12+34=", "50+7=")
    ]
    prompts = make_prompts(tok, texts, {"validate": True})
    limit = 20
    stopping = create_rollout(
        _cfg(prompt_length=16, response_length=limit, load_format="auto"), path, tok, device="cpu"
    )
    lengths = stopping.generate_sequences(prompts).batch["response_mask"].sum(-1)
    assert (lengths < limit).all(), lengths  # the model does stop at EOS on its own
    free = create_rollout(
        _cfg(prompt_length=16, response_length=limit, load_format="auto", ignore_eos=True),
        path,
        tok,
        device="cpu",
    )
    assert (free.generate_sequences(prompts).batch["response_mask"].sum(-1) == limit).all()


def test_checkpoint_engine_bucket_size_and_layered_summon_shape_the_sync(
    tiny_model_dir, tokenizer, source_model
):
    """veRL's rollout.checkpoint_engine.update_weights_bucket_megabytes and rollout.layered_summon."""
    state = source_model.state_dict()
    prompts = make_prompts(tokenizer, TEXTS, {"validate": True})

    def sync(**kw):
        rollout = create_rollout(_cfg(**kw), tiny_model_dir, tokenizer, device="cpu")
        metrics = sync_weights(rollout, state.items())
        return metrics, rollout.generate_sequences(prompts).batch["responses"]

    whole, ref = sync()
    small, out_small = sync(checkpoint_engine={"update_weights_bucket_megabytes": 1})
    layered, out_layered = sync(layered_summon=True)
    assert whole["weight_sync/bytes"] > 2**20  # the model is bigger than one 1 MiB bucket
    assert whole["weight_sync/num_buckets"] == 1
    assert small["weight_sync/num_buckets"] >= 2 and small["weight_sync/max_bucket_bytes"] <= 2**20
    assert layered["weight_sync/num_buckets"] >= 3  # embeddings | layer 0 | layer 1 (+ final norm)
    assert torch.equal(out_small, ref) and torch.equal(out_layered, ref)  # same weights arrived
