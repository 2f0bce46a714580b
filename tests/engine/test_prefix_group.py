"""`actor.use_prefix_grouper`: rows with the same prompt share one forward of it.

The grouped forward must give what the plain forward gives, row by row: log-probs, entropy,
sum_pi^2 and the gradients of every parameter (fp32), for the chunked head and the full-logits
head, with temperature, padded prompts of several lengths, responses of several lengths (one
empty), groups of unequal size, and a GQA model with q/k/v biases. And it must run fewer tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hybridrl.engine.forward as forward
from hybridrl.engine.prefix_group import ATTN_NAME, build_prefix_layout
from tests.fsdp_testkit import VOCAB, count_calls


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def grouped_batch(group_sizes=(3, 1, 2), prompt_len=7, response_len=6, seed=0):
    """veRL layout with repeated prompts: group g's rows share one left-padded prompt; the
    responses are right-padded to different lengths (the last row of group 0 is empty)."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for gi, n in enumerate(group_sizes):
        pad = gi % (prompt_len - 2)
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g)
        p_mask = torch.ones(prompt_len, dtype=torch.long)
        p_mask[:pad] = 0
        for r in range(n):
            resp = torch.randint(3, VOCAB, (response_len,), generator=g)
            length = (
                0 if (gi == 0 and r == n - 1) else int(torch.randint(1, response_len + 1, (1,), generator=g))
            )
            r_mask = torch.zeros(response_len, dtype=torch.long)
            r_mask[:length] = 1
            ids.append(torch.cat([prompt * p_mask, resp * r_mask]))
            masks.append(torch.cat([p_mask, r_mask]))
    input_ids, attention_mask = torch.stack(ids), torch.stack(masks)
    perm = torch.tensor([0, 3, 1, 4, 2, 5])[: len(ids)]  # interleave the groups
    input_ids, attention_mask = input_ids[perm], attention_mask[perm]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, -response_len:],
        "response_mask": attention_mask[:, -response_len:],
    }


def run(model, batch, *, grouped, fused, grad=True):
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        _res = forward.forward_log_probs(
            model,
            batch,
            temperature=0.7,
            use_remove_padding=True,
            calculate_entropy=True,
            calculate_sum_pi_squared=True,
            fused=fused,
            prefix_group=grouped,
        )
        lp, ent, sps = _res.log_probs, _res.entropy, _res.sum_pi_squared
    mask = batch["response_mask"].bool()
    grads = {}
    if grad:
        ((lp + 0.1 * ent) * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp[mask], ent[mask], sps[mask], grads


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_forward_equals_the_plain_one_with_gradients(model, fused):
    batch = grouped_batch()
    plain = run(model, batch, grouped=False, fused=fused)
    grouped = run(model, batch, grouped=True, fused=fused)
    for a, b in zip(plain[:3], grouped[:3]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert plain[3].keys() == grouped[3].keys() and len(plain[3]) > 5
    for name in plain[3]:
        torch.testing.assert_close(grouped[3][name], plain[3][name], atol=1e-5, rtol=1e-4, msg=name)
    assert model.config._attn_implementation != ATTN_NAME  # restored after the forward


def test_compiled_layers_take_the_grouped_forward(model):
    """`fsdp_config.compile_layers` with the shared-prompt forward: the grouped attention runs
    eagerly between the compiled halves of each layer, so new layouts reuse the same graphs
    (traced, it compiled again for every layout until dynamo gave the layer back to eager), and
    the numbers are eager's."""
    pytest.importorskip("torch._inductor")
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    compiled = copy.deepcopy(model)
    for layer in compiled.model.layers:
        layer.compile(dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    layouts = [
        dict(group_sizes=(3, 1, 2), response_len=6, seed=0),
        dict(group_sizes=(2, 2, 2), response_len=8, seed=5),
        dict(group_sizes=(1, 3, 2), prompt_len=9, response_len=5, seed=7),
    ]
    for kw in layouts:
        batch = grouped_batch(**kw)
        for grad in (False, True):
            want = run(model, batch, grouped=True, fused=True, grad=grad)
            got = run(compiled, batch, grouped=True, fused=True, grad=grad)
            for a, b in zip(want[:3], got[:3]):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
            assert got[3].keys() == want[3].keys()
            for name in want[3]:
                torch.testing.assert_close(got[3][name], want[3][name], atol=1e-5, rtol=1e-4, msg=name)
    # per layer: the part before and the part after the attention, with and without grad
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 4 * len(compiled.model.layers), f"{graphs} graphs: the layers recompile per layout"


def test_no_shared_prompt_is_the_packed_forward(model):
    from tests.fsdp_testkit import make_batch

    batch = make_batch(4, prompt_len=6, response_len=5, seed=2)  # four different prompts
    plain = run(model, batch, grouped=False, fused=True, grad=False)
    grouped = run(model, batch, grouped=True, fused=True, grad=False)
    for a, b in zip(plain[:3], grouped[:3]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_layout_counts_each_prompt_once():
    batch = grouped_batch(group_sizes=(3, 1, 2))
    layout = build_prefix_layout(batch["input_ids"], batch["attention_mask"], t=6)
    assert layout.num_groups == 3
    mask = batch["attention_mask"]
    prompt_tokens = mask[:, :7].sum(-1)  # per row
    # three prompt segments, each followed by its rows' responses (one of them empty)
    prompts = [i for i, p in enumerate(layout.prompt_of) if p < 0]
    assert len(prompts) == 3 and len(layout.lengths) == 3 + 6
    assert sorted(layout.lengths[i] for i in prompts) == sorted({int(n) for n in prompt_tokens})
    responses = sorted(n for n, p in zip(layout.lengths, layout.prompt_of) if p >= 0)
    assert responses == sorted(int(n) for n in mask[:, 7:].sum(-1))
    assert layout.num_tokens == layout.input_ids.shape[-1] < int(mask.sum())
    assert layout.pred.numel() == int(mask[:, 7:].sum())


def test_grouped_work_counts_each_prompt_once_by_hand(model):
    """The FLOP count of the shared-prompt forward (utils/flops.grouped_work, `LogProbs.work`): per
    group p prompt tokens once, and per response n tokens attending to p + n, by hand."""
    from hybridrl.utils.flops import grouped_work

    batch = grouped_batch(group_sizes=(3, 1, 2))
    mask = batch["attention_mask"]
    want_tokens, want_squares, seen = 0, 0, set()
    for row in range(mask.shape[0]):
        p, n = int(mask[row, :7].sum()), int(mask[row, 7:].sum())
        key = tuple(batch["input_ids"][row, :7].tolist())
        if key not in seen:  # the group's prompt, once
            seen.add(key)
            want_tokens, want_squares = want_tokens + p, want_squares + p * p
        want_tokens, want_squares = want_tokens + n, want_squares + 2 * p * n + n * n
    layout = build_prefix_layout(batch["input_ids"], batch["attention_mask"], t=6)
    assert grouped_work(layout.lengths, layout.prompt_of) == (want_tokens, want_squares)
    assert want_tokens < int(mask.sum())  # fewer than one sequence per row
    kw = dict(temperature=1.0, use_remove_padding=True, fused=True)
    with torch.no_grad():
        grouped = forward.forward_log_probs(model, batch, prefix_group=True, **kw)
        plain = forward.forward_log_probs(model, batch, prefix_group=False, **kw)
    assert grouped.work == (want_tokens, want_squares) and plain.work is None


def test_update_perf_counts_what_the_forwards_report():
    from hybridrl.engine.base import LogProbs, PerfModel
    from hybridrl.engine.update_loop import UpdatePerf
    from hybridrl.utils.flops import compute_mfu, estimate_flops, work_flops

    class Engine:
        def perf_model(self):
            return PerfModel(num_params=1000, num_layers=2, attn_dim=8, ranks_per_sample=1)

    perf = UpdatePerf("actor", Engine(), peak_flops=1e6)
    lp = torch.zeros(1, 1)
    perf.record(LogProbs(lp))  # a plain forward reports nothing
    plain = perf.metrics([10, 12], 1.0)
    assert plain["perf/mfu/actor"] == compute_mfu(estimate_flops(1000, [10, 12], 2, 8), 1.0, 1e6)
    perf.record(LogProbs(lp, work=(7, 30)))
    perf.record(LogProbs(lp, work=(8, 40)))
    got = perf.metrics([10, 12], 1.0)
    assert got["perf/mfu/actor"] == compute_mfu(work_flops(1000, 15, 70, 2, 8), 1.0, 1e6)
    assert got["perf/actor/tokens"] == 22.0  # the rows' tokens, as before
    assert perf.metrics([10, 12], 1.0) == plain  # the record is per update call


def test_refused_with_sequence_parallelism(model):
    from hybridrl.engine.ulysses import SPGroup

    with pytest.raises(ValueError, match="use_prefix_grouper does not combine with Ulysses"):
        forward.forward_log_probs(model, grouped_batch(), prefix_group=True, sp=SPGroup(None, 0, 2))


# ---- the plain packed path (use_remove_padding) attends sequence by sequence --------------------
@pytest.fixture
def attention_calls(monkeypatch):
    """Counts the calls of the grouped attention (the real function runs)."""
    import hybridrl.engine.prefix_group as pg

    return count_calls(monkeypatch, pg, "grouped_attention")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_forward_attends_per_sequence_and_equals_the_padded_one(model, impl, attention_calls):
    from tests.fsdp_testkit import make_batch

    model.config._attn_implementation = impl
    try:
        batch = make_batch(5, prompt_len=7, response_len=6, seed=4)
        outs = {}
        for packed in (False, True):
            model.zero_grad()
            _res = forward.forward_log_probs(model, batch, use_remove_padding=packed, calculate_entropy=True)
            lp, ent = _res.log_probs, _res.entropy
            mask = batch["response_mask"].bool()
            ((lp + 0.1 * ent) * mask).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            outs[packed] = (lp[mask], ent[mask], grads)
            assert (attention_calls["calls"] > 0) == packed  # the packed row went through it
    finally:
        model.config._attn_implementation = "sdpa"
    for a, b in zip(outs[False][:2], outs[True][:2]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for name, g in outs[False][2].items():
        torch.testing.assert_close(outs[True][2][name], g, atol=1e-5, rtol=1e-4, msg=name)


class DropsKwargs(torch.nn.Module):
    """A causal LM whose forward does not pass extra keyword arguments on (as some remote-code
    models): the packed path falls back to transformers' block-diagonal mask."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, use_cache=False, **_):
        return self.inner(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=use_cache
        )


def test_packed_forward_of_a_model_that_drops_kwargs_falls_back(model):
    from tests.fsdp_testkit import make_batch

    batch = make_batch(3, seed=6)
    wrapped = DropsKwargs(model)
    lp_packed = forward.forward_log_probs(wrapped, batch, use_remove_padding=True, fused=False).log_probs
    lp_padded = forward.forward_log_probs(wrapped, batch, use_remove_padding=False, fused=False).log_probs
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(lp_packed[mask], lp_padded[mask], atol=1e-5, rtol=1e-5)
    assert DropsKwargs in forward._NO_SEQUENCE_WISE
    with pytest.raises(RuntimeError, match="set actor.use_prefix_grouper=false"):
        forward.forward_log_probs(wrapped, grouped_batch(), prefix_group=True, fused=False)


def test_grouped_forward_of_a_lora_model_matches_the_plain_one(model):
    """`auto` turns the grouper on for LoRA runs too: a peft-wrapped model, same log-probs and LoRA grads."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )
    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    results = {}
    for grouped in (False, True):
        lora.zero_grad(set_to_none=True)
        lp = forward.forward_log_probs(lora, batch, prefix_group=grouped, fused=False).log_probs[mask]
        lp.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in lora.parameters() if p.grad is not None])
        results[grouped] = (lp.detach(), grads)
    assert results[True][1].numel() > 0
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)


def test_grouped_scores_equal_the_plain_ones_with_gradients():
    """A reward model's scores (the head at each row's last token) through the shared-prompt row
    equal the padded forward's, and so do their gradients; a row without a response token is refused."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(1)
    rm = AutoModelForTokenClassification.from_config(cfg).float().eval()  # no dropout before the head
    batch = grouped_batch(group_sizes=(2, 2, 2))
    keep = batch["response_mask"].sum(-1) > 0
    batch = {k: v[keep] for k, v in batch.items()}
    weight = torch.linspace(-1, 1, int(keep.sum()))
    results = []
    for grouped in (False, True):
        rm.zero_grad()
        scores = forward.forward_scores(rm, batch, use_remove_padding=not grouped, prefix_group=grouped)
        (scores * weight).sum().backward()
        results.append((scores.detach(), {n: p.grad.clone() for n, p in rm.named_parameters()}))
    (plain, g_plain), (grouped, g_grouped) = results
    assert plain.abs().min() > 0 and plain.std() > 0
    torch.testing.assert_close(grouped, plain, atol=1e-5, rtol=1e-5)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_grouped[name], g, atol=1e-5, rtol=1e-4, msg=name)
    empty = grouped_batch(group_sizes=(2, 2, 2))  # the last row of group 0 has no response
    with pytest.raises(ValueError, match="no valid response token"):
        forward.forward_scores(rm, empty, prefix_group=True)


def loop_layout(input_ids, attention_mask, t, row_keys=None):
    """The layout built row by row (the reference the vectorised `build_prefix_layout` must equal)."""
    from hybridrl.engine.prefix_group import PrefixGroupLayout

    b, s = input_ids.shape
    p = s - t
    dev = input_ids.device
    mask = attention_mask.bool()
    if bool((mask[:, :p].sum(-1) == 0).any()):
        raise ValueError("a row has an empty prompt (attention_mask all 0 over the prompt); drop it first")
    prompt_key = torch.where(mask[:, :p], input_ids[:, :p], -1)
    _, inverse = torch.unique(prompt_key, dim=0, return_inverse=True)
    groups: dict[Any, list[int]] = {}
    for row, key in enumerate(inverse.tolist()):
        key = key if row_keys is None else (key, row_keys[row])
        groups.setdefault(key, []).append(row)  # dicts keep the order of first appearance

    where = torch.full((b, s), -1, dtype=torch.long, device=dev)  # (row, column) -> packed index
    ids, pos, lengths, prompt_of, seg_rows, source = [], [], [], [], [], []
    cursor = 0
    for rows in groups.values():
        cols = mask[rows[0], :p].nonzero().squeeze(-1)
        source.append(rows[0] * s + cols)
        lp = cols.numel()
        where[torch.tensor(rows, device=dev)[:, None], cols[None]] = torch.arange(
            cursor, cursor + lp, device=dev
        )
        ids.append(input_ids[rows[0], cols])
        pos.append(torch.arange(lp, device=dev))
        prompt_seg = len(lengths)
        lengths.append(lp)
        prompt_of.append(-1)
        seg_rows.append(rows[0])
        cursor += lp
        for row in rows:
            rcols = mask[row, p:].nonzero().squeeze(-1)
            n = rcols.numel()
            where[row, p + rcols] = torch.arange(cursor, cursor + n, device=dev)
            ids.append(input_ids[row, p + rcols])
            pos.append(lp + torch.arange(n, device=dev))
            lengths.append(n)
            prompt_of.append(prompt_seg)
            seg_rows.append(row)
            source.append(row * s + p + rcols)
            cursor += n
    pred = where[:, -t - 1 : -1]
    valid = mask[:, -t:] & (pred >= 0)
    flat = valid.reshape(-1).nonzero().squeeze(-1)
    return PrefixGroupLayout(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        lengths=lengths,
        prompt_of=prompt_of,
        pred=pred.reshape(-1)[flat],
        flat=flat,
        num_groups=len(groups),
        rows=seg_rows,
        source=torch.cat(source),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("keys", [False, True])
def test_vectorised_layout_equals_the_row_by_row_one(seed, keys):
    g = torch.Generator().manual_seed(seed)
    batch = grouped_batch(group_sizes=(3, 1, 2), seed=seed)
    ids, mask = batch["input_ids"], batch["attention_mask"].clone()
    if seed == 2:  # a hole inside a prompt and a response
        mask[1, 3] = 0
        mask[2, -4] = 0
    row_keys = [int(x) for x in torch.randint(0, 2, (ids.shape[0],), generator=g)] if keys else None
    t = batch["responses"].shape[-1]
    got, want = build_prefix_layout(ids, mask, t, row_keys=row_keys), loop_layout(ids, mask, t, row_keys)
    for name in ("input_ids", "position_ids", "pred", "flat", "source"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("lengths", "prompt_of", "num_groups", "rows"):
        assert getattr(got, name) == getattr(want, name), name
