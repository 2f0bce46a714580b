"""MegatronEngine: a Megatron-core GPT model of one role with Megatron's DDP, optimizer and schedules.

The engine the workers build for `strategy=megatron` (actor, ref, critic), beside `FSDPEngine`.
It holds this rank's model chunks (one per virtual pipeline stage; wrapped in Megatron's
DistributedDataParallel when trained), Megatron's optimizer (AdamW, plain or distributed) and an
lr schedule with the FSDP engine's semantics. Weights come from the role's Hugging Face folder
(`model.path`, or 'builtin:tiny') through hybridrl's own HF <-> Megatron mapping (convert.py), or
from a Megatron dist checkpoint (`megatron.use_dist_checkpointing`).

Megatron's weight-decay rule applies: biases and norm weights get no weight decay (the FSDP
engine decays every parameter); with weight_decay=0 the two engines take identical steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.config.megatron import (
    MegatronConfig,
    megatron_param_dtype,
    validate_megatron_config,
)
from hybridrl.config.roles import ModelConfig, OptimConfig
from hybridrl.engine.base import (
    EngineBuildSpec,
    LogProbRequest,
    LogProbs,
    LossFn,
    PerfModel,
    ScoreRequest,
    TrainEngine,
    ValueRequest,
    register_engine,
)
from hybridrl.engine.megatron import lora as lora_lib
from hybridrl.engine.megatron import mtp as mtp_lib
from hybridrl.engine.megatron.context_parallel import cp_group_info
from hybridrl.engine.megatron.convert import ArchSpec, arch_spec
from hybridrl.engine.megatron.cpu_shims import cuda_to_cpu, needs_cpu_shims
from hybridrl.engine.megatron.dispatch import broadcast_from_last_stage
from hybridrl.engine.megatron.forward import run_schedule
from hybridrl.engine.megatron.fused_head import (
    fused_logprobs_entropy,
    head_logits,
    head_weight,
    use_fused_head,
)
from hybridrl.engine.megatron.model import (
    build_model,
    global_param_name,
    init_parallel,
    iter_hf_params,
    load_hf_weights,
    transformer_config,
)
from hybridrl.engine.megatron.moe import expert_params_as_expert_parallel
from hybridrl.engine.megatron.moe_metrics import router_stats_for
from hybridrl.engine.megatron.optimizer import ParamGroupLR, build_optimizer, wrap_ddp
from hybridrl.engine.megatron.routing_replay import RoutingReplay
from hybridrl.engine.megatron.vocab_parallel import vocab_parallel_logprobs_entropy
from hybridrl.engine.megatron.vocab_parallel_topk import topk_log_probs
from hybridrl.utils.flops import attention_dims

__all__ = ["MegatronEngine", "ParamGroupLR", "num_dense_params"]

logger = logging.getLogger(__name__)


def _hf_state_dict(
    model_config: ModelConfig, role: str, key: str, seed: int
) -> tuple[dict[str, torch.Tensor], Any]:
    """The role's HF model weights (critic: the token-classification model, head included) and config.

    Built under `torch.manual_seed(seed)` (megatron.seed) in a forked RNG: what transformers
    initialises afresh (the critic's value head, a model built from scratch) is the same in every
    launch. A Ray worker's torch RNG starts from a random seed, so without this a resumed run's
    uninterrupted twin had a different critic from step 1 on.
    """
    from hybridrl.models.hf import build_hf_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = build_hf_model(model_config, role=role, dtype=torch.float32, key=key)
    return {k: v.detach() for k, v in hf.state_dict().items()}, hf.config


def num_dense_params(spec: ArchSpec) -> int:
    """Non-embedding parameters of the model a token goes through (the N of the 6N FLOP rule; MoE: the
    router, top-k routed experts and the shared expert)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    bias = (spec.num_heads + 2 * spec.num_kv_heads) * d if spec.qkv_bias else 0
    mlp = 3 * h * spec.ffn_hidden_size
    if spec.num_experts:
        shared = 3 * h * spec.shared_expert_ffn_hidden_size + (h if spec.shared_expert_gate else 0)
        mlp = spec.num_experts * h + spec.moe_topk * 3 * h * spec.moe_ffn_hidden_size + shared
    return spec.num_layers * (attn + bias + mlp + 2 * h) + h


@dataclass
class MegatronEngine(TrainEngine):
    """Megatron model chunks of one role on this rank, with optimizer and lr schedule (None for ref).

    Every rank of one model replica (its TP x PP ranks) gets the same rows; outputs exist on the
    last pipeline stage and are broadcast to the others, so every rank returns them.
    """

    weight_loaders = ("megatron",)  # class attribute (not a dataclass field: no annotation)

    chunks: list[Any]
    spec: ArchSpec
    hf_config: Any
    megatron_config: MegatronConfig
    model_config: ModelConfig
    role: str
    optimizer: Any = None
    lr_scheduler: Any = None
    tokenizer: Any = None
    max_grad_norm: float = 0.0
    mtp_layers: int = (
        0  # MTP layers built (model.mtp.enable), trained with mtp_train (engine/megatron/mtp.py)
    )
    mtp_train: bool = False
    routing_replay: Any = None  # a MoE model's RoutingReplay (engine/megatron/routing_replay.py)
    fused_head: bool = False  # model.use_fused_kernels: log-probs from the hidden states (fused_head.py)
    router_stats: Any = None  # a MoE actor's routing metrics (engine/megatron/moe_metrics.py)

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        megatron_config: MegatronConfig,
        optim_config: OptimConfig | None = None,
        *,
        role: str = "actor",
        key: str = "actor_rollout_ref.actor.megatron",
        model_key: str = "actor_rollout_ref.model",
        optim_key: str | None = None,
        max_grad_norm: float = 0.0,
        load_tok: bool = True,
    ) -> MegatronEngine:
        """Build this rank's part of the model of `role` (a collective over all ranks)."""
        from hybridrl.models.hf import load_tokenizer

        if not dist.is_initialized():
            raise RuntimeError("MegatronEngine.build needs torch.distributed: call init_process_group first")
        validate_megatron_config(
            megatron_config, key, world_size=dist.get_world_size(), on_gpu=not needs_cpu_shims()
        )
        init_parallel(megatron_config, key)
        _log_bridge(megatron_config.use_mbridge, key)
        base_config = dataclasses.replace(model_config, lora_rank=0)  # adapters are added below (lora.py)
        hf_sd, hf_config = _hf_state_dict(base_config, role, model_key, megatron_config.seed)
        spec = arch_spec(hf_config)
        _check_divisible(spec, megatron_config, key)
        n_mtp = mtp_lib.resolve_mtp(model_config, hf_config, megatron_config, role, model_key, key)
        if n_mtp:  # veRL's model.mtp (engine/megatron/mtp.py)
            hf_sd.update(mtp_lib.read_mtp_tensors(model_config.path, spec.num_layers, n_mtp, model_key))
            megatron_config = mtp_lib.with_mtp_config(
                megatron_config, n_mtp, model_config.mtp.mtp_loss_scaling_factor
            )
        dtype = getattr(torch, megatron_param_dtype(megatron_config, key))
        tcfg = transformer_config(spec, megatron_config, dtype, key)
        chunks = build_model(spec, tcfg, role, megatron_config.seed, model_config.mtp if n_mtp else None)
        load_hf_weights(chunks, hf_sd, spec, role, n_mtp)
        del hf_sd
        trained = optim_config is not None and role in ("actor", "critic")
        if not trained and megatron_config.override_optimizer_config:
            raise ValueError(
                f"{key}.override_optimizer_config: the {role} has no optimizer here; drop the overrides"
            )
        if trained:
            expert_params_as_expert_parallel(chunks, megatron_config)
        # LoRA after the expert marks (the factors copy them), before DDP (it buckets the trained ones)
        lora_lib.attach_for_role(
            chunks, model_config, megatron_config, tcfg, role, model_key, global_param_name
        )
        if trained:
            chunks = wrap_ddp(chunks, tcfg, megatron_config)
        if megatron_config.use_dist_checkpointing:
            from hybridrl.engine.megatron.checkpoint import load_dist_weights

            load_dist_weights(chunks, megatron_config.dist_checkpointing_path)
        optimizer = lr_scheduler = None
        if trained:
            optim_key = optim_key or ("critic.optim" if role == "critic" else "actor_rollout_ref.actor.optim")
            optimizer = build_optimizer(chunks, optim_config, megatron_config, dtype, optim_key)
            lr_scheduler = ParamGroupLR(optimizer, optim_config, optim_key)
        tokenizer = None
        if load_tok:
            with contextlib.suppress(OSError, ValueError):
                tokenizer = load_tokenizer(model_config, model_key)
        return cls(
            chunks,
            spec,
            hf_config,
            megatron_config,
            model_config,
            role,
            optimizer,
            lr_scheduler,
            tokenizer,
            max_grad_norm,
            n_mtp,
            bool(n_mtp and model_config.mtp.enable_train),
            RoutingReplay(chunks) if spec.num_experts else None,
            use_fused_head(chunks, model_config.use_fused_kernels, role, n_mtp, model_key),
            router_stats_for(chunks, spec, megatron_config, role),
        )

    @classmethod
    def build_role(cls, spec: EngineBuildSpec) -> MegatronEngine:
        """The registry's entry: the role's engine from its `megatron` section."""
        mc = spec.model_config
        if mc.lora_adapter_path:
            raise ValueError(
                f"{spec.model_key}.lora_adapter_path (a saved PEFT adapter) is not loaded by strategy=megatron; "
                "use fsdp, or start a new adapter with lora_rank"
            )
        if mc.lora_rank > 0 and spec.role != "actor":
            raise ValueError(
                f"{spec.model_key}.lora_rank > 0 with strategy=megatron trains the actor's adapters only "
                f"(the {spec.role} would need its own head trained); use fsdp for it"
            )
        return cls.build(
            mc,
            spec.role_config.megatron,
            spec.optim_config,
            role=spec.role,
            key=f"{spec.key}.megatron",
            model_key=spec.model_key,
            optim_key=f"{spec.key}.optim",
            max_grad_norm=getattr(spec.role_config, "max_grad_norm", 0.0) or 0.0,
        )

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """The base model without its LoRA factors (the reference policy of a LoRA actor)."""
        chunks = [getattr(c, "module", c) for c in self.chunks]
        if not lora_lib.has_lora(chunks):
            raise RuntimeError(f"the {self.role} model has no LoRA adapter to disable")
        return lora_lib.disabled(chunks)

    # -- parallel layout --------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    @property
    def dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group() if self.dp_size > 1 else None

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True)

    def tp_info(self) -> tuple[int, Any]:
        """(tp rank, tp group or None) for vocabulary-parallel math."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        return ps.get_tensor_model_parallel_rank(), (ps.get_tensor_model_parallel_group() if tp > 1 else None)

    # -- compute ----------------------------------------------------------------------------
    def run(self, micros: list[Any], loss_fn, *, forward_only: bool, position_fn=None) -> list[Any]:
        """`run_schedule` in eval mode (forward_only) or train mode; last-stage results.

        With `model.use_remove_padding` each micro-batch is packed into one row (a multiple of the
        tensor-parallel size long, for sequence parallelism); with `megatron.sequence_parallel`
        padded rows are right-padded to such a multiple: see engine/megatron/forward.py.
        position_fn: the per-position results under context parallelism (`_position_fn`).
        """
        for chunk in self.chunks:
            chunk.train(not forward_only)
        tp = self.tp_info_size()
        pack = tp if self.model_config.use_remove_padding else None
        seq = tp if self.megatron_config.sequence_parallel else None  # padded rows: a multiple of TP
        if forward_only:
            with torch.no_grad():
                return run_schedule(
                    self.chunks,
                    micros,
                    loss_fn,
                    forward_only=True,
                    pack_multiple=pack,
                    seq_multiple=seq,
                    position_fn=position_fn,
                    routing=self.routing_replay,
                )
        extra = functools.partial(mtp_lib.mtp_inputs, n=self.mtp_layers) if self.mtp_train else None
        return run_schedule(
            self.chunks,
            micros,
            loss_fn,
            forward_only=False,
            pack_multiple=pack,
            seq_multiple=seq,
            extra_inputs=extra,
            position_fn=position_fn,
            routing=self.routing_replay,
            router_stats=self.router_stats,
        )

    def recording_routing(self):
        """A context: the forwards run inside record their routing (a MoE model; see routing_replay.py).

        Micro-batches carrying `routed_experts` (b, S, L_moe, K) are routed with them in every forward,
        inside or outside this context."""
        if self.routing_replay is None:
            raise ValueError(
                f"routing replay needs a mixture-of-experts model; {self.spec.model_type} has no experts"
            )
        return self.routing_replay.record(self.megatron_config.sequence_parallel)

    def take_recorded_routing(self) -> list[torch.Tensor]:
        """The routing recorded by `recording_routing`: one (b, S, L_moe, K) long tensor per micro-batch."""
        return self.routing_replay.take() if self.routing_replay is not None else []

    @staticmethod
    def tp_info_size() -> int:
        """The tensor-parallel world size."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size()

    def _position_fn(self, request: LogProbRequest | ValueRequest):
        """With context parallelism: this CP rank's logits (b, L / CP, V / TP) and next-token ids
        (b, L / CP) -> (b, L / CP, 2) [log-prob, entropy] (engine/megatron/context_parallel.py);
        the critic's values pass as they are (None)."""
        if isinstance(request, ValueRequest) or cp_group_info()[0] == 1:
            return None
        if request.sum_pi_squared or request.topk or request.topk_ids:
            raise ValueError(
                "megatron.context_parallel_size > 1 computes log-probs and entropy per context-parallel rank; "
                "actor.calculate_sum_pi_squared and distillation's forward_kl_topk need the logits of whole rows "
                "there: set context_parallel_size=1 for them"
            )
        tp_rank, group = self.tp_info()

        def per_position(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            lp, ent = self._logprobs_entropy(logits, targets, request.temperature, tp_rank, group)
            return torch.stack([lp, ent], dim=-1)

        return per_position

    def _output(self, micro: Any, out: torch.Tensor, request: LogProbRequest | ValueRequest) -> Any:
        """The requested result from the last stage's logits (or values) of one micro-batch.

        With context parallelism `out` holds (b, S, 2) [log-prob, entropy] per position (`_position_fn`)."""
        if isinstance(request, ScoreRequest):  # a reward model: its head at each row's last valid token
            mask = micro["attention_mask"]
            last = (mask.long() * torch.arange(mask.shape[-1], device=mask.device)).argmax(dim=-1)
            return out[torch.arange(out.shape[0], device=out.device), last, 0].float()
        t = micro["responses"].shape[-1]
        if isinstance(request, ValueRequest):
            return out[:, -t - 1 : -1, 0].float()
        if cp_group_info()[0] > 1:
            return LogProbs(
                out[:, -t - 1 : -1, 0], out[:, -t - 1 : -1, 1] if request.calculate_entropy else None
            )
        if request.sum_pi_squared:
            raise ValueError(
                "actor.calculate_sum_pi_squared=True is not implemented with strategy=megatron (the optimal "
                "token baseline's sum of pi^2 over a vocabulary-parallel head); use strategy=fsdp"
            )
        tp_rank, group = self.tp_info()
        sliced = out[:, -t - 1 : -1]  # logits, or hidden states with the fused head
        lp, ent = self._logprobs_entropy(sliced, micro["responses"], request.temperature, tp_rank, group)
        out = LogProbs(lp, ent if request.calculate_entropy else None)
        if request.topk or request.topk_ids:  # distillation's forward_kl_topk (vocab_parallel_topk.py)
            logits = head_logits(sliced, head_weight(self.chunks)) if self.fused_head else sliced
            out = topk_log_probs(
                logits.float() / request.temperature, micro, request, out,
                vocab_size=self.spec.vocab_size, tp_rank=tp_rank, group=group,
            )  # fmt: skip
        return out

    def _logprobs_entropy(self, out: torch.Tensor, targets: torch.Tensor, temperature: float, tp_rank, group):
        """(b, T) log-probs and entropy from (b, T, V / TP) logits, or from (b, T, H) hidden states
        chunk by chunk with the fused head (fused_head.py)."""
        if self.fused_head:
            return fused_logprobs_entropy(
                out, head_weight(self.chunks), targets, temperature=temperature,
                vocab_size=self.spec.vocab_size, tp_rank=tp_rank, group=group,
            )  # fmt: skip
        return vocab_parallel_logprobs_entropy(
            out.float() / temperature, targets, vocab_size=self.spec.vocab_size, tp_rank=tp_rank, group=group
        )

    def _check_scores(self, request: Any) -> None:
        """A ScoreRequest needs the per-token head of the critic role, whole rows (no context
        parallelism) and no shared-prompt layout (an FSDP-engine forward)."""
        if not isinstance(request, ScoreRequest):
            return
        if self.role != "critic":
            raise NotImplementedError(
                f"sequence scores (ScoreRequest) come from a model with a per-token score head (the critic role); "
                f"this Megatron engine is the {self.role}'s language model"
            )
        if cp_group_info()[0] > 1:
            raise NotImplementedError(
                "sequence scores read each row's last token; megatron.context_parallel_size > 1 splits the rows: "
                "set context_parallel_size=1 for a reward model"
            )
        if request.prefix_group:
            raise NotImplementedError("the shared-prompt forward (prefix_group) is built for the FSDP engine")

    def forward(self, micros, request: LogProbRequest | ValueRequest) -> list[Any]:
        """See TrainEngine.forward: Megatron's schedule without gradients; every stage returns them.

        `request.record_routing` (a MoE model): each output also carries the experts its tokens were
        routed to (`routed_experts`, (b, S, L_moe, K)); micro-batches carrying `routed_experts` route
        with them whatever the request says."""
        self._check_scores(request)
        record = bool(getattr(request, "record_routing", False))
        with self.recording_routing() if record else contextlib.nullcontext():
            results = self.run(
                list(micros),
                lambda m, out: (torch.zeros(()), self._output(m, out, request)),
                forward_only=True,
                position_fn=self._position_fn(request),
            )
        results = broadcast_from_last_stage(results)
        if record:
            for out, routes in zip(results, self.take_recorded_routing(), strict=True):
                out.routed_experts = routes
        return results

    def forward_backward(self, micros, request: LogProbRequest | ValueRequest, loss_fn: LossFn) -> list[Any]:
        """See TrainEngine.forward_backward: Megatron's schedule (1F1B when pipelined)."""
        self._check_scores(request)
        micros = list(micros)
        on = self.router_stats is not None and isinstance(request, LogProbRequest) and request.router_aux_loss
        with self.router_stats.collecting(on) if self.router_stats is not None else contextlib.nullcontext():
            results = self.run(
                micros,
                lambda m, out: mtp_lib.add_mtp_metrics(
                    loss_fn(m, self._with_moe_metrics(self._output(m, out, request))),
                    self.chunks[-1],
                    len(micros),
                ),
                forward_only=False,
                position_fn=self._position_fn(request),
            )
        return broadcast_from_last_stage(results)

    def _with_moe_metrics(self, out: Any) -> Any:
        """A MoE model's routing metrics and aux loss of this micro-batch (moe_metrics.py), if collected."""
        taken = self.router_stats.take() if self.router_stats is not None else None
        if taken is not None and isinstance(out, LogProbs):
            out.router_aux_loss, out.moe_metrics = taken
        return out

    def perf_model(self) -> PerfModel:
        layers, attn_dim = attention_dims(self.hf_config)
        return PerfModel(num_dense_params(self.spec), layers, attn_dim)

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self, max_grad_norm: float | None = None) -> tuple[float, bool]:
        """Clip (Megatron's norm over TP/PP/DP) and step; skip a non-finite norm. (grad_norm, stepped).

        max_grad_norm: None takes the engine's own (`max_grad_norm` at build).

        Megatron's ChainedOptimizer.step, with the FSDP engine's rule added: a non-finite gradient
        norm skips the step (Megatron's fp32 optimizer would apply it).
        """
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.require_optimizer("optimizer_step")
        opt = self.optimizer
        max_norm = self.max_grad_norm if max_grad_norm is None else max_grad_norm
        with cuda_to_cpu():
            found_inf = opt.prepare_grads()
            grad_norm = float(opt.get_grad_norm())
            stepped = math.isfinite(grad_norm) and not found_inf
            if stepped:
                for sub in opt.chained_optimizers:
                    params = sub.get_parameters()
                    if params and max_norm and max_norm > 0:
                        clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=grad_norm)
                opt.step_with_ready_grads()
            else:
                print(f"[hybridrl] warning: gradient norm is {grad_norm}; skipping this optimizer step")
        self.zero_grad()
        return grad_norm, stepped

    # -- offload (validated: no-ops on CPU) ----------------------------------------------------
    def offload(self) -> None:
        """Nothing to move on CPU (offloading on GPU is refused at start-up)."""

    def onload(self, with_optimizer: bool = False) -> None:
        """Nothing to move on CPU (offloading on GPU is refused at start-up)."""

    # -- weights ------------------------------------------------------------------------------
    def iter_full_params(
        self, dtype: torch.dtype | None = None, device=None, **_: Any
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of the whole model on every rank (gathers TP shards and PP stages)."""
        chunks = [getattr(c, "module", c) for c in self.chunks]
        for name, t in iter_hf_params(chunks, self.spec, self.role):
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            yield name, (t.to(device) if device is not None else t)

    def iter_params(self, dtype: torch.dtype | None = None, loader: str | None = None):
        """See TrainEngine.iter_params: HF names and full tensors (the "megatron" loader)."""
        if loader not in (None, "megatron"):
            raise ValueError(
                f"the Megatron engine feeds the 'megatron' weight loader, not {loader!r}; set "
                "actor_rollout_ref.rollout.load_format=dummy_megatron (or auto)"
            )
        return self.iter_full_params(dtype=dtype)

    def export_hf(self, target_dir: str) -> None:
        from hybridrl.engine.megatron.checkpoint import export_hf_folder

        export_hf_folder(self, target_dir)

    def save_checkpoint(self, path: str, contents=None, global_step: int | None = None, extra=None) -> None:
        from hybridrl.engine.megatron.checkpoint import save_checkpoint

        save_checkpoint(self, path, contents=contents, global_step=global_step, extra=extra)

    def load_checkpoint(self, path: str, contents=None) -> dict[str, Any]:
        from hybridrl.engine.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self, path, contents=contents)


@functools.cache
def _log_bridge(use_mbridge: bool, key: str) -> None:
    """`use_mbridge`: both values load the HF weights directly, through hybridrl's own bridge (convert.py).

    In veRL, True converts with mbridge and False with its built-in converter; both give the
    same Megatron weights, which is what convert.py produces (tested against HF logits).
    """
    which = "mbridge's job" if use_mbridge else "veRL's built-in converter's job"
    logger.info(f"{key}.use_mbridge={use_mbridge}: HF weights load through hybridrl's own bridge ({which})")


def _check_divisible(spec: ArchSpec, cfg: MegatronConfig, key: str) -> None:
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    if spec.num_kv_heads % tp or spec.num_heads % tp:
        raise ValueError(
            f"{key}.tensor_model_parallel_size={tp} must divide the attention heads ({spec.num_heads}) and the "
            f"key/value heads ({spec.num_kv_heads})"
        )
    _check_experts(spec, cfg, key)
    if spec.num_layers % (pp * vpp):
        raise ValueError(
            f"{key}: pipeline_model_parallel_size * virtual_pipeline_model_parallel_size = {pp * vpp} must divide "
            f"the number of layers ({spec.num_layers})"
        )


def _check_experts(spec: ArchSpec, cfg: MegatronConfig, key: str) -> None:
    ep = cfg.expert_model_parallel_size
    if ep > 1 and not spec.num_experts:
        raise ValueError(
            f"{key}.expert_model_parallel_size={ep} needs a mixture-of-experts model (this {spec.model_type} model "
            "has no experts); set it to 1"
        )
    if spec.num_experts % ep:
        raise ValueError(
            f"{key}.expert_model_parallel_size={ep} must divide the model's {spec.num_experts} experts"
        )


register_engine("megatron", MegatronEngine, model_parallel=True)
