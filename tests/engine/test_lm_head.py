"""The chunked vocabulary head equals the plain one: log-probs, entropy and gradients (fp32, 1e-6).

`linear_log_probs` against log_softmax over full logits; `forward_log_probs` / `forward_values`
with the head swapped (fused) against the plain full-logits path, padded and packed, with a
temperature, tied embeddings, LoRA, and under FSDP2 on two ranks.
"""

import os
import sys

import pytest
import torch
from tensordict import TensorDict
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

from hybridrl.config.roles import FSDPConfig, ModelConfig  # noqa: E402
from hybridrl.engine import forward  # noqa: E402
from hybridrl.engine.fsdp import FSDPEngine  # noqa: E402
from hybridrl.engine.lm_head import default_chunk_rows, linear_log_probs  # noqa: E402
from hybridrl.models.hf import build_hf_model  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def _td(batch):
    return TensorDict(batch, batch_size=[batch["input_ids"].shape[0]])


def _plain(hidden, weight, bias, labels, temperature):
    """The plain full-logits path (float32)."""
    logits = (hidden @ weight.T + bias) / temperature
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, labels[:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def _leaves(seed, n=37, h=16, v=50):
    g = torch.Generator().manual_seed(seed)
    hidden = (0.5 * torch.randn(n, h, generator=g)).requires_grad_()  # logits of O(1), as in a model
    weight = (0.5 * torch.randn(v, h, generator=g)).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    # per-token loss weights of a token-mean loss: O(1 / n)
    w_lp, w_ent = torch.randn(n, generator=g) / n, torch.randn(n, generator=g) / n
    return hidden, weight, bias, labels, w_lp, w_ent


@pytest.mark.parametrize("keep", [0, 2**30], ids=["recompute", "keep_logits"])
@pytest.mark.parametrize("chunk_rows", [5, 37, 1000])
def test_linear_log_probs_matches_log_softmax(chunk_rows, keep):
    hidden, weight, bias, labels, w_lp, w_ent = _leaves(0)
    lp, ent = linear_log_probs(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=0.7,
        calculate_entropy=True,
        chunk_rows=chunk_rows,
        keep_logits_bytes=keep,
    )
    grads = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), (hidden, weight, bias))
    lp_ref, ent_ref = _plain(hidden, weight, bias, labels, 0.7)
    grads_ref = torch.autograd.grad((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum(), (hidden, weight, bias))
    torch.testing.assert_close(lp, lp_ref, **TOL)
    torch.testing.assert_close(ent, ent_ref, **TOL)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, **TOL)


def test_linear_log_probs_entropy_without_grad_and_frozen_weight():
    hidden, weight, bias, labels, w_lp, _ = _leaves(1)
    weight.requires_grad_(False)
    lp, ent = linear_log_probs(
        hidden, weight, labels, calculate_entropy=True, entropy_grad=False, chunk_rows=8
    )
    assert not ent.requires_grad and lp.requires_grad
    (g_h,) = torch.autograd.grad((lp * w_lp).sum(), (hidden,))
    lp_ref, _ = _plain(hidden, weight, torch.zeros(50), labels, 1.0)
    (g_ref,) = torch.autograd.grad((lp_ref * w_lp).sum(), (hidden,))
    torch.testing.assert_close(g_h, g_ref, **TOL)
    assert linear_log_probs(hidden, weight, labels)[1] is None
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_log_probs(hidden, weight, labels, temperature=0)
    with pytest.raises(ValueError, match="labels must be"):
        linear_log_probs(hidden, weight, labels[:3])
    assert default_chunk_rows(32768) == 512 and default_chunk_rows(10**9) == 16


def _loss_and_grads(model, batch, fused, rmpad, calculate_entropy=True):
    model.zero_grad(set_to_none=True)
    _res = forward.forward_log_probs(
        model,
        batch,
        temperature=0.7,
        use_remove_padding=rmpad,
        calculate_entropy=calculate_entropy,
        fused=fused,
    )
    lp, ent = _res.log_probs, _res.entropy
    mask = batch["response_mask"].float()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(mask.shape, generator=g) / mask.sum()  # a token-mean loss with random signs
    loss = (lp * w * mask).sum() + ((ent * mask).sum() / mask.sum() if calculate_entropy else 0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), (ent.detach() if ent is not None else None), grads


@pytest.mark.parametrize("rmpad", [False, True])
def test_fused_forward_matches_plain_path(model_dir, rmpad):
    model = build_hf_model(ModelConfig(path=model_dir))  # tied embeddings: lm_head is embed_tokens
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert forward.head_is_swappable(model) is model.lm_head
    batch = _td(make_batch(6, seed=4))
    mask = batch["response_mask"].bool()
    lp_f, ent_f, g_f = _loss_and_grads(model, batch, True, rmpad)
    lp_p, ent_p, g_p = _loss_and_grads(model, batch, False, rmpad)
    torch.testing.assert_close(lp_f[mask], lp_p[mask], **TOL)
    torch.testing.assert_close(ent_f[mask], ent_p[mask], **TOL)
    if rmpad:  # padded response positions read 0 on both packed paths
        torch.testing.assert_close(lp_f[~mask], torch.zeros_like(lp_f[~mask]))
    else:
        torch.testing.assert_close(lp_f, lp_p, **TOL)
    assert set(g_f) == set(g_p) and "model.embed_tokens.weight" in g_f
    for name in g_p:
        torch.testing.assert_close(g_f[name], g_p[name], **TOL, msg=name)


def test_fused_forward_with_lora(model_dir):
    model = build_hf_model(
        ModelConfig(path=model_dir, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert forward.head_is_swappable(model) is not None
    batch = _td(make_batch(4, seed=5))
    mask = batch["response_mask"].bool()
    for rmpad in (False, True):
        lp_f, _, g_f = _loss_and_grads(model, batch, True, rmpad, calculate_entropy=False)
        lp_p, _, g_p = _loss_and_grads(model, batch, False, rmpad, calculate_entropy=False)
        torch.testing.assert_close(lp_f[mask], lp_p[mask], **TOL)
        assert g_f and all("lora" in n for n in g_f) and set(g_f) == set(g_p)
        for name in g_p:
            torch.testing.assert_close(g_f[name], g_p[name], **TOL, msg=name)


@pytest.mark.parametrize("rmpad", [False, True])
def test_fused_values_match_plain_path(model_dir, rmpad):
    critic = build_hf_model(ModelConfig(path=model_dir), role="critic")
    assert forward.head_is_swappable(critic) is critic.score
    batch = _td(make_batch(5, seed=6))
    mask = batch["response_mask"].bool()
    outs = []
    for fused in (True, False):
        critic.zero_grad(set_to_none=True)
        v = forward.forward_values(critic, batch, use_remove_padding=rmpad, fused=fused)
        (v * mask).pow(2).sum().backward()
        outs.append((v.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}))
    (v_f, g_f), (v_p, g_p) = outs
    torch.testing.assert_close(v_f[mask], v_p[mask], **TOL)
    for name in g_p:
        torch.testing.assert_close(g_f[name], g_p[name], **TOL, msg=name)


def test_post_processed_logits_take_the_plain_path():
    class SoftCapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(4, 8)

        def forward(self, h):
            logits = self.lm_head(h)
            logits = torch.tanh(logits / 30.0) * 30.0
            return logits

    class Plain(SoftCapped):
        def forward(self, h):
            logits = self.lm_head(h)
            return logits

    assert forward.head_is_swappable(SoftCapped()) is None
    assert forward.head_is_swappable(Plain()) is not None


def _fsdp_fused_vs_plain(rank, world, model_dir, param_dtype):
    fsdp = FSDPConfig()
    fsdp.mixed_precision.param_dtype = param_dtype
    engine = FSDPEngine.build(ModelConfig(path=model_dir), fsdp, role="actor", load_tok=False)
    batch = _td(make_batch(4, seed=10 + rank))
    results = []
    for fused in (True, False):
        lp, ent, grads = _loss_and_grads(engine.module, batch, fused, rmpad=rank == 1)
        full = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()}
        results.append((lp, ent, full))
    (lp_f, ent_f, g_f), (lp_p, ent_p, g_p) = results
    mask = batch["response_mask"].bool()
    # bf16 compute: the same bf16 matmuls; the fused weight gradient sums its chunks in fp32
    tol = TOL if param_dtype == "fp32" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lp_f[mask], lp_p[mask], **tol)
    torch.testing.assert_close(ent_f[mask], ent_p[mask], **tol)
    assert set(g_f) == set(g_p)
    for name in g_p:
        torch.testing.assert_close(g_f[name], g_p[name], **tol, msg=name)


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_fused_matches_plain_under_fsdp_two_ranks(tmp_path, model_dir, param_dtype):
    spawn(_fsdp_fused_vs_plain, 2, tmp_path, model_dir, param_dtype)


@pytest.mark.parametrize("chunk_rows", [5, 1000])
def test_linear_log_probs_sum_pi_squared(chunk_rows):
    hidden, weight, bias, labels, _, _ = _leaves(2)
    lp, ent, sps = linear_log_probs(
        hidden, weight, labels, bias=bias, temperature=0.7, calculate_entropy=True,
        calculate_sum_pi_squared=True, chunk_rows=chunk_rows,
    )  # fmt: skip
    logits = (hidden @ weight.T + bias) / 0.7
    torch.testing.assert_close(sps, torch.softmax(logits, -1).square().sum(-1).detach(), **TOL)
    lp_p, ent_p = _plain(hidden, weight, bias, labels, 0.7)
    torch.testing.assert_close(lp, lp_p, **TOL)
    torch.testing.assert_close(ent, ent_p, **TOL)
    assert not sps.requires_grad
    lp.sum().backward()  # the extra output leaves the log-prob gradient path intact
    assert hidden.grad is not None


@pytest.mark.parametrize("rmpad", [False, True])
def test_forward_sum_pi_squared_fused_equals_plain(model_dir, rmpad):
    model = build_hf_model(ModelConfig(path=model_dir))
    batch = _td(make_batch(6, seed=5))
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        out_f = forward.forward_log_probs(
            model, batch, temperature=0.7, use_remove_padding=rmpad, calculate_sum_pi_squared=True
        )
        out_p = forward.forward_log_probs(
            model,
            batch,
            temperature=0.7,
            use_remove_padding=rmpad,
            calculate_sum_pi_squared=True,
            fused=False,
        )
        lp_only = forward.forward_log_probs(model, batch, temperature=0.7, use_remove_padding=rmpad).log_probs
    assert out_f.entropy is None and out_p.entropy is None
    torch.testing.assert_close(out_f.sum_pi_squared[mask], out_p.sum_pi_squared[mask], **TOL)
    torch.testing.assert_close(out_f.log_probs[mask], lp_only[mask], **TOL)
    assert ((out_f.sum_pi_squared[mask] > 0) & (out_f.sum_pi_squared[mask] <= 1)).all()


def test_compiled_kernels_equal_eager():
    """use_torch_compile: the chunk statistics and their backward through torch.compile give the
    eager results (log-probs, entropy, gradients; 1e-5: inductor reorders the reductions)."""
    from hybridrl.engine import lm_head

    hidden, weight, bias, labels, w_lp, w_ent = _leaves(3, n=41, v=300)
    out = {}
    for compiled in (False, True):
        lp, ent = linear_log_probs(
            hidden,
            weight,
            labels,
            bias=bias,
            temperature=0.7,
            calculate_entropy=True,
            chunk_rows=16,
            compiled=compiled,
        )
        grads = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), (hidden, weight, bias))
        out[compiled] = (lp, ent, *grads)
    assert lm_head._COMPILED, "the compiled kernels were not built"
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_actor_use_torch_compile_runs_the_compiled_kernels(model_dir, fused, monkeypatch):
    """actor.use_torch_compile=True: PPOActor's log-prob pass goes through the compiled kernels
    (the chunked head's, or the plain path's entropy) and gives the eager numbers."""
    from hybridrl.config.roles import ActorConfig
    from hybridrl.engine import lm_head
    from hybridrl.protocol import DataProto
    from hybridrl.workers.actor import PPOActor

    asked = []
    kernels = lm_head._kernels
    monkeypatch.setattr(lm_head, "_kernels", lambda compiled: asked.append(compiled) or kernels(compiled))
    model = build_hf_model(ModelConfig(path=model_dir))
    data = DataProto.from_dict(make_batch(6, seed=4))
    mask = data.batch["response_mask"].bool()
    out = {}
    for compiled in (False, True):
        actor = PPOActor(ActorConfig(use_torch_compile=compiled), model, use_fused_kernels=fused)
        out[compiled] = actor.compute_log_prob(data, calculate_entropy=True, temperature=0.7)
    if fused:
        assert asked and asked[-1] is True and False in asked
    else:
        assert not asked and forward._compiled_entropy.cache_info().currsize == 1
    for name in ("log_probs", "entropy"):
        a, b = getattr(out[True], name), getattr(out[False], name)
        torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=1e-5)


def test_kept_logits_give_the_recomputed_gradients_bit_for_bit():
    """Keeping the logits for the backward (within `keep_logits_bytes`) skips a matmul, not a bit of
    the result; beyond the budget, and without a gradient, nothing is kept."""
    from hybridrl.engine import lm_head

    hidden, weight, bias, labels, w_lp, w_ent = _leaves(0)
    outs = {}
    for keep in (0, 2**30):
        lp, ent = linear_log_probs(hidden, weight, labels, bias=bias, calculate_entropy=True, chunk_rows=7,
                                   keep_logits_bytes=keep)  # fmt: skip
        outs[keep] = (
            lp,
            ent,
            *torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), (hidden, weight, bias)),
        )
    for a, b in zip(outs[0], outs[2**30]):
        assert torch.equal(a, b)
    kept = []
    real = lm_head._ChunkedLinearLogProbs.apply
    try:
        lm_head._ChunkedLinearLogProbs.apply = lambda *a: kept.append(a[-1]) or real(*a)
        n_bytes = hidden.shape[0] * weight.shape[0] * 4
        linear_log_probs(hidden, weight, labels, keep_logits_bytes=n_bytes)
        linear_log_probs(hidden, weight, labels, keep_logits_bytes=n_bytes - 1)
        with torch.no_grad():
            linear_log_probs(hidden, weight, labels, keep_logits_bytes=n_bytes)
    finally:
        lm_head._ChunkedLinearLogProbs.apply = real
    assert kept == [True, False, False]


@pytest.mark.parametrize("keep", [0, 2**30], ids=["recompute", "keep_logits"])
@pytest.mark.parametrize("terms", ["logp", "entropy", "both"])
def test_a_second_backward_gives_the_same_gradients(keep, terms):
    """The eager kernels turn the kept chunk into its gradient in place: a second backward through
    the same graph (retain_graph) recomputes the logits and gets the first one's gradients, for each
    mix of loss terms (log-prob only, entropy only, both), at a temperature != 1."""
    hidden, weight, bias, labels, w_lp, w_ent = _leaves(5)
    lp, ent = linear_log_probs(hidden, weight, labels, bias=bias, temperature=0.7, calculate_entropy=True,
                               chunk_rows=9, keep_logits_bytes=keep)  # fmt: skip
    loss = {"logp": (lp * w_lp).sum(), "entropy": (ent * w_ent).sum()}
    loss = loss[terms] if terms != "both" else loss["logp"] + loss["entropy"]
    first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias))
    lp_p, ent_p = _plain(hidden, weight, bias, labels, 0.7)
    ref = {"logp": (lp_p * w_lp).sum(), "entropy": (ent_p * w_ent).sum()}
    ref = ref[terms] if terms != "both" else ref["logp"] + ref["entropy"]
    plain = torch.autograd.grad(ref, (hidden, weight, bias))
    for a, b, c in zip(first, second, plain):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(a, c, **TOL)
