"""Bucketed full-parameter gathering (2 gloo ranks) and the engine's CPU defaults: eager attention for
bf16 training, no resharding after forward when each shard group is one rank."""

import os
import sys
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig, ModelConfig  # noqa: E402
from hybridrl.engine.fsdp import default_attn_implementation, resolve_reshard_after_forward  # noqa: E402


class _Uneven(nn.Module):
    """Rows that 2 ranks do not split evenly (3, 1: rank 1 holds none, 9), and one weight that the
    test shards on dim 1 (gathered alone, between two buckets)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(4, 1)
        self.mid = nn.Linear(8, 4)
        self.c = nn.Linear(4, 6)
        self.e = nn.Linear(6, 9)

    def forward(self, x):
        return self.e(self.c(self.mid(x)))  # unused: the checks only gather


def _sharded_uneven():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)  # the same full weights on both ranks
    model = _Uneven()
    mid = model.mid.weight
    fully_shard(
        model,
        mesh=init_device_mesh("cpu", (2,)),
        shard_placement_fn=lambda p: Shard(1) if p is mid else Shard(0),
    )
    return model


def _count_collectives(monkey_calls: list):
    import torch.distributed as dist

    real = dist.all_gather_single

    def counting(*args, **kwargs):
        monkey_calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather_single = counting


def _check_buckets(rank, world):
    from hybridrl.engine.full_params import GATHER_BUCKET_BYTES, iter_full_params

    model = _sharded_uneven()
    assert model.b.weight.to_local().shape[0] == (1 - rank)  # rank 1's shard of the (1, 4) weight is empty
    expected = [(n, p.detach().full_tensor()) for n, p in model.named_parameters()]
    calls: list = []
    _count_collectives(calls)
    counts = {}
    for bucket_bytes in (GATHER_BUCKET_BYTES, 64):
        for dtype in (None, torch.bfloat16):
            calls.clear()
            got = list(iter_full_params(model, dtype=dtype, device="cpu", bucket_bytes=bucket_bytes))
            counts[bucket_bytes] = len(calls)
            assert [n for n, _ in got] == [n for n, _ in expected]
            for (name, full), (_, ref) in zip(got, expected):
                ref = ref if dtype is None else ref.to(dtype)
                assert full.dtype == ref.dtype and torch.equal(full, ref), (name, bucket_bytes, dtype)
    # one bucket before mid.weight (gathered on its own), one after; 64 bytes force several
    assert counts[GATHER_BUCKET_BYTES] == 2 and counts[64] > 4, counts
    _check_lora_merge(rank)


def _check_lora_merge(rank):
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybridrl.engine.full_params import iter_full_params

    torch.manual_seed(0)
    model = get_peft_model(_Uneven(), LoraConfig(r=2, lora_alpha=4, target_modules=["a", "e"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()  # B starts at zero: make the merge visible
    reference = {
        n: p.detach().clone() for n, p in model.merge_and_unload(progressbar=False).named_parameters()
    }
    torch.manual_seed(0)
    model = get_peft_model(_Uneven(), LoraConfig(r=2, lora_alpha=4, target_modules=["a", "e"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    merged = dict(iter_full_params(model, bucket_bytes=64))
    assert set(merged) == set(reference)
    for name, ref in reference.items():
        torch.testing.assert_close(merged[name], ref, atol=1e-6, rtol=0)


def test_bucketed_gather_equals_full_tensor_two_ranks(tmp_path):
    spawn(_check_buckets, 2, tmp_path)


def _check_engine_defaults(rank, world, model_dir):
    from torch.distributed.tensor import DTensor

    from hybridrl.engine.fsdp import FSDPEngine

    bf16 = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    fp32 = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    model = ModelConfig(path=model_dir)

    def attn(model_config, fsdp, role):
        engine = FSDPEngine.build(model_config, fsdp, role=role, load_tok=False)
        return engine, engine.module.config._attn_implementation

    actor, name = attn(model, bf16, "actor")
    assert name == "eager"
    assert attn(model, bf16, "ref")[1] != "eager"
    assert attn(model, fp32, "actor")[1] != "eager"
    assert (
        attn(ModelConfig(path=model_dir, override_config={"attn_implementation": "sdpa"}), bf16, "actor")[1]
        == "sdpa"
    )

    # one rank: no resharding after forward, so a no-grad forward leaves the bf16 compute copies
    # registered; the gathered parameters are still the fp32 masters
    before = {n: t.clone() for n, t in actor.iter_full_params()}
    batch = make_batch(2)
    with torch.no_grad():
        actor.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert any(not isinstance(p, DTensor) for p in actor.module.parameters())
    after = dict(actor.iter_full_params())
    assert after.keys() == before.keys()
    for n, t in after.items():
        assert t.dtype == torch.float32 and torch.equal(t, before[n]), n


def test_engine_cpu_defaults_one_rank(tmp_path):
    model_dir = make_tiny_model_dir(str(tmp_path / "model"))
    spawn(_check_engine_defaults, 1, tmp_path, model_dir)


def _mesh(device_type, *shape):
    return SimpleNamespace(device_type=device_type, ndim=len(shape), size=lambda i: shape[i])


def test_reshard_after_forward_auto_and_explicit():
    auto = FSDPConfig()
    assert auto.reshard_after_forward is None
    assert resolve_reshard_after_forward(auto, _mesh("cpu", 1)) is False
    assert resolve_reshard_after_forward(auto, _mesh("cpu", 2, 1)) is False  # replicate x shard of 1
    assert resolve_reshard_after_forward(auto, _mesh("cpu", 2)) is True
    assert resolve_reshard_after_forward(auto, _mesh("cpu", 1, 2)) is True
    assert resolve_reshard_after_forward(auto, _mesh("cuda", 1)) is True
    assert resolve_reshard_after_forward(FSDPConfig(reshard_after_forward=True), _mesh("cpu", 1)) is True
    assert resolve_reshard_after_forward(FSDPConfig(reshard_after_forward=False), _mesh("cpu", 2)) is False


def test_default_attn_only_for_trained_low_precision_cpu_roles():
    bf16 = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    fp16 = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp16"))
    fp32 = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    plain, chosen = ModelConfig(), ModelConfig(override_config={"attn_implementation": "sdpa"})
    assert default_attn_implementation(plain, bf16, "actor", "cpu") == "eager"
    assert default_attn_implementation(plain, fp16, "critic", "cpu") == "eager"
    assert default_attn_implementation(plain, fp32, "actor", "cpu") is None
    assert default_attn_implementation(plain, bf16, "ref", "cpu") is None
    assert default_attn_implementation(plain, bf16, "reward", "cpu") is None
    assert default_attn_implementation(plain, bf16, "actor", "cuda") is None
    assert default_attn_implementation(chosen, bf16, "actor", "cpu") is None
