"""HF <-> Megatron conversion: log-probs/entropy equal HF's (fp32, <= 1e-5) and the export
round-trips exactly, at TP=1, TP=2 and PP=2 (one 2-rank spawn, Megatron re-initialised per layout).

Models: the built-in Qwen2 (tied embeddings, qkv biases, vocab 103: padded at TP=2), a ~30M
Qwen2-style model with GQA and an untied head (random seeded init), and a small Llama (no biases).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fsdp_testkit import make_batch, spawn  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _save(cfg, path: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return path


def _models(tmp_path) -> dict[str, str]:
    from transformers import LlamaConfig, Qwen2Config

    from hybridrl.models.builtin import get_builtin_model_path

    qwen30m = Qwen2Config(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    llama = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return {
        "builtin": get_builtin_model_path(),
        "qwen2_30m": _save(qwen30m, str(tmp_path / "qwen30m")),
        "llama": _save(llama, str(tmp_path / "llama"), seed=1),
    }


def _check(model_dir: str, tp: int, pp: int) -> dict[str, float]:
    from megatron.core import parallel_state as ps
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from hybridrl.algos.utils import entropy_from_logits, logprobs_from_logits
    from hybridrl.config.megatron import MegatronConfig
    from hybridrl.engine.megatron import model as mm
    from hybridrl.engine.megatron.convert import arch_spec
    from hybridrl.engine.megatron.dispatch import broadcast_from_last_stage
    from hybridrl.engine.megatron.forward import run_schedule
    from hybridrl.engine.megatron.vocab_parallel import vocab_parallel_logprobs_entropy

    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    mm.init_parallel(cfg, "test")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = arch_spec(hf.config)
    chunks = mm.build_model(spec, mm.transformer_config(spec, cfg, torch.float32, "test"), "actor", 0)
    mm.load_hf_weights(chunks, hf.state_dict(), spec, "actor")
    b = make_batch(4, seed=3)
    b["input_ids"] = b["input_ids"] % spec.vocab_size
    b["responses"] = b["responses"] % spec.vocab_size
    t = b["responses"].shape[1]
    tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()

    def loss_fn(micro, logits):
        lp, ent = vocab_parallel_logprobs_entropy(
            logits[:, -t - 1 : -1].float(),
            micro["responses"],
            vocab_size=spec.vocab_size,
            tp_rank=tp_rank,
            group=group,
        )
        return torch.zeros(()), (lp, ent)

    with torch.no_grad():
        res = run_schedule(chunks, list(TensorDict(b, batch_size=[4]).split(2)), loss_fn, forward_only=True)
        ref = hf(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    out = None
    if res:
        lp, ent = torch.cat([r[0] for r in res]), torch.cat([r[1] for r in res])
        ref = ref[:, -t - 1 : -1]
        m = b["response_mask"].bool()
        out = {
            "lp": float((lp - logprobs_from_logits(ref, b["responses"]))[m].abs().max()),
            "ent": float((ent - entropy_from_logits(ref))[m].abs().max()),
        }
    out = broadcast_from_last_stage(out)
    exported = dict(mm.iter_hf_params(chunks, spec, "actor"))
    named = dict(hf.named_parameters())
    assert set(exported) == set(named), sorted(set(exported) ^ set(named))
    out["export"] = max(float((exported[k] - named[k]).abs().max()) for k in named)
    ps.destroy_model_parallel()
    return out


def _run(rank, world, models, result_dir):
    results = {(name, tp, pp): _check(path, tp, pp) for name, path in models.items() for tp, pp in LAYOUTS}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))


def test_hf_megatron_logprobs_and_export(tmp_path):
    models = _models(tmp_path)
    spawn(_run, 2, tmp_path, models, str(tmp_path))
    for rank in range(2):
        for key, r in torch.load(tmp_path / f"rank{rank}.pt").items():
            print(rank, key, r)
            assert r["lp"] <= 1e-5 and r["ent"] <= 1e-5, (key, r)
            assert r["export"] == 0.0, (key, r)
