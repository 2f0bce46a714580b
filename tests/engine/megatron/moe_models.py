"""Tiny random mixture-of-experts models for the Megatron MoE tests (4 experts, top-2).

qwen3_moe: routed experts only, q/k norms. qwen2_moe: routed experts plus a gated shared expert,
qkv bias, no top-k renormalisation. Both use the test kit's vocabulary (64) and pad id.
"""

from __future__ import annotations

import torch
from fsdp_testkit import PAD, VOCAB, make_batch

FAMILIES = ("qwen3_moe", "qwen2_moe")
ROWS = 8
NO_AUX = {"moe_aux_loss_coeff": 0.0}


def moe_config(family: str):
    """The HF config of a tiny `family` model (2 layers, hidden 64, 4 heads of 16, 4 experts)."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        router_aux_loss_coef=0.01,
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=16, norm_topk_prob=True, **common)
    return Qwen2MoeConfig(shared_expert_intermediate_size=48, norm_topk_prob=False, **common)


def make_moe_model_dir(path: str, family: str, seed: int = 0) -> str:
    """Save a random tiny `family` model to `path` (router weights drawn wider than HF's init, so that
    the top-2 choice has clear margins and is not decided by float round-off)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def batch(seed: int = 5):
    """A PPO batch of ROWS rows (left-padded prompts, right-padded responses)."""
    from hybridrl.protocol import DataProto

    g = torch.Generator().manual_seed(7)
    b = make_batch(ROWS, seed=seed)
    t = b["responses"].shape[1]
    b["old_log_probs"] = -3.0 + 0.3 * torch.randn(ROWS, t, generator=g)
    b["advantages"] = torch.randn(ROWS, t, generator=g)
    return DataProto.from_dict(b)


def configs(model_dir: str, ep: int = 1, override: dict | None = None, **megatron):
    """(model, actor, megatron) configs: fp32, Adam eps 1e-3 and no weight decay (as the dense tests)."""
    from hybridrl.config.megatron import MegatronConfig
    from hybridrl.config.roles import ActorConfig, FSDPConfig, MixedPrecisionConfig, ModelConfig, OptimConfig

    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    optim = OptimConfig(lr=2e-3, clip_grad=0.5, weight_decay=0.0, eps=1e-3)
    actor = ActorConfig(
        ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, optim=optim, fsdp_config=fsdp
    )
    mcfg = MegatronConfig(
        expert_model_parallel_size=ep,
        dtype="float32",
        override_transformer_config=dict(NO_AUX if override is None else override),
        **megatron,
    )
    return ModelConfig(path=model_dir), actor, mcfg
