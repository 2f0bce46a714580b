"""Hugging Face <-> Megatron-core weights for the Qwen2 and Llama families and the Qwen3-MoE /
Qwen2-MoE mixture-of-experts families (own mapping; the MoE block: moe.py).

Why an own mapping instead of mbridge / Megatron-Bridge: mbridge 0.15 needs four fixes to run on
CPU (its Transformer-Engine layer spec, transformers-5 `rope_parameters`, two layer-norm names)
and is deprecated upstream; Megatron-Bridge pins Transformer Engine / CUDA packages. The two
families differ only in a few well-defined tensors, so the mapping below is short and fully
tested (HF vs Megatron logits, round-trip export; tests/workers/test_megatron_convert.py).

Megatron layout (local layer spec, `transformer_impl="local"`), one decoder layer:
    input_layernorm.weight                       (H,)          replicated   <- input_layernorm
    self_attention.linear_qkv.weight / .bias     (G*(q+2)*D, H) column      <- q/k/v_proj, fused
    self_attention.linear_proj.weight            (H, N*D)      row          <- o_proj
    pre_mlp_layernorm.weight                     (H,)          replicated   <- post_attention_layernorm
    mlp.linear_fc1.weight                        (2*I, H)      column       <- gate_proj, up_proj
    mlp.linear_fc2.weight                        (H, I)        row          <- down_proj
G query groups (= num_key_value_heads), q = N / G query heads per group, D head_dim. The fused
QKV is group-major: for each group its q query heads, then its key head, then its value head, so
a tensor-parallel rank holds G / tp whole groups (a contiguous dim-0 chunk). The fused fc1 is
[gate_r; up_r] per tensor-parallel rank r, so its full layout depends on tp (`fc1_to_megatron`).
Outside the layers: embedding.word_embeddings.weight <- model.embed_tokens.weight (column, rows
padded to a multiple of tp), decoder.final_layernorm.weight <- model.norm.weight, output_layer.weight
<- lm_head.weight (or the embedding when tied); the critic's value head `output_layer.weight/.bias`
<- `score.weight/.bias` (replicated).

All functions are pure: full tensors in, full (or one rank's) tensors out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.engine.megatron.fused_fc1 import fc1_from_megatron, fc1_to_megatron
from hybridrl.engine.megatron.moe import (
    MOE_MODEL_TYPES,
    hf_moe_to_megatron,
    megatron_moe_to_hf,
    moe_arch_fields,
)

__all__ = [
    "ArchSpec",
    "arch_spec",
    "fc1_from_megatron",
    "fc1_to_megatron",
    "hf_layer_to_megatron",
    "megatron_layer_to_hf",
    "padded_vocab_size",
    "qkv_from_megatron",
    "qkv_to_megatron",
    "shard_dim",
    "SUPPORTED_MODEL_TYPES",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3_moe", "qwen2_moe")
# Megatron name suffix -> tensor-parallel split dim (None: replicated on every TP rank)
_SPLIT_DIMS = {
    "linear_qkv.weight": 0,
    "linear_qkv.bias": 0,
    "linear_fc1.weight": 0,
    "linear_proj.weight": 1,
    "linear_fc2.weight": 1,
    "word_embeddings.weight": 0,
    "eh_proj.weight": 0,  # an MTP layer's projection (ColumnParallelLinear 2H -> H)
}
_PLAIN = {  # layer tensors with a 1:1 rename
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_QK_NORM = {  # Qwen3-style per-head RMSNorm of queries and keys (replicated)
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


@dataclass(frozen=True)
class ArchSpec:
    """What the conversion needs from a Hugging Face config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    initializer_range: float
    # mixture of experts (engine/megatron/moe.py); 0 experts: a dense model
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    qk_layernorm: bool = False
    router_aux_loss_coef: float = 0.0


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (
        isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"
    ):
        raise ValueError(
            f"strategy=megatron: rope type {rope_type!r} is not supported by hybridrl's Megatron conversion "
            "(default RoPE only); use strategy=fsdp for this model"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def arch_spec(hf_config: Any) -> ArchSpec:
    """The ArchSpec of a Qwen2 / Llama config; a clear error for anything else."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"strategy=megatron converts {SUPPORTED_MODEL_TYPES} models; this one is model_type={model_type!r}: "
            "use strategy=fsdp for it"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("strategy=megatron: sliding-window attention is not supported; use strategy=fsdp")
    if model_type == "llama" and (
        getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)
    ):
        raise ValueError(
            "strategy=megatron: Llama attention_bias / mlp_bias are not supported; use strategy=fsdp"
        )
    heads = int(hf_config.num_attention_heads)
    moe: dict[str, Any] = {}
    if model_type in MOE_MODEL_TYPES:
        moe = moe_arch_fields(hf_config)
    return ArchSpec(
        model_type=model_type,
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        ffn_hidden_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        qkv_bias=model_type in ("qwen2", "qwen2_moe")
        or (model_type == "qwen3_moe" and bool(getattr(hf_config, "attention_bias", False))),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_theta=_rope_theta(hf_config),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
        **moe,
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (Megatron splits it evenly)."""
    return -(-vocab_size // tp) * tp


def shard_dim(megatron_name: str) -> int | None:
    """Tensor-parallel split dim of a Megatron parameter (None: replicated)."""
    for suffix, dim in _SPLIT_DIMS.items():
        if megatron_name.endswith(suffix):
            return dim
    if megatron_name == "output_layer.weight":
        return 0  # the LM head; the critic's value head is replicated (see is_value_head)
    return None


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ArchSpec) -> torch.Tensor:
    """Fuse HF q (N*D, ...), k (G*D, ...), v (G*D, ...) into Megatron's group-major (G*(q+2)*D, ...)."""
    g, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g
    rest = q.shape[1:]
    qg = q.reshape(g, per * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (per + 2) * d, *rest)


def qkv_from_megatron(fused: torch.Tensor, spec: ArchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_to_megatron`: (q, k, v) in HF layout."""
    g, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def hf_layer_to_megatron(
    hf: dict[str, torch.Tensor], spec: ArchSpec, tp: int, etp: int = 1
) -> dict[str, torch.Tensor]:
    """One decoder layer: HF suffixes (`self_attn.q_proj.weight`, ...) -> full Megatron tensors.

    etp: the expert-tensor-parallel size (MoE models: the layout of each expert's fc1)."""
    out = {m: hf[h] for m, h in _PLAIN.items()}
    a = "self_attn."
    out["self_attention.linear_qkv.weight"] = qkv_to_megatron(
        hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], spec
    )
    if spec.qkv_bias:
        out["self_attention.linear_qkv.bias"] = qkv_to_megatron(
            hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], spec
        )
    if spec.qk_layernorm:
        out.update({m: hf[h] for m, h in _QK_NORM.items()})
    if spec.num_experts:
        out.update(hf_moe_to_megatron(hf, spec, tp, etp))
        return out
    out["mlp.linear_fc1.weight"] = fc1_to_megatron(hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"], tp)
    out["mlp.linear_fc2.weight"] = hf["mlp.down_proj.weight"]
    return out


def megatron_layer_to_hf(
    mg: dict[str, torch.Tensor], spec: ArchSpec, tp: int, etp: int = 1
) -> dict[str, torch.Tensor]:
    """Inverse of `hf_layer_to_megatron` (full, TP-gathered Megatron tensors in; MoE: every expert)."""
    out = {h: mg[m] for m, h in _PLAIN.items()}
    q, k, v = qkv_from_megatron(mg["self_attention.linear_qkv.weight"], spec)
    out.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v})
    if "self_attention.linear_qkv.bias" in mg:
        qb, kb, vb = qkv_from_megatron(mg["self_attention.linear_qkv.bias"], spec)
        out.update({"self_attn.q_proj.bias": qb, "self_attn.k_proj.bias": kb, "self_attn.v_proj.bias": vb})
    if spec.qk_layernorm:
        out.update({h: mg[m] for m, h in _QK_NORM.items()})
    if spec.num_experts:
        out.update(megatron_moe_to_hf(mg, spec, tp, etp))
        return out
    gate, up = fc1_from_megatron(mg["mlp.linear_fc1.weight"], tp)
    out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
    out["mlp.down_proj.weight"] = mg["mlp.linear_fc2.weight"]
    return out


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (the padded vocabulary)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)
