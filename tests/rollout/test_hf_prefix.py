"""Shared-prompt prefill of the HF rollout (rollout/hf_prefix.py): equal to the plain
prefill, and really run once per distinct prompt."""

from __future__ import annotations

import pytest
import torch
from rollout_testlib import make_prompts

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.rollout.hf_prefix import distinct_rows, shared_prefill
from hybridrl.weight_sync import sync_weights

# GRPO's layout: each prompt repeated n = 3 times, rows of different lengths (left padding)
GROUPED = [t for t in ["12+34=", "7+1=", "abc+de"] for _ in range(3)]
T = 12


def _rollout(tiny_model_dir, tokenizer, source_model, share: bool, **kw):
    cfg = RolloutConfig(
        name="hf", dtype="float32", prompt_length=8, response_length=T, load_format="dummy",
        enable_prefix_caching=share, calculate_log_probs=True, **kw,
    )  # fmt: skip
    rollout = create_rollout(cfg, tiny_model_dir, tokenizer, device="cpu")
    sync_weights(rollout, source_model.state_dict().items())
    return rollout


def _count_prefill_rows(model):
    """A forward pre-hook recording the batch size and length of every forward call."""
    calls: list[tuple[int, int]] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None:
            calls.append(tuple(ids.shape))

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_distinct_rows_keeps_first_appearance_order():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [1, 2, 3], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    first, inverse = distinct_rows(ids, mask)
    assert first.tolist() == [0, 1, 4]
    assert inverse.tolist() == [0, 1, 0, 1, 2]
    # the same ids under another mask are another row
    mask2 = mask.clone()
    mask2[2, 0] = 1
    assert distinct_rows(ids, mask2)[0].tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prefill_equals_plain_generate(tiny_model_dir, tokenizer, source_model, greedy):
    plain = _rollout(tiny_model_dir, tokenizer, source_model, share=False)
    shared = _rollout(tiny_model_dir, tokenizer, source_model, share=True)
    meta = {"validate": True} if greedy else {}
    outs = []
    for rollout in (plain, shared):
        calls, handle = _count_prefill_rows(rollout.model)
        try:
            outs.append(rollout.generate_sequences(make_prompts(tokenizer, GROUPED, dict(meta))))
        finally:
            handle.remove()
        outs[-1].meta_info["calls"] = calls
    a, b = outs
    P = a.batch["prompts"].shape[1]
    # plain: the first forward is the 9-row prefill over all P positions; shared: 3 distinct rows
    # over P - 1 positions, then generate's first forward runs the last prompt position only
    assert a.meta_info["calls"][0] == (9, P)
    assert b.meta_info["calls"][0] == (3, P - 1) and b.meta_info["calls"][1] == (9, 1)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["response_mask"], b.batch["response_mask"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_no_sharing_without_repeats_or_for_one_token_prompts(tiny_model_dir, tokenizer, source_model):
    rollout = _rollout(tiny_model_dir, tokenizer, source_model, share=True)
    enc = tokenizer(["12+34=", "7+1=", "abc"], return_tensors="pt", padding=True)
    assert shared_prefill(rollout.model, enc["input_ids"], enc["attention_mask"]) is None
    # a repeated 1-token prompt: its first P - 1 positions are padding only
    enc = tokenizer(["9", "9", "12+34="], return_tensors="pt", padding=True)
    assert shared_prefill(rollout.model, enc["input_ids"], enc["attention_mask"]) is None
    enc = tokenizer(["9", "9"], return_tensors="pt", padding=True)
    assert shared_prefill(rollout.model, enc["input_ids"], enc["attention_mask"]) is None


# ------------------------------------------------------------------ inverse-CDF sampling (cpu/sampler.py)


def test_inverse_cdf_draws_the_distribution_and_never_a_zero_probability_token():
    from hybridrl.cpu.sampler import sample_inverse_cdf

    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    torch.manual_seed(0)
    draws = sample_inverse_cdf(probs.expand(200_000, -1))[:, 0]
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    assert freq[1] == 0 and freq[4] == 0
    # binomial standard error at n = 2e5 is ~1.1e-3: 5 sigma
    torch.testing.assert_close(freq, probs.double(), atol=6e-3, rtol=0)
    # unnormalised rows (top-k / top-p leave zeros; float rounding leaves a sum != 1)
    torch.manual_seed(0)
    again = sample_inverse_cdf((probs * 7).expand(200_000, -1))[:, 0]
    assert torch.equal(again, draws)


def test_inverse_cdf_sampler_rollout_log_probs_and_warps(tiny_model_dir, tokenizer, source_model):
    """Forced on (the tiny vocabulary is below auto's threshold): reproducible from the seed, the
    recorded log-probs are the warped distribution's at the drawn tokens (a recompute), top-k
    keeps every draw among the k best, and the sampled distribution matches multinomial's."""
    kw = dict(temperature=0.7, top_k=5)
    fast = _rollout(tiny_model_dir, tokenizer, source_model, share=True, hf_sampler="inverse_cdf", **kw)
    assert fast.inverse_cdf
    slow = _rollout(tiny_model_dir, tokenizer, source_model, share=True, hf_sampler="multinomial", **kw)
    assert not slow.inverse_cdf
    prompts = make_prompts(tokenizer, GROUPED * 4)
    a = fast.generate_sequences(prompts)
    b = fast.generate_sequences(make_prompts(tokenizer, GROUPED * 4, {"seed_index": 0}))
    assert torch.equal(a.batch["responses"], b.batch["responses"])  # the seed decides
    # recompute: log softmax(top-5(logits / 0.7)) at each drawn token
    with torch.no_grad():
        logits = source_model(
            input_ids=a.batch["input_ids"], attention_mask=a.batch["attention_mask"],
            position_ids=a.batch["position_ids"],
        ).logits  # fmt: skip
    P = a.batch["prompts"].shape[1]
    z = logits[:, P - 1 : -1].float() / 0.7
    kth = z.topk(5, dim=-1).values[..., -1:]
    z = z.masked_fill(z < kth, float("-inf"))
    want = torch.log_softmax(z, dim=-1).gather(-1, a.batch["responses"].unsqueeze(-1)).squeeze(-1)
    m = a.batch["response_mask"].bool()
    assert torch.isfinite(want[m]).all()  # every draw is among the top 5
    torch.testing.assert_close(a.batch["rollout_log_probs"][m], want[m], atol=1e-4, rtol=0)
    # same distribution as multinomial: mean log-prob of the draws agree (36 x 12 tokens each)
    c = slow.generate_sequences(prompts)
    mc = c.batch["response_mask"].bool()
    assert abs(a.batch["rollout_log_probs"][m].mean() - c.batch["rollout_log_probs"][mc].mean()) < 0.15


def test_hf_sampler_auto_follows_the_vocabulary_and_bad_values_are_refused():
    from hybridrl.cpu.sampler import INVERSE_CDF_MIN_VOCAB, use_inverse_cdf

    assert use_inverse_cdf("auto", INVERSE_CDF_MIN_VOCAB) and not use_inverse_cdf("auto", 103)
    assert use_inverse_cdf("inverse_cdf", 10) and not use_inverse_cdf("multinomial", 10**6)
    with pytest.raises(ValueError, match="hf_sampler"):
        RolloutConfig(name="hf", hf_sampler="gumbel")
