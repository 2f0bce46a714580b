"""Mixture-of-experts models in the Megatron engine: the HF <-> Megatron mapping of the MoE block.

Families (Hugging Face model types):
    qwen3_moe   Qwen3MoeForCausalLM: routed experts only, q/k RMSNorm per head, no qkv bias,
                top-k probabilities renormalised (`norm_topk_prob`).
    qwen2_moe   Qwen2MoeForCausalLM: routed experts plus one shared expert whose output is scaled
                by sigmoid(shared_expert_gate(x)); qkv bias; `norm_topk_prob` as configured.
Every decoder layer must be a MoE layer (`decoder_sparse_step=1`, no `mlp_only_layers`).

Megatron layout of the MoE block (megatron-core's MoELayer with SequentialMLP experts, the local
layer spec), per decoder layer:
    mlp.router.weight                                 (E, H)        replicated <- mlp.gate.weight
    mlp.experts.local_experts.{j}.linear_fc1.weight   (2I, H)       expert-TP column
                                                       <- mlp.experts.gate_up_proj[e] (gate; up)
    mlp.experts.local_experts.{j}.linear_fc2.weight   (H, I)        expert-TP row
                                                       <- mlp.experts.down_proj[e]
    mlp.shared_experts.linear_fc1.weight              (2S, H)       TP column  <- shared_expert.gate/up
    mlp.shared_experts.linear_fc2.weight              (H, S)        TP row     <- shared_expert.down
    mlp.shared_experts.gate_weight                    (1, H)        replicated <- shared_expert_gate
E experts, I the expert FFN width (`moe_intermediate_size`), S the shared expert's. With expert
parallelism (EP) each EP rank holds E / EP experts: local expert j of EP rank r is global expert
r * E / EP + j. The full tensors below always use global expert numbers
(`mlp.experts.local_experts.{e}` with e < E); `local_expert_name` and `global_expert_name` move
between the two. With expert tensor parallelism (ETP) each expert's fc1 is split like a dense
fc1 (`[gate_r; up_r]` per ETP rank r) and its fc2 along its input dim.

Routing: HF takes softmax over all E logits, the top-k of those, and renormalises them when
`norm_topk_prob`; Megatron's `moe_router_pre_softmax=False` takes the top-k logits and a softmax
over them, which is the same renormalised distribution; without `norm_topk_prob` Megatron's
`moe_router_pre_softmax=True` (softmax first, no renormalisation) is HF's rule.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from hybridrl.engine.megatron.fused_fc1 import fc1_from_megatron, fc1_to_megatron

__all__ = [
    "MOE_MODEL_TYPES",
    "check_moe_overrides",
    "expert_params_as_expert_parallel",
    "expert_shard_dim",
    "global_expert_name",
    "hf_moe_to_megatron",
    "is_expert_param",
    "local_expert_name",
    "megatron_moe_to_hf",
    "moe_arch_fields",
    "moe_transformer_kwargs",
    "without_te_router_gemm",
]

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
_EXPERT = re.compile(r"^(.*\bmlp\.experts\.local_experts\.)(\d+)(\..*)$")


def moe_arch_fields(hf_config: Any) -> dict[str, Any]:
    """The MoE fields of an ArchSpec from a qwen3_moe / qwen2_moe config; a clear error otherwise."""
    model_type = hf_config.model_type
    if getattr(hf_config, "mlp_only_layers", None) or int(getattr(hf_config, "decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"strategy=megatron: {model_type} with dense layers between the MoE layers (mlp_only_layers="
            f"{getattr(hf_config, 'mlp_only_layers', None)}, decoder_sparse_step="
            f"{getattr(hf_config, 'decoder_sparse_step', 1)}) is not converted; every layer must be a MoE layer "
            "(decoder_sparse_step=1, mlp_only_layers=[]), or use strategy=fsdp"
        )
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return dict(
        num_experts=int(hf_config.num_experts),
        moe_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        qk_layernorm=model_type == "qwen3_moe",
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
    )


def moe_transformer_kwargs(spec: Any) -> dict[str, Any]:
    """TransformerConfig fields of a MoE ArchSpec (empty for a dense one).

    Dropless routing (no capacity factor), SequentialMLP experts (`moe_grouped_gemm=False`: the
    grouped GEMM kernels need CUDA), the all-to-all dispatcher (works over gloo and nccl), fp32
    router, no fused permute. The load-balancing auxiliary loss coefficient is the model's
    `router_aux_loss_coef`; `override_transformer_config.moe_aux_loss_coeff` replaces it.
    """
    if not spec.num_experts:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=spec.shared_expert_gate,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=spec.router_aux_loss_coef,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=True,
        qk_layernorm=spec.qk_layernorm,
    )


_CPU_REFUSED = {  # TransformerConfig field -> (values that need CUDA kernels, why)
    "moe_token_dispatcher_type": (("flex",), "the flex dispatcher runs DeepEP / HybridEP CUDA kernels"),
    "moe_enable_deepep": ((True,), "DeepEP is a CUDA library"),
    "moe_permute_fusion": ((True,), "the fused permutation is a Transformer Engine CUDA kernel"),
    "moe_grouped_gemm": ((True,), "grouped GEMM experts need CUDA kernels"),
    "moe_router_fusion": ((True,), "the fused router is a Transformer Engine CUDA kernel"),
}


def check_moe_overrides(kwargs: dict[str, Any], key: str, on_cpu: bool) -> None:
    """Refuse, on a machine without CUDA, MoE settings of `override_transformer_config` that need CUDA.

    (veRL's MoE scripts set DeepEP, the flex dispatcher and fused permutation for GPUs; on GPUs they
    go to megatron-core as given.)"""
    if not on_cpu or not kwargs.get("num_moe_experts"):
        return
    for name, (bad, why) in _CPU_REFUSED.items():
        if kwargs.get(name) in bad:
            raise ValueError(
                f"{key}.override_transformer_config.{name}={kwargs[name]}: {why}; this machine has no CUDA. "
                "Drop the override (the engine uses the all-to-all dispatcher and SequentialMLP experts on CPU)"
            )


def without_te_router_gemm() -> None:
    """megatron-core 0.16's router GEMM reads a module global `te_general_gemm` that is only defined
    when Transformer Engine imports; without it (the local layer spec) the router raises NameError.
    Define it as None, megatron's own "no Transformer Engine" value (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def expert_params_as_expert_parallel(chunks: list[Any], cfg: Any) -> None:
    """Mark the routed experts' weights expert-parallel (`allreduce=False`) at EP=1 too.

    Megatron marks them only at EP > 1, and its optimizer chains a separate expert optimizer only
    for marked weights, so the optimizer state of an EP=2 checkpoint has another structure than
    an EP=1 optimizer's. Marked at every EP size, the structure is the same and a checkpoint loads
    at any EP size. At EP=1 the expert-data-parallel group is the data-parallel group when the
    expert-TP size equals the TP size, so nothing else changes; with another expert-TP size at EP=1
    Megatron's own layout is kept (a checkpoint then reloads at EP=1 only).
    """
    from hybridrl.config.megatron import expert_tensor_parallel_size

    if (
        cfg.expert_model_parallel_size > 1
        or expert_tensor_parallel_size(cfg) != cfg.tensor_model_parallel_size
    ):
        return
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if is_expert_param(name):
                param.allreduce = False


def is_expert_param(name: str) -> bool:
    """True for a routed expert's weight (sharded over expert parallelism)."""
    return _EXPERT.match(name) is not None


def expert_shard_dim(name: str) -> int | None:
    """Expert-tensor-parallel split dim of a routed expert's weight."""
    if name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith("linear_fc2.weight"):
        return 1
    return None


def global_expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """`...local_experts.{j}...` of EP rank `ep_rank` -> `...local_experts.{global e}...`."""
    m = _EXPERT.match(name)
    if m is None:
        return name
    return f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}"


def local_expert_name(name: str, local_experts: int) -> tuple[str, int]:
    """Inverse of `global_expert_name`: (local name, owning EP rank)."""
    m = _EXPERT.match(name)
    e = int(m.group(2))
    return f"{m.group(1)}{e % local_experts}{m.group(3)}", e // local_experts


def hf_moe_to_megatron(hf: dict[str, torch.Tensor], spec: Any, tp: int, etp: int) -> dict[str, torch.Tensor]:
    """One layer's MoE block: HF suffixes (`mlp.gate.weight`, ...) -> full Megatron tensors."""
    out = {"mlp.router.weight": hf["mlp.gate.weight"]}
    gate_up, down = hf["mlp.experts.gate_up_proj"], hf["mlp.experts.down_proj"]
    for e in range(spec.num_experts):
        gate, up = gate_up[e].chunk(2, dim=0)
        out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1_to_megatron(gate, up, etp)
        out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    if spec.shared_expert_ffn_hidden_size:
        s = "mlp.shared_expert."
        out["mlp.shared_experts.linear_fc1.weight"] = fc1_to_megatron(
            hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"], tp
        )
        out["mlp.shared_experts.linear_fc2.weight"] = hf[s + "down_proj.weight"]
        out["mlp.shared_experts.gate_weight"] = hf["mlp.shared_expert_gate.weight"]
    return out


def megatron_moe_to_hf(mg: dict[str, torch.Tensor], spec: Any, tp: int, etp: int) -> dict[str, torch.Tensor]:
    """Inverse of `hf_moe_to_megatron` (full tensors of every expert in)."""
    out = {"mlp.gate.weight": mg["mlp.router.weight"]}
    gate_up, down = [], []
    for e in range(spec.num_experts):
        gate, up = fc1_from_megatron(mg[f"mlp.experts.local_experts.{e}.linear_fc1.weight"], etp)
        gate_up.append(torch.cat([gate, up], dim=0))
        down.append(mg[f"mlp.experts.local_experts.{e}.linear_fc2.weight"])
    out["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    out["mlp.experts.down_proj"] = torch.stack(down)
    if spec.shared_expert_ffn_hidden_size:
        gate, up = fc1_from_megatron(mg["mlp.shared_experts.linear_fc1.weight"], tp)
        out["mlp.shared_expert.gate_proj.weight"] = gate
        out["mlp.shared_expert.up_proj.weight"] = up
        out["mlp.shared_expert.down_proj.weight"] = mg["mlp.shared_experts.linear_fc2.weight"]
        out["mlp.shared_expert_gate.weight"] = mg["mlp.shared_experts.gate_weight"]
    return out
