"""Build Megatron-core GPT models from a Hugging Face config and move weights in and out.

`init_parallel` sets up Megatron's process groups (order tp-cp-ep-dp-pp: the TP ranks of one
model replica are consecutive ranks). `build_model` builds the GPTModel chunks of this rank (one
per virtual pipeline stage) with the CPU-safe settings (local layer spec with RMSNorm, every
fusion off; see cpu_shims). `load_hf_weights` copies a Hugging Face state dict into them;
`iter_hf_params` gathers the TP shards and PP stages back into full HF tensors, a layer at a time.

The critic is the same GPT backbone with the LM head replaced by `ValueHead` (a replicated
Linear(H, 1) with bias, the `score` head of AutoModelForTokenClassification).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.config.megatron import MegatronConfig, expert_tensor_parallel_size
from hybridrl.engine.megatron.convert import (
    ArchSpec,
    hf_layer_to_megatron,
    megatron_layer_to_hf,
    pad_rows,
    padded_vocab_size,
    shard_dim,
)
from hybridrl.engine.megatron.cpu_shims import apply_cpu_shims, cuda_to_cpu, needs_cpu_shims
from hybridrl.engine.megatron.moe import (
    check_moe_overrides,
    expert_shard_dim,
    global_expert_name,
    is_expert_param,
    moe_transformer_kwargs,
    without_te_router_gemm,
)
from hybridrl.utils.device import process_group_timeout_s

__all__ = [
    "SequenceParallelRMSNorm",
    "ValueHead",
    "build_model",
    "init_parallel",
    "iter_hf_params",
    "load_hf_weights",
    "transformer_config",
]

_LAYER_PREFIX = "decoder.layers."


def init_parallel(cfg: MegatronConfig, key: str) -> None:
    """Initialise Megatron's model-parallel groups once per process (same sizes for every role)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    apply_cpu_shims()
    sizes = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.virtual_pipeline_model_parallel_size,
        cfg.context_parallel_size,
        cfg.expert_model_parallel_size,
        expert_tensor_parallel_size(cfg),
    )
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_virtual_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
        )
        if have != sizes:
            raise ValueError(
                f"{key}: (tp, pp, vpp, cp, ep, etp)={sizes} differs from {have} already used by another role in this process; "
                "colocated Megatron roles must use the same parallel sizes"
            )
        return
    with cuda_to_cpu():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=sizes[0],
            pipeline_model_parallel_size=sizes[1],
            virtual_pipeline_model_parallel_size=sizes[2],
            context_parallel_size=sizes[3],
            expert_model_parallel_size=sizes[4],
            expert_tensor_parallel_size=sizes[5],
            # Megatron's groups get the worker's timeout (actor_rollout_ref.nccl_timeout), not its 30 min
            distributed_timeout_minutes=max(1, math.ceil(process_group_timeout_s() / 60)),
        )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed, inference_rng_tracker=True)


def transformer_config(spec: ArchSpec, cfg: MegatronConfig, dtype: torch.dtype, key: str):
    """The TransformerConfig of `spec` with the engine's settings and `override_transformer_config`."""
    from megatron.core.transformer import TransformerConfig

    interleaved = (cfg.virtual_pipeline_model_parallel_size or 1) > 1
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.initializer_range,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size(cfg),
        # Batched p2p posts the sends and receives of both directions in one list; at PP=2 the previous
        # and next stage are the same peer, so an activation and a gradient of the same shape can be
        # matched crosswise (gloo matches by order): the interleaved update was wrong. Per-direction
        # p2p (overlapped, as veRL and Megatron-LM do with virtual stages) keeps them apart.
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=False,
        # Megatron turns sequence parallelism off at TP=1 too (nothing to split over)
        sequence_parallel=cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the default allgather refuses variable lengths
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
        transformer_impl="local",
    )
    kwargs.update(moe_transformer_kwargs(spec))
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name, value in (cfg.override_transformer_config or {}).items():
        if name not in fields:
            raise ValueError(
                f"{key}.override_transformer_config.{name}: megatron-core's TransformerConfig has no field {name!r}"
            )
        kwargs[name] = value
    check_moe_overrides(kwargs, key, on_cpu=needs_cpu_shims())
    return TransformerConfig(**kwargs)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """torch's RMSNorm for Megatron's local layer spec, with sequence parallelism allowed.

    Megatron's `WrappedTorchNorm` refuses `sequence_parallel`; the norm itself needs nothing new
    (it is per token), only its weight's gradient must be summed over the tensor-parallel ranks,
    each of which saw a slice of the sequence: the weight is marked `sequence_parallel`, which
    `finalize_model_grads` all-reduces over the TP group. Without sequence parallelism it is
    exactly `WrappedTorchNorm`'s module.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class HeadRMSNorm(nn.RMSNorm):
    """torch's RMSNorm for the per-head q/k norms (`qk_layernorm`), with sequence parallelism allowed.

    Megatron's `WrappedTorchNorm` refuses `sequence_parallel`; these norms run after the QKV
    projection, where each tensor-parallel rank holds whole heads of every position, and
    megatron-core's `finalize_model_grads` sums the q/k norm gradients over TP by name."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)


class ValueHead(nn.Module):
    """The critic's head: Linear(H, 1) with bias, replicated on every tensor-parallel rank.

    Called like Megatron's output layer: `head(hidden, weight=None, ...) -> (values, None)`, hidden
    (S, B, H), or (S / TP, B, H) with sequence parallelism, gathered here first (every TP rank then
    computes the same values and loss, so the backward only takes each rank's slice back).
    """

    def __init__(
        self, hidden_size: int, std: float, dtype: torch.dtype, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype).normal_(0.0, std))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False
            )
        return nn.functional.linear(hidden, self.weight, self.bias), None


def build_model(spec: ArchSpec, tcfg: Any, role: str, seed: int, mtp: Any = None) -> list[nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage), randomly initialised from `seed`.

    mtp: the actor's `model.mtp` when it trains MTP layers (`tcfg.mtp_num_layers` of them, on the
    last stage: engine/megatron/mtp.py), else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if spec.num_experts:
        without_te_router_gemm()
    layer_spec = get_gpt_layer_local_spec(
        normalization="RMSNorm",
        num_experts=spec.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=spec.qk_layernorm,
    )
    layer_spec.submodules = dataclasses.replace(
        layer_spec.submodules,
        input_layernorm=SequenceParallelRMSNorm,
        pre_mlp_layernorm=SequenceParallelRMSNorm,
    )
    if spec.qk_layernorm:
        attn = layer_spec.submodules.self_attention
        attn.submodules = dataclasses.replace(
            attn.submodules, q_layernorm=HeadRMSNorm, k_layernorm=HeadRMSNorm
        )
    if tcfg.context_parallel_size > 1:  # the local DotProductAttention refuses CP (context_parallel.py)
        from hybridrl.engine.megatron.context_parallel import ContextParallelAttention

        attn = layer_spec.submodules.self_attention
        attn.submodules = dataclasses.replace(attn.submodules, core_attention=ContextParallelAttention)
    tp = ps.get_tensor_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    critic = role == "critic"
    chunks = []
    with torch.random.fork_rng():  # seeds the init only; the worker's global RNG is left as it was
        torch.manual_seed(seed)
        _build_chunks(chunks, spec, tcfg, layer_spec, tp, vpp, critic, role, mtp)
    return chunks


def _build_chunks(chunks, spec, tcfg, layer_spec, tp, vpp, critic, role, mtp=None) -> None:
    """Append the GPTModel of each virtual stage of this rank to `chunks`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        # the block's spec spelt out, so that its final norm is the sequence-parallel one too
        block = TransformerBlockSubmodules(
            layer_specs=[layer_spec] * get_num_layers_to_build(tcfg, vp_stage=vp_stage),
            layer_norm=SequenceParallelRMSNorm,
        )
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        extra, cls = {}, GPTModel
        if mtp is not None and post:
            from hybridrl.engine.megatron import mtp as mtp_lib

            cls = mtp_lib.mtp_gpt_model_class()
            extra["mtp_block_spec"] = mtp_lib.mtp_block_spec(
                layer_spec, SequenceParallelRMSNorm, tcfg.mtp_num_layers
            )
        with cuda_to_cpu():
            model = cls(
                config=tcfg,
                transformer_layer_spec=block,
                vocab_size=padded_vocab_size(spec.vocab_size, tp),
                max_sequence_length=spec.max_position_embeddings,
                pre_process=pre,
                post_process=post,
                parallel_output=True,
                share_embeddings_and_output_weights=spec.tie_word_embeddings and not critic,
                position_embedding_type="rope",
                rotary_base=spec.rope_theta,
                vp_stage=vp_stage,
                **extra,
            )
        if extra:
            model.hybridrl_vocab_size, model.hybridrl_detach_encoder = (
                spec.vocab_size,
                bool(mtp.detach_encoder),
            )
            mtp_lib.drop_unused_output_weight(model)
        if critic and post:
            model.output_layer = ValueHead(
                spec.hidden_size, spec.initializer_range, tcfg.params_dtype, tcfg.sequence_parallel
            )
        if tcfg.bf16:
            # Megatron's local RMSNorm keeps fp32 weights; bf16 everywhere, as Megatron-LM's Float16Module
            # casts (mixed-dtype grad buffers break the distributed optimizer's checkpoint gather).
            model.to(torch.bfloat16)
        model.requires_grad_(role in ("actor", "critic"))
        chunks.append(model)


def _shard_layout(name: str, critic: bool) -> tuple[int | None, int, int, Any]:
    """(split dim, size, this rank's index, group) of a parameter's tensor parallelism: the expert-TP
    group for a routed expert's weights, the TP group for everything else."""
    from megatron.core import parallel_state as ps

    if is_expert_param(name):
        return (
            expert_shard_dim(name),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(check_initialized=False),
        )
    dim = None if (critic and name.startswith("output_layer.")) else shard_dim(name)
    return (
        dim,
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def _tp_shard(name: str, full: torch.Tensor, critic: bool) -> torch.Tensor:
    dim, size, rank, _ = _shard_layout(name, critic)
    return full if dim is None else full.chunk(size, dim=dim)[rank]


def _megatron_full_tensors(
    hf: dict[str, torch.Tensor], spec: ArchSpec, tp: int, critic: bool
) -> dict[str, torch.Tensor]:
    """All full Megatron tensors (global layer and expert numbers) of a HF state dict."""
    from megatron.core import parallel_state as ps

    etp = ps.get_expert_tensor_parallel_world_size() if spec.num_experts else 1
    vocab = padded_vocab_size(spec.vocab_size, tp)
    out = {"embedding.word_embeddings.weight": pad_rows(hf["model.embed_tokens.weight"], vocab)}
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if critic:
        out["output_layer.weight"] = hf["score.weight"]
        out["output_layer.bias"] = hf["score.bias"]
    else:
        head = hf["model.embed_tokens.weight"] if spec.tie_word_embeddings else hf["lm_head.weight"]
        out["output_layer.weight"] = pad_rows(head, vocab)
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        layer = {k[len(prefix) :]: v for k, v in hf.items() if k.startswith(prefix)}
        for name, t in hf_layer_to_megatron(layer, spec, tp, etp).items():
            out[f"{_LAYER_PREFIX}{i}.{name}"] = t
    return out


def global_param_name(local: str, chunk: nn.Module) -> str:
    """A chunk's parameter name with its layer index (layer_number is 1-based) and expert index made global."""
    if not local.startswith(_LAYER_PREFIX):
        return local
    idx, rest = local[len(_LAYER_PREFIX) :].split(".", 1)
    layer = chunk.decoder.layers[int(idx)]
    name = f"{_LAYER_PREFIX}{layer.layer_number - 1}.{rest}"
    if is_expert_param(name):
        from megatron.core import parallel_state as ps

        local_experts = layer.mlp.num_local_experts
        name = global_expert_name(name, ps.get_expert_model_parallel_rank(), local_experts)
    return name


def load_hf_weights(
    chunks: list[nn.Module], hf: dict[str, torch.Tensor], spec: ArchSpec, role: str, mtp_layers: int = 0
) -> None:
    """Copy a full HF state dict into this rank's chunks (each rank takes its TP shard / PP layers).

    mtp_layers: > 0: `hf` also holds that many MTP layers (DeepSeek-V3 names, engine/megatron/mtp.py)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    critic = role == "critic"
    full = _megatron_full_tensors(hf, spec, tp, critic)
    if mtp_layers:
        from hybridrl.engine.megatron.mtp import mtp_full_tensors

        full.update(mtp_full_tensors(hf, spec, tp, mtp_layers))
    with torch.no_grad():
        for chunk in chunks:
            for local, param in chunk.state_dict(keep_vars=True).items():
                if local.endswith("._extra_state") or not isinstance(param, torch.Tensor):
                    continue
                name = global_param_name(local, chunk)
                if name not in full:
                    raise KeyError(f"Megatron parameter {name!r} has no Hugging Face source tensor")
                param.copy_(_tp_shard(name, full[name], critic).to(param.dtype))


def _gather_tp(name: str, local: torch.Tensor, critic: bool) -> torch.Tensor:
    """The full tensor of this rank's shard (gathered over its TP group, or expert-TP group)."""
    dim, size, _, group = _shard_layout(name, critic)
    if size == 1 or dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _expert_owner(name: str, num_local_experts: int) -> int:
    """The EP rank that holds a routed expert's weight (-1: every EP rank has the tensor)."""
    if not is_expert_param(name):
        return -1
    return int(name.split("local_experts.", 1)[1].split(".", 1)[0]) // num_local_experts


def _bucket_of(name: str) -> tuple[int, int]:
    """Sort key of the bucket a Megatron name belongs to: embedding, each layer, then the head."""
    if name.startswith(_LAYER_PREFIX):
        return (1, int(name[len(_LAYER_PREFIX) :].split(".", 1)[0]))
    return (0, 0) if name.startswith("embedding.") else (2, 0)


def _local_params(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """{global Megatron name: this rank's (TP-sharded) tensor} of this PP stage."""
    from hybridrl.engine.megatron.lora import export_params  # LoRA: merged weights, no factors

    return {global_param_name(n, c): p for c in chunks for n, p in export_params(c)}


def _gather_meta(mine: list, group: Any, size: int) -> list:
    """Every rank's entries of `group` in rank order, a name held by several ranks once."""
    if size == 1:
        return mine
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, mine, group=group)
    seen, out = set(), []
    for entry in (e for part in parts for e in part):
        if entry[0] not in seen:
            seen.add(entry[0])
            out.append(entry)
    return out


def _stage_meta(local: dict[str, torch.Tensor], critic: bool) -> list[tuple[str, int, tuple, Any]]:
    """(name, owning PP stage, full shape, dtype) of every tensor of the model, the same on every rank.

    With expert parallelism each EP rank lists its own experts; the lists are joined over the EP group."""
    from megatron.core import parallel_state as ps

    mine = []
    for name, t in local.items():
        dim, size, _, _ = _shard_layout(name, critic)
        shape = list(t.shape)
        if dim is not None:
            shape[dim] *= size
        mine.append((name, ps.get_pipeline_model_parallel_rank(), tuple(shape), t.dtype))
    ep = ps.get_expert_model_parallel_world_size()
    mine = _gather_meta(mine, ps.get_expert_model_parallel_group(check_initialized=False), ep)
    return _gather_meta(
        mine, ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
    )


def _iter_full_buckets(
    chunks: list[nn.Module], critic: bool, num_local_experts: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Full Megatron tensors one bucket (the embedding, one layer, the head) at a time, on every rank.

    The owning stage all-gathers the bucket's TP shards, then broadcasts it over the PP group, so
    at most one bucket of full tensors exists beyond the model itself. A routed expert's weight is
    first broadcast over the expert-parallel group from the EP rank that holds it.
    """
    from megatron.core import parallel_state as ps

    local = _local_params(chunks)
    meta = _stage_meta(local, critic)
    pp, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if pp > 1 else None
    ep, ep_me = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    ep_group = ps.get_expert_model_parallel_group(check_initialized=False) if ep > 1 else None
    ep_ranks = dist.get_process_group_ranks(ep_group) if ep > 1 else None
    buckets: dict[tuple[int, int], list] = {}
    for entry in meta:
        buckets.setdefault(_bucket_of(entry[0]), []).append(entry)
    for key in sorted(buckets):
        out: dict[str, torch.Tensor] = {}
        for name, stage, shape, dtype in buckets[key]:
            owner = _expert_owner(name, num_local_experts) if ep > 1 else -1
            held = stage == me and owner in (-1, ep_me)
            t = _gather_tp(name, local[name], critic) if held else torch.empty(shape, dtype=dtype)
            if owner >= 0:
                t = t.contiguous()
                dist.broadcast(t, src=ep_ranks[owner], group=ep_group)
            if pp > 1:
                t = t.contiguous()
                dist.broadcast(t, src=ranks[stage], group=ps.get_pipeline_model_parallel_group())
            out[name] = t
        yield out


def iter_hf_params(chunks: list[nn.Module], spec: ArchSpec, role: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the whole model on every rank (a collective over TP, PP and EP).

    Gathered one bucket (embedding, one decoder layer, final norm + head) at a time. Tied
    embeddings appear once (`model.embed_tokens.weight`), as in the FSDP engine. The padded
    vocabulary rows are cut off.
    """
    from megatron.core import parallel_state as ps

    critic = role == "critic"
    tp = ps.get_tensor_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size() if spec.num_experts else 1
    local_experts = spec.num_experts // ps.get_expert_model_parallel_world_size()
    v = spec.vocab_size
    for bucket in _iter_full_buckets(chunks, critic, local_experts):
        if "embedding.word_embeddings.weight" in bucket:
            yield "model.embed_tokens.weight", bucket["embedding.word_embeddings.weight"][:v]
        layers = sorted(
            {int(k[len(_LAYER_PREFIX) :].split(".", 1)[0]) for k in bucket if k.startswith(_LAYER_PREFIX)}
        )
        for i in layers:
            prefix = f"{_LAYER_PREFIX}{i}."
            layer = {k[len(prefix) :]: t for k, t in bucket.items() if k.startswith(prefix)}
            for name, t in megatron_layer_to_hf(layer, spec, tp, etp).items():
                yield f"model.layers.{i}.{name}", t
        if "decoder.final_layernorm.weight" in bucket:
            yield "model.norm.weight", bucket["decoder.final_layernorm.weight"]
            if critic:
                yield "score.weight", bucket["output_layer.weight"]
                yield "score.bias", bucket["output_layer.bias"]
            elif not spec.tie_word_embeddings:
                yield "lm_head.weight", bucket["output_layer.weight"][:v]
