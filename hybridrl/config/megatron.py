"""`*.megatron` sections (actor, ref, critic): veRL's Megatron keys and what hybridrl does with them.

Every key is honoured or refused at start-up by `validate_megatron_config`:

    tensor_model_parallel_size / pipeline_model_parallel_size   honoured (TP, PP with 1F1B)
    virtual_pipeline_model_parallel_size                        honoured (interleaved 1F1B); each batch
                                                                must split into a multiple of PP micro-batches
    context_parallel_size                                       honoured (engine/megatron/context_parallel.py:
                                                                load-balanced chunks, K/V all-gathered over
                                                                CP), with PP (and VPP) too: each stage's CP
                                                                ranks pass (L / CP)-long activations
    expert_model_parallel_size                                  honoured on MoE models (qwen3_moe,
                                                                qwen2_moe; engine/megatron/moe.py): the
                                                                experts split over EP ranks carved out
                                                                of the data-parallel ranks; must divide
                                                                the experts
    expert_tensor_parallel_size                                 honoured: null = the TP size (Megatron's
                                                                default), 1 = whole experts per rank
    sequence_parallel                                           ignored at TP=1 (as in Megatron); turned
                                                                on at EP>1 with TP>1 (required there);
                                                                honoured at TP>1 (sequence-parallel
                                                                norms in the local layer spec,
                                                                engine/megatron/model.py)
    use_distributed_optimizer                                   honoured (Megatron's DistributedOptimizer)
    param_offload / grad_offload / optimizer_offload            no-ops on CPU (everything is in host
                                                                memory, like the FSDP engine's);
                                                                refused on GPU (not implemented)
    use_mbridge                                                 accepted: hybridrl always converts
                                                                HF <-> Megatron with its own bridge
                                                                (megatron/convert.py), which is what
                                                                use_mbridge=True asks veRL for
    seed                                                        honoured (init and Megatron's RNG tracker)
    override_transformer_config.*                               applied to the TransformerConfig;
                                                                an unknown field is refused
    override_optimizer_config.*                                 veRL's optim.override_optimizer_config (moved
                                                                here at load): set on megatron-core's
                                                                OptimizerConfig (engine/megatron/optim_config.py);
                                                                an unknown field is refused, CUDA-only ones
                                                                (optimizer CPU offload, precision-aware
                                                                optimizer) are refused without CUDA
    use_dist_checkpointing + dist_checkpointing_path            honoured: the initial weights are read
                                                                from that Megatron dist checkpoint
                                                                instead of the HF folder
    dtype                                                       honoured: bfloat16 (veRL's default) or
                                                                float32 parameters; bf16 keeps fp32 main
                                                                params and grads in Megatron's optimizer
                                                                and DDP; float16 refused
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MEGATRON_STRATEGY",
    "MegatronConfig",
    "MtpConfig",
    "megatron_param_dtype",
    "check_colocated_megatron",
    "expert_tensor_parallel_size",
    "resolve_fused_kernels",
    "validate_megatron_config",
    "validate_mtp",
]

MEGATRON_STRATEGY = "megatron"


@dataclass
class MegatronConfig:
    """veRL's `actor_rollout_ref.actor.megatron` (and `ref.megatron`, `critic.megatron`)."""

    tensor_model_parallel_size: int = 1  # tensor-parallel size (TP)
    pipeline_model_parallel_size: int = 1  # pipeline-parallel size (PP, 1F1B schedule)
    # interleaved virtual stages per PP rank (null: off)
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1  # context-parallel size (CP)
    expert_model_parallel_size: int = 1  # expert parallelism (EP) of MoE models, over the DP ranks
    expert_tensor_parallel_size: int | None = None  # TP inside each expert (null: the TP size)
    sequence_parallel: bool = False  # sequence-parallel norms at TP > 1 (ignored at TP = 1)
    use_distributed_optimizer: bool = True  # Megatron's DistributedOptimizer
    param_offload: bool = False  # no-op on CPU; refused on GPU
    grad_offload: bool = False  # no-op on CPU; refused on GPU
    optimizer_offload: bool = False  # no-op on CPU; refused on GPU
    use_mbridge: bool = False  # accepted; HF <-> Megatron always goes through hybridrl's bridge
    seed: int = 42  # seed of the init and of Megatron's RNG tracker
    # fields set on the TransformerConfig
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    # fields set on megatron-core's OptimizerConfig (veRL's optim.override_optimizer_config, moved here)
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)
    use_dist_checkpointing: bool = False  # read the initial weights from a Megatron dist checkpoint
    dist_checkpointing_path: str | None = None  # that checkpoint's folder
    dtype: str = "bfloat16"  # parameter dtype: bfloat16 or float32 (float16 refused)

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica: TP x PP x CP (the CP ranks share the rows, each its chunks)."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def megatron_param_dtype(cfg: MegatronConfig, key: str) -> str:
    """`megatron.dtype` as 'bfloat16' or 'float32'; float16 and unknown names are refused."""
    name = str(cfg.dtype).lower()
    if name in ("float16", "fp16", "half"):
        raise ValueError(
            f"{key}.dtype={cfg.dtype}: float16 (with Megatron's loss scaler) is not supported by hybridrl's "
            "Megatron engine; use bfloat16 or float32"
        )
    if name not in _DTYPES:
        raise ValueError(f"{key}.dtype={cfg.dtype!r}: expected bfloat16 or float32")
    return _DTYPES[name]


def resolve_fused_kernels(model: Any, strategy: str, model_key: str, explicit: bool) -> None:
    """`model.use_fused_kernels` with strategy=megatron. True set by the user is veRL's fused Megatron
    path: log-probs and entropy from the final hidden states and the output weight, chunk by chunk,
    never keeping the logits (engine/megatron/fused_head.py). hybridrl's FSDP default True, not set by
    the user, becomes False (veRL's Megatron default): log-probs from the vocabulary-parallel logits."""
    if strategy != MEGATRON_STRATEGY or not model.use_fused_kernels:
        return
    if explicit and model_key.startswith("critic"):
        raise ValueError(
            f"{model_key}.use_fused_kernels=True with strategy=megatron: the Megatron critic's value head has one "
            f"output per position, no vocabulary logits to fuse. Set {model_key}.use_fused_kernels=false"
        )
    if not explicit:
        model.use_fused_kernels = False


def check_colocated_megatron(roles: dict[str, tuple[str, MegatronConfig]]) -> None:
    """Colocated Megatron roles (one process per slot) share Megatron's process groups: refuse
    different (tp, pp, vpp, cp, ep, etp) sizes at start-up. `roles`: config key -> (strategy, megatron config)."""
    seen: dict[tuple, str] = {}
    for key, (strategy, cfg) in roles.items():
        if strategy != MEGATRON_STRATEGY:
            continue
        sizes = (
            cfg.tensor_model_parallel_size,
            cfg.pipeline_model_parallel_size,
            cfg.virtual_pipeline_model_parallel_size,
            cfg.context_parallel_size,
            cfg.expert_model_parallel_size,
            expert_tensor_parallel_size(cfg),
        )
        if seen and sizes not in seen:
            other = next(iter(seen.values()))
            raise ValueError(
                f"{key}.megatron (tp, pp, vpp, cp, ep, etp)={sizes} differs from {other}.megatron's {next(iter(seen))}: colocated "
                "Megatron roles share one set of process groups; give them the same parallel sizes"
            )
        seen.setdefault(sizes, key)


def _positive(key: str, name: str, value: int | None) -> None:
    if value is not None and int(value) < 1:
        raise ValueError(f"{key}.{name} must be >= 1, got {value}")


def validate_megatron_config(
    cfg: MegatronConfig, key: str, *, world_size: int | None = None, on_gpu: bool = False
) -> None:
    """Refuse what the Megatron engine does not do, naming the key and the fix."""
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        _positive(key, name, getattr(cfg, name))
    _validate_expert_parallel(cfg, key, world_size)
    if on_gpu and (cfg.param_offload or cfg.grad_offload or cfg.optimizer_offload):
        raise ValueError(
            f"{key}.param_offload / grad_offload / optimizer_offload: offloading is not implemented for the Megatron "
            "engine on GPU; set them to False"
        )
    megatron_param_dtype(cfg, key)
    if cfg.use_dist_checkpointing and not cfg.dist_checkpointing_path:
        raise ValueError(f"{key}.use_dist_checkpointing=True needs {key}.dist_checkpointing_path")
    vpp = cfg.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and cfg.pipeline_model_parallel_size < 2:
        raise ValueError(
            f"{key}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2 (virtual "
            "stages interleave the layers of several pipeline ranks); set it to null or raise the PP size"
        )
    if world_size is not None and world_size % cfg.model_parallel_size:
        raise ValueError(
            f"{key}: tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size = "
            f"{cfg.model_parallel_size} must divide the number of ranks ({world_size}); change the sizes or "
            "trainer.n_gpus_per_node"
        )


def expert_tensor_parallel_size(cfg: MegatronConfig) -> int:
    """The expert-TP size in effect (null: the TP size, as in Megatron)."""
    etp = cfg.expert_tensor_parallel_size
    return cfg.tensor_model_parallel_size if etp is None else int(etp)


def _validate_expert_parallel(cfg: MegatronConfig, key: str, world_size: int | None) -> None:
    """EP / ETP sizes: positive and a layout of the ranks (the model's expert count is checked at build)."""
    _positive(key, "expert_model_parallel_size", cfg.expert_model_parallel_size)
    _positive(key, "expert_tensor_parallel_size", cfg.expert_tensor_parallel_size)
    ep, etp, tp = (
        cfg.expert_model_parallel_size,
        expert_tensor_parallel_size(cfg),
        cfg.tensor_model_parallel_size,
    )
    if ep > 1 and tp > 1 and not cfg.sequence_parallel:
        # megatron-core's MoE layer requires SP here, and veRL's default for sequence_parallel is true
        print(
            f"[hybridrl] {key}.sequence_parallel=True: expert_model_parallel_size={ep} with "
            f"tensor_model_parallel_size={tp} needs sequence parallelism (megatron-core's MoE layer; veRL's default)"
        )
        cfg.sequence_parallel = True
    expert_ranks = etp * ep * cfg.pipeline_model_parallel_size
    if world_size is not None and world_size % expert_ranks:
        raise ValueError(
            f"{key}: expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size = "
            f"{expert_ranks} must divide the number of ranks ({world_size}); change the sizes or "
            "trainer.n_gpus_per_node"
        )


@dataclass
class MtpConfig:
    """veRL's `actor_rollout_ref.model.mtp` (multi-token prediction; engine/megatron/mtp.py).

    enable: build and load the model's MTP layers (DeepSeek-V3 layout) in the Megatron actor;
    enable_train: also train them with the MTP loss x mtp_loss_scaling_factor (detach_encoder: the
    MTP loss trains the MTP layers only). enable_rollout: the rollout engine decodes speculatively
    with the model's MTP head (vLLM: speculative_config {method, num_speculative_tokens}; SGLang:
    speculative_algorithm / _num_steps / _eagle_topk / _num_draft_tokens), see `validate_mtp`.
    """

    enable: bool = False
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False
    mtp_loss_scaling_factor: float = 0.1  # weight of the MTP loss with enable_train
    speculative_algorithm: str = "EAGLE"
    speculative_num_steps: int = 3  # SGLang speculative decoding: draft steps
    speculative_eagle_topk: int = 1  # SGLang speculative decoding: EAGLE top-k
    speculative_num_draft_tokens: int = 4  # SGLang speculative decoding: draft tokens
    method: str = "mtp"
    num_speculative_tokens: int = 1  # vLLM speculative_config: tokens proposed per step


def validate_mtp(
    mtp: MtpConfig,
    strategy: str,
    key: str = "actor_rollout_ref.model",
    rollout: Any = None,
    megatron: Any = None,
) -> None:
    """Start-up checks of `model.mtp` (nothing when enable=False: veRL then reads none of its keys).

    With enable_rollout the engine settings go into `rollout.engine_kwargs` (what veRL's vLLM and
    SGLang servers pass; a key the user already set there wins). The weight sync carries the main
    model only, so the engine's draft head keeps the MTP weights it loaded from the model folder:
    speculative decoding stays exact (the policy verifies every draft token), only the acceptance
    rate can fall as the policy moves. GPU paths, untested on this CPU machine.
    """
    if not mtp.enable:
        return
    if str(strategy) != MEGATRON_STRATEGY:
        raise ValueError(
            f"{key}.mtp.enable=True needs actor strategy=megatron: multi-token prediction is implemented on the "
            "Megatron engine only (as in veRL); set actor_rollout_ref.actor.strategy=megatron or mtp.enable=False"
        )
    if mtp.mtp_loss_scaling_factor < 0:
        raise ValueError(f"{key}.mtp.mtp_loss_scaling_factor must be >= 0, got {mtp.mtp_loss_scaling_factor}")
    if mtp.enable_rollout and rollout is not None:
        _mtp_rollout_kwargs(mtp, rollout, key)


def _mtp_rollout_kwargs(mtp: MtpConfig, rollout: Any, key: str) -> None:
    """veRL's speculative-decoding engine arguments of `model.mtp` into rollout.engine_kwargs."""
    name = str(rollout.name)
    if name == "vllm":
        user = dict(rollout.engine_kwargs.vllm)
        spec = {"method": mtp.method, "num_speculative_tokens": int(mtp.num_speculative_tokens)}
        spec.update(user.get("speculative_config") or {})
        rollout.engine_kwargs.vllm = {**user, "speculative_config": spec}
    elif name == "sglang":
        spec = {
            "speculative_algorithm": mtp.speculative_algorithm,
            "speculative_num_steps": mtp.speculative_num_steps,
            "speculative_eagle_topk": mtp.speculative_eagle_topk,
            "speculative_num_draft_tokens": mtp.speculative_num_draft_tokens,
        }
        rollout.engine_kwargs.sglang = {**spec, **dict(rollout.engine_kwargs.sglang)}
    else:
        raise ValueError(
            f"{key}.mtp.enable_rollout=True with rollout.name={name}: speculative decoding with the MTP head needs "
            "the vllm or sglang rollout (Hugging Face generate has none); set mtp.enable_rollout=False"
        )
