"""Bucketing, streamed sync metrics and the training-name -> engine-name maps (no model needed)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.models.weight_map import (
    dtype_name,
    get_weight_name_map,
    map_named_tensors,
    register_weight_name_map,
    split_fused_experts,
    strip_wrapper_prefixes,
    to_torch_dtype,
)
from hybridrl.weight_sync import iter_buckets, sync_weights


def _named(sizes_in_floats):
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes_in_floats)]


def test_iter_buckets_groups_in_order_within_budget():
    # fp32: 4 bytes per element; budget 40 bytes = 10 floats
    named = _named([4, 4, 4, 12, 1, 9, 10])
    buckets = [[n for n, _ in b] for b in iter_buckets(iter(named), bucket_bytes=40)]
    # 4+4 fit (32 B); +4 would be 48 B -> new bucket; 12 floats (48 B) alone; 1+9 = 40 B fits; 10 alone
    assert buckets == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"], ["w6"]]


def test_iter_buckets_edge_cases():
    assert list(iter_buckets(iter([]), 10)) == []
    assert [len(b) for b in iter_buckets(iter(_named([1, 1, 1])), 10**9)] == [3]
    with pytest.raises(ValueError, match="positive"):
        list(iter_buckets(iter(_named([1])), 0))


def test_iter_buckets_pulls_lazily():
    pulled = []

    def source():
        for name, t in _named([5, 5, 5, 5]):
            pulled.append(name)
            yield name, t

    it = iter_buckets(source(), bucket_bytes=40)  # two 20-byte tensors per bucket
    first = next(it)
    assert [n for n, _ in first] == ["w0", "w1"]
    assert pulled == ["w0", "w1", "w2"]  # only one tensor beyond the bucket was gathered


class _Recorder:
    """A rollout stand-in that records what update_weights consumed."""

    class config:
        update_weights_bucket_megabytes = 1

    def update_weights(self, named_tensors):
        self.got = [(n, t.clone()) for n, t in named_tensors]


def test_sync_weights_streams_everything_and_reports_metrics():
    named = _named([256, 256, 1024])  # 1 KiB, 1 KiB, 4 KiB
    rec = _Recorder()
    m = sync_weights(rec, iter(named), bucket_megabytes=2 / 1024)  # 2 KiB buckets
    assert [n for n, _ in rec.got] == ["w0", "w1", "w2"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(rec.got, named))
    assert m["weight_sync/bytes"] == 6144 and m["weight_sync/num_tensors"] == 3
    assert m["weight_sync/num_buckets"] == 2 and m["weight_sync/max_bucket_bytes"] == 4096
    assert m["timing_s/update_weights"] >= 0
    # default bucket size comes from the rollout's config
    assert sync_weights(rec, iter(named))["weight_sync/num_buckets"] == 1


def test_strip_wrapper_prefixes():
    assert (
        strip_wrapper_prefixes("_orig_mod.model.layers.0.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    assert (
        strip_wrapper_prefixes("model.layers.0._checkpoint_wrapped_module.mlp.weight")
        == "model.layers.0.mlp.weight"
    )
    assert strip_wrapper_prefixes("module.model.norm.weight") == "model.norm.weight"
    assert (
        strip_wrapper_prefixes("model.module.norm.weight") == "model.module.norm.weight"
    )  # DDP prefix only leads


def test_map_named_tensors_tied_heads_casts_and_maps():
    emb, head, norm = torch.ones(4, 2), torch.full((4, 2), 2.0), torch.ones(2)
    idx = torch.tensor([1, 2])
    src = [
        ("model.embed_tokens.weight", emb),
        ("lm_head.weight", head),
        ("model.norm.weight", norm),
        ("idx", idx),
    ]
    keep = [n for n, _ in map_named_tensors(src)]
    assert keep == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "idx"]
    drop = [n for n, _ in map_named_tensors(src, tied_lm_head="drop")]
    assert drop == ["model.embed_tokens.weight", "model.norm.weight", "idx"]
    mirror = list(map_named_tensors(src, tied_lm_head="mirror", dtype=torch.bfloat16))
    assert [n for n, _ in mirror] == [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "idx",
    ]
    assert torch.equal(mirror[1][1].float(), emb)  # the head is the embedding, not the incoming head
    assert mirror[0][1].dtype == torch.bfloat16 and mirror[3][1].dtype == torch.int64  # ints keep dtype
    renamed = list(map_named_tensors(src, name_map=lambda n: None if n == "idx" else "x." + n))
    assert [n for n, _ in renamed][-1] == "x.model.norm.weight"
    with pytest.raises(ValueError, match="tied_lm_head"):
        list(map_named_tensors(src, tied_lm_head="bogus"))


def test_engine_name_maps_default_to_identity_and_can_be_registered():
    for engine in ("hf", "vllm", "sglang"):
        assert get_weight_name_map(engine)("model.norm.weight") == "model.norm.weight"
    register_weight_name_map("test-engine", lambda n: n.replace("model.", "decoder."))
    assert get_weight_name_map("test-engine")("model.norm.weight") == "decoder.norm.weight"


def test_to_torch_dtype():
    assert to_torch_dtype("bf16") is torch.bfloat16 and to_torch_dtype("float32") is torch.float32
    assert (
        to_torch_dtype(torch.float16) is torch.float16 and to_torch_dtype("torch.bfloat16") is torch.bfloat16
    )
    with pytest.raises(ValueError, match="unknown dtype"):
        to_torch_dtype("int3")
    assert dtype_name("bf16") == "bfloat16" and dtype_name(torch.float32) == "float32"


def test_iter_buckets_by_layer_never_spans_two_decoder_layers():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.a",
        "model.layers.0.b",
        "model.layers.1.a",
        "model.norm.weight",
    ]
    named = [(n, torch.zeros(1)) for n in names]
    buckets = [[n for n, _ in b] for b in iter_buckets(iter(named), 10**6, by_layer=True)]
    assert buckets == [[names[0]], names[1:3], [names[3]], [names[4]]]
    assert [len(b) for b in iter_buckets(iter(named), 10**6)] == [5]


def test_split_fused_experts_gives_each_experts_projections():
    """transformers 5's fused experts (gate rows first) -> the per-expert checkpoint names."""
    E, inter, H = 3, 4, 5
    gate_up = torch.randn(E, 2 * inter, H)
    down = torch.randn(E, H, inter)
    x = torch.randn(H)
    stream = [("model.layers.0.mlp.gate.weight", torch.randn(E, H)),
              ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
              ("model.layers.0.mlp.experts.down_proj", down)]  # fmt: skip
    out = dict(split_fused_experts(iter(stream)))
    assert len(out) == 1 + 3 * E and torch.equal(out["model.layers.0.mlp.gate.weight"], stream[0][1])
    for e in range(E):
        p = f"model.layers.0.mlp.experts.{e}."
        # the expert's MLP from the split weights equals the fused computation
        want_gate, want_up = (gate_up[e] @ x).chunk(2)
        torch.testing.assert_close(out[p + "gate_proj.weight"] @ x, want_gate)
        torch.testing.assert_close(out[p + "up_proj.weight"] @ x, want_up)
        torch.testing.assert_close(out[p + "down_proj.weight"], down[e])
        assert out[p + "gate_proj.weight"].shape == (inter, H) and out[p + "down_proj.weight"].shape == (
            H,
            inter,
        )
    # a 2-D tensor that happens to share the name's ending is not an expert stack
    assert (
        list(split_fused_experts([("a.experts.down_proj", torch.ones(2, 2))]))[0][0] == "a.experts.down_proj"
    )
