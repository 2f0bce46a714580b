"""The HF rollout's decode GEMM (cpu/decode_gemm.py): both forms (oneDNN on a packed
weight, weight first) equal F.linear, the packed weight follows every in-place write, and the
rollout with either generates what plain `model.generate` does, before and after weight syncs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from rollout_testlib import make_prompts, plain_generate
from torch import nn

from hybridrl.cpu.decode_gemm import (
    DecodeGemmLinear,
    decode_gemm_applies,
    install_decode_gemm,
    linear_rows,
    linear_weight_first,
    min_weight_numel,
    onednn_available,
    onednn_linear,
    pack_weight,
    resolve_form,
    uninstall_decode_gemm,
    use_weight_first,
)
from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.weight_sync import sync_weights

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
FORMS = [pytest.param("onednn", marks=needs_onednn), "weight_first"]

TEXTS = ["12+34=", "7+1=", "abc", "9"]
T = 12


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 48), (2, 1, 48), (1, 48), (7, 0, 48)])
def test_weight_first_equals_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    x = torch.randn(shape, generator=gen)
    got = linear_weight_first(x, w, b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape == (*shape[:-1], 40)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_weight_first_accepts_a_non_contiguous_input():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    x = torch.randn(16, 6, 3, generator=gen).permute(2, 1, 0)  # (3, 6, 16), strided
    torch.testing.assert_close(linear_weight_first(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 48), (2, 1, 48), (1, 48), (16, 48)])
def test_onednn_on_a_packed_weight_equals_f_linear(shape, bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 48, generator=gen)
    b = torch.randn(40, generator=gen) if bias else None
    x = torch.randn(shape, generator=gen)
    for rows in (1, 16):  # the layout hint changes the blocking, not the result
        got = onednn_linear(x, pack_weight(w, rows), b)
        assert got.shape == (*shape[:-1], 40)
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    strided = torch.randn(48, 6, 3, generator=gen).permute(2, 1, 0)
    torch.testing.assert_close(onednn_linear(strided, pack_weight(w, 6), b), F.linear(strided, w, b))


def test_forms_resolve_and_bad_ones_are_refused():
    assert resolve_form("weight_first") == "weight_first"
    assert resolve_form("auto") == ("onednn" if onednn_available() else "weight_first")
    with pytest.raises(ValueError, match="decode GEMM form 'mkl' is not one of"):
        resolve_form("mkl")
    with pytest.raises(ValueError, match="not one of"):
        install_decode_gemm(nn.Linear(4, 4), form="fast")


def test_dispatch_by_rows_device_and_dtype():
    w = torch.zeros(8, 16)
    assert linear_rows(torch.zeros(4, 3, 16), 16) == 12
    assert decode_gemm_applies(torch.zeros(4, 3, 16), w, max_rows=12, min_numel=0)
    assert not decode_gemm_applies(torch.zeros(4, 3, 16), w, max_rows=11, min_numel=0)
    assert not decode_gemm_applies(torch.zeros(1, 16), w, max_rows=64, min_numel=0)  # a GEMV
    assert not decode_gemm_applies(torch.zeros(2, 16), w, max_rows=64, min_numel=129)  # 128 elements
    assert not decode_gemm_applies(torch.zeros(2, 16, dtype=torch.bfloat16), w.bfloat16(), 64, 0)
    assert not decode_gemm_applies(torch.zeros(2, 16, dtype=torch.float64), w.double(), 64, 0)
    assert not decode_gemm_applies(torch.zeros(2, 16), w, max_rows=0, min_numel=0)
    assert not decode_gemm_applies(torch.zeros(2, 16, device="meta"), w.to("meta"), 64, 0)


def test_onednn_form_needs_no_gradient():
    w, x = torch.zeros(8, 16, requires_grad=True), torch.zeros(4, 16)
    assert not decode_gemm_applies(x, w, 64, 0, form="onednn")  # grad mode on, weight needs grad
    assert decode_gemm_applies(x, w, 64, 0, form="weight_first")  # autograd-safe
    with torch.no_grad():
        assert decode_gemm_applies(x, w, 64, 0, form="onednn")
    assert decode_gemm_applies(x, w.detach(), 64, 0, form="onednn")


def test_default_weight_size_bound_follows_the_thread_count():
    assert min_weight_numel(1) == 1 << 22 and min_weight_numel(2) == min_weight_numel(16) == 1 << 19
    assert min_weight_numel(1, "onednn") == 1 << 19 and min_weight_numel(2, "onednn") == 1 << 17
    assert use_weight_first(16, 1 << 19, max_rows=128, min_numel=1 << 19)
    assert not use_weight_first(16, (1 << 19) - 1, max_rows=128, min_numel=1 << 19)
    mlp, head, x = torch.empty(2048, 768), torch.empty(32768, 768), torch.zeros(16, 768)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert decode_gemm_applies(x, head, 128) and not decode_gemm_applies(x, mlp, 128)
        torch.set_num_threads(2)
        assert decode_gemm_applies(x, head, 128) and decode_gemm_applies(x, mlp, 128)
        assert not decode_gemm_applies(x, torch.empty(512, 512), 128)
    finally:
        torch.set_num_threads(threads)


def _layer_pair(bias: bool, form: str = "weight_first"):
    torch.manual_seed(2)
    plain = nn.Linear(32, 20, bias=bias)
    patched = nn.Linear(32, 20, bias=bias)
    patched.load_state_dict(plain.state_dict())
    assert install_decode_gemm(patched, max_rows=6, min_numel=0, form=form) == 1
    return plain, patched


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32), (7, 32), (4, 5, 32), (1, 1, 32)])
def test_patched_layer_equals_plain_above_and_below_the_threshold(shape, bias, form):
    plain, patched = _layer_pair(bias, form)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), plain(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_patched_layer_keeps_its_parameters_grads_and_can_be_undone(form):
    plain, patched = _layer_pair(bias=True, form=form)
    weight = patched.weight
    assert isinstance(patched, nn.Linear) and type(patched) is DecodeGemmLinear
    assert f"decode_gemm_max_rows=6, decode_gemm_min_numel=0, decode_gemm_form={form}" in repr(patched)
    assert list(patched.state_dict()) == ["weight", "bias"] and patched.weight is weight
    x = torch.randn(3, 32)
    patched(x).sum().backward()  # autograd: the weight-first form, or F.linear for oneDNN's
    plain(x).sum().backward()
    torch.testing.assert_close(patched.weight.grad, plain.weight.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        patched(x)
    assert uninstall_decode_gemm(patched) == 1 and type(patched) is nn.Linear
    assert not any(k.startswith(("decode_gemm", "_decode")) for k in vars(patched))
    with pytest.raises(ValueError, match="max_rows must be >= 0"):
        install_decode_gemm(patched, max_rows=-1)


@needs_onednn
def test_packed_weight_follows_every_write_to_the_parameter():
    """The packed copy is made again after an in-place write (the weight sync's copy_), after the
    parameter is replaced, and not otherwise."""
    plain, patched = _layer_pair(bias=True, form="onednn")
    x = torch.randn(4, 32)
    with torch.no_grad():
        patched(x)
        first = patched._decode_packed
        patched(x)
        assert patched._decode_packed is first  # unchanged weight: packed once
        for layer in (plain, patched):
            layer.weight.copy_(torch.randn(20, 32, generator=torch.Generator().manual_seed(3)))
        torch.testing.assert_close(patched(x), plain(x), atol=1e-5, rtol=1e-5)
        assert patched._decode_packed is not first
        patched.weight = plain.weight = nn.Parameter(torch.randn(20, 32))
        torch.testing.assert_close(patched(x), plain(x), atol=1e-5, rtol=1e-5)


def test_install_skips_linear_subclasses():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    assert install_decode_gemm(model, min_numel=0) == 2
    assert [type(m).__name__ for m in model.modules()][1:] == [
        "DecodeGemmLinear",
        "MyLinear",
        "Sequential",
        "DecodeGemmLinear",
    ]


# ---- the rollout ---------------------------------------------------------------------------------
def _cfg(**kw):
    base = dict(name="hf", dtype="float32", prompt_length=8, response_length=T, load_format="dummy")
    base.update(kw)
    return RolloutConfig(**base)


def _count_decode_layers(model) -> int:
    return sum(type(m) is DecodeGemmLinear for m in model.modules())


def _forced(rollout, form: str = "auto"):
    """The tiny model's weights are below the default size bound: use the form in every layer."""
    n = install_decode_gemm(rollout.model, rollout.config.hf_decode_gemm_max_rows, min_numel=0, form=form)
    assert n == 15
    return rollout


@pytest.mark.parametrize("form", FORMS)
def test_install_leaves_layers_below_the_bound_at_every_thread_count_plain(form):
    """With the default bound (by threads at call time) a weight below the smallest bound of any
    thread count is never run in the decode form: that layer keeps plain nn.Linear (no per-call
    check); a layer at the bound is swapped."""
    floor = min(min_weight_numel(1, form), min_weight_numel(2, form))
    small, big = nn.Linear(64, floor // 64 - 1), nn.Linear(64, floor // 64)
    model = nn.Sequential(small, big)
    assert install_decode_gemm(model, form=form) == 1
    assert type(small) is nn.Linear and type(big) is DecodeGemmLinear
    assert install_decode_gemm(nn.Sequential(nn.Linear(4, 4)), min_numel=0, form=form) == 1


def _wide_config(tiny_model_dir):
    """The tiny model's config, widened so that every decoder linear is above the oneDNN bound
    (2**17 elements) and the tied 103 x 512 head stays below it."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.hidden_size, cfg.intermediate_size = 512, 1024
    cfg.num_attention_heads = cfg.num_key_value_heads = 8
    cfg.head_dim = 64
    return cfg


def test_rollout_installs_the_decode_gemm_only_when_enabled(tiny_model_dir, tokenizer):
    tiny = create_rollout(_cfg(), tiny_model_dir, tokenizer, device="cpu")
    assert _count_decode_layers(tiny.model) == 0  # every weight of the tiny model is below the bound
    wide = _wide_config(tiny_model_dir)
    on = create_rollout(_cfg(), tiny_model_dir, tokenizer, device="cpu", model_config=wide)
    # oneDNN: 2 layers x (q, k, v, o, gate, up, down); weight first (bound 2**19): gate, up, down.
    # The tied lm_head (vocab x 512) is below either bound.
    assert _count_decode_layers(on.model) == (14 if resolve_form("auto") == "onednn" else 6)
    assert type(on.model.lm_head) is nn.Linear
    assert on.model.lm_head.weight is on.model.get_input_embeddings().weight  # still tied
    for off_cfg in (_cfg(hf_decode_gemm_max_rows=0), _cfg(dtype="bfloat16")):
        off = create_rollout(off_cfg, tiny_model_dir, tokenizer, device="cpu", model_config=wide)
        assert _count_decode_layers(off.model) == 0
    with pytest.raises(ValueError, match="hf_decode_gemm_max_rows"):
        _cfg(hf_decode_gemm_max_rows=-1)


@pytest.mark.parametrize("form", FORMS)
def test_rollout_greedy_equals_plain_generate_after_sync(tiny_model_dir, tokenizer, source_model, form):
    """Greedy tokens equal plain model.generate on the synced weights, and differ before the sync;
    after a second sync they follow the new weights (the packed copies were made again)."""
    prompts = make_prompts(tokenizer, TEXTS, {"validate": True})
    rollout = _forced(create_rollout(_cfg(ignore_eos=True), tiny_model_dir, tokenizer, device="cpu"), form)
    before = rollout.generate_sequences(prompts).batch["responses"]
    sync_weights(rollout, source_model.state_dict().items())
    rows: list[int] = []

    def record(layer, args):  # rows of each head call that took the decode form
        x = args[0]
        lim, numel = layer.decode_gemm_max_rows, layer.decode_gemm_min_numel
        if decode_gemm_applies(x, layer.weight, lim, numel, layer.decode_gemm_form):
            rows.append(linear_rows(x, layer.in_features))

    hook = rollout.model.lm_head.register_forward_pre_hook(record)
    after = rollout.generate_sequences(prompts).batch["responses"]
    hook.remove()
    # the decode steps ran the weight-first form: one head call of 4 rows per new token
    assert rows == [len(TEXTS)] * T
    want = plain_generate(source_model, prompts, T, do_sample=False)
    assert type(source_model.lm_head) is nn.Linear  # the source (training) model is untouched
    assert torch.equal(after, want)
    assert not torch.equal(before, want)
    # the parameters the sync wrote into are the ones the patched layers read
    for name, p in source_model.state_dict().items():
        assert torch.equal(rollout.model.state_dict()[name], p), name
    # a second sync with other weights: the layers read them, not a stale packed copy
    moved = copy.deepcopy(source_model)  # the fixture is shared: change a copy
    with torch.no_grad():
        for p in moved.parameters():  # tied embeddings once
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    sync_weights(rollout, moved.state_dict().items())
    again = rollout.generate_sequences(prompts).batch["responses"]
    assert torch.equal(again, plain_generate(moved, prompts, T, do_sample=False))
    assert not torch.equal(again, after)


def test_rollout_sampling_is_reproducible_and_matches_plain(tiny_model_dir, tokenizer, source_model):
    prompts = make_prompts(tokenizer, TEXTS)
    state = source_model.state_dict().items()
    on = _forced(create_rollout(_cfg(ignore_eos=True, seed=7), tiny_model_dir, tokenizer, device="cpu"))
    off = create_rollout(
        _cfg(ignore_eos=True, seed=7, hf_decode_gemm_max_rows=0), tiny_model_dir, tokenizer, device="cpu"
    )
    sync_weights(on, state)
    sync_weights(off, state)
    a = on.generate_sequences(prompts).batch["responses"]
    again = _forced(create_rollout(_cfg(ignore_eos=True, seed=7), tiny_model_dir, tokenizer, device="cpu"))
    sync_weights(again, state)
    assert torch.equal(again.generate_sequences(prompts).batch["responses"], a)
    # same seed, plain layers: the tiny model's peaked distributions give the same samples
    assert torch.equal(off.generate_sequences(prompts).batch["responses"], a)
