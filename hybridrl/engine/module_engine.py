"""`ModuleEngine`: the TrainEngine of a Hugging Face model held whole by this process's module object.

It runs the model through `engine.forward` (remove-padding packing, the chunked head, Ulysses
SP, the shared-prompt forward), steps a torch optimizer with the global gradient norm clipped,
and gathers weights with `full_params`. `FSDPEngine` (engine/fsdp.py) is this engine over an
FSDP2-sharded module; a bare module (a notebook, a unit test) is wrapped as is:
`ModuleEngine(model, optimizer)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.engine.base import LogProbRequest, LossFn, PerfModel, ScoreRequest, TrainEngine, ValueRequest
from hybridrl.engine.batching import default_dp_group, optimizer_step
from hybridrl.engine.forward import forward_log_probs, forward_scores, forward_values
from hybridrl.engine.moe_routing import MoEForward, RoutingRequest, supports_routing
from hybridrl.engine.topk import forward_topk_log_probs, wants_topk
from hybridrl.engine.ulysses import SPGroup
from hybridrl.models.moe import is_moe
from hybridrl.utils.flops import attention_dims, count_params

__all__ = ["ModuleEngine"]


class ModuleEngine(TrainEngine):
    """A Hugging Face model (causal LM, or token classification for the critic) on this rank.

    Args:
        module: the model (sharded by FSDP2 or not: the forward is the same).
        optimizer, lr_scheduler: None for a forward-only role.
        role: "actor", "ref" or "critic".
        dp_size: data-parallel ranks (the ranks, or world / sp with Ulysses SP).
        dp_group: the all-reduce group of the dp ranks (None: WORLD when dp_size > 1).
        sp: this rank's Ulysses group (the module went through `ulysses.parallelize_sp`).
        use_remove_padding: pack valid tokens into one row (`model.use_remove_padding`).
        use_fused_kernels: `model.use_fused_kernels`: the head only at the response positions.
        tokenizer: the model's tokenizer (or None).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        role: str = "actor",
        dp_size: int = 1,
        dp_group: Any = None,
        sp: SPGroup | None = None,
        use_remove_padding: bool = False,
        use_fused_kernels: bool = True,
        tokenizer: Any = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.role = role
        self.tokenizer = tokenizer
        self.use_remove_padding = use_remove_padding
        self.use_fused_kernels = use_fused_kernels
        self.set_data_parallel(dp_size, dp_group, sp)
        self._moe: MoEForward | None = None
        self._dense = False  # checked once: the model has no router

    def set_data_parallel(self, dp_size: int, dp_group: Any = None, sp: SPGroup | None = None) -> None:
        """The data-parallel layout (Ulysses SP: world / sp groups that share their rows)."""
        self._dp_size = int(dp_size)
        self._dp_group = default_dp_group(self._dp_size, dp_group)
        self.sp = sp

    # -- layout --------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def dp_rank(self) -> int:
        if self._dp_group is None:
            return 0
        return dist.get_rank(self._dp_group)

    @property
    def dp_group(self) -> Any:
        return self._dp_group

    # -- compute -------------------------------------------------------------------------------
    def _routing(self, micro: Any, request: LogProbRequest | ValueRequest | ScoreRequest) -> RoutingRequest:
        """What this forward does with the model's routing (engine/moe_routing.py). The load-balancing
        loss and expert-load metrics are asked of every actor update: a dense model, or a forward the
        metrics cannot run in (images, video), leaves them out unless the loss is on."""
        if isinstance(request, (ValueRequest, ScoreRequest)):
            return RoutingRequest()
        aux = request.router_aux_loss and self._is_moe(strict=bool(self.router_aux_loss_coef))
        if aux and not self.router_aux_loss_coef and not supports_routing(micro):
            aux = False
        routing = RoutingRequest(request.record_routing, request.replay_routing, aux)
        if (routing.record or routing.replay) and not self._is_moe(strict=True):
            raise ValueError(
                f"routing replay needs a mixture-of-experts model; {type(self.module).__name__} has no "
                "router: set router_replay.mode=disabled and rollout.enable_rollout_routing_replay=false"
            )
        return routing

    def _is_moe(self, strict: bool) -> bool:
        """Whether the model has routers hybridrl knows; an unknown router family raises when
        `strict` (replay, or the loss asked for), else counts as no router (no metrics)."""
        if self._moe is None and not self._dense:
            try:
                found = is_moe(self.module)
            except NotImplementedError:
                if strict:
                    raise
                return False
            if found:
                self._moe = MoEForward(self.module)
            self._dense = not found
        return self._moe is not None

    @property
    def router_aux_loss_coef(self) -> float:
        """The weight of the router load-balancing loss in the actor loss: the model config's
        `router_aux_loss_coef` when its `output_router_logits` is set (Hugging Face's switch, set
        through model.override_config), else 0."""
        config = getattr(self.module, "config", None)
        if not getattr(config, "output_router_logits", False):
            return 0.0
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)

    def _output(self, micro: Any, request: LogProbRequest | ValueRequest | ScoreRequest) -> Any:
        routing = self._routing(micro, request)
        if not routing:
            return self._plain_output(micro, request)
        with self._moe.forward(
            micro, routing, use_remove_padding=self.use_remove_padding, prefix_group=request.prefix_group,
            sp=self.sp,
        ) as result:  # fmt: skip
            out = self._plain_output(micro, request)
        out.routed_experts, out.router_aux_loss = result.routed, result.aux_loss
        out.moe_metrics = result.metrics or None
        return out

    def _plain_output(self, micro: Any, request: LogProbRequest | ValueRequest | ScoreRequest) -> Any:
        if isinstance(request, ScoreRequest):
            return forward_scores(
                self.module,
                micro,
                use_remove_padding=self.use_remove_padding,
                prefix_group=request.prefix_group,
            )
        if isinstance(request, ValueRequest):
            return forward_values(
                self.module,
                micro,
                use_remove_padding=self.use_remove_padding,
                sp=self.sp,
                fused=self.use_fused_kernels,
            )
        if wants_topk(request):  # distillation's forward_kl_topk: the full logits (engine/topk.py)
            return forward_topk_log_probs(
                self.module, micro, temperature=request.temperature, use_remove_padding=self.use_remove_padding,
                topk=request.topk, gather_ids=request.topk_ids, calculate_entropy=request.calculate_entropy,
                entropy_grad=request.entropy_grad, sp=self.sp, prefix_group=request.prefix_group,
            )  # fmt: skip
        return forward_log_probs(
            self.module,
            micro,
            temperature=request.temperature,
            use_remove_padding=self.use_remove_padding,
            calculate_entropy=request.calculate_entropy,
            entropy_chunk_size=request.entropy_chunk_size,
            entropy_grad=request.entropy_grad,
            calculate_sum_pi_squared=request.sum_pi_squared,
            sp=self.sp,
            fused=self.use_fused_kernels,
            compile_kernels=request.compile_kernels,
            prefix_group=request.prefix_group,
        )

    def forward(
        self, micros: Sequence[Any], request: LogProbRequest | ValueRequest | ScoreRequest
    ) -> list[Any]:
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                return [self._output(micro, request) for micro in micros]
        finally:
            self.module.train(was_training)

    def forward_backward(
        self, micros: Sequence[Any], request: LogProbRequest | ValueRequest | ScoreRequest, loss_fn: LossFn
    ) -> list[Any]:
        self.module.train()
        auxes = []
        for micro in micros:
            loss, aux = loss_fn(micro, self._output(micro, request))
            loss.backward()
            auxes.append(aux)
        return auxes

    def optimizer_step(self, max_grad_norm: float) -> tuple[float, bool]:
        self.require_optimizer("optimizer_step")
        return optimizer_step(self.module, self.optimizer, max_grad_norm)

    def perf_model(self) -> PerfModel:
        layers, attn_dim = attention_dims(self.module.config)
        return PerfModel(count_params(self.module), layers, attn_dim, self.sp.size if self.sp else 1)

    # -- weights -------------------------------------------------------------------------------
    def iter_params(
        self, dtype: torch.dtype | None = None, loader: str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        from hybridrl.engine.full_params import iter_full_params, iter_state_dict_params

        loader = loader or "dtensor"
        if loader == "hf":
            return iter_state_dict_params(self.module, dtype=dtype)
        if loader != "dtensor":
            raise ValueError(
                f"the {type(self).__name__} feeds the 'dtensor' and 'hf' weight loaders, not {loader!r}; "
                "set actor_rollout_ref.rollout.load_format to dummy_dtensor, dtensor, dummy_hf or hf"
            )
        return iter_full_params(self.module, dtype=dtype)

    def save_checkpoint(self, path: str, contents=None, global_step: int | None = None, extra=None) -> None:
        from hybridrl.engine.checkpoint import save_checkpoint

        save_checkpoint(
            path,
            self.module,
            self.optimizer,
            self.lr_scheduler,
            contents=contents,
            tokenizer=self.tokenizer,
            global_step=global_step,
            extra=extra,
        )

    def load_checkpoint(self, path: str, contents=None) -> dict[str, Any]:
        from hybridrl.engine.checkpoint import load_checkpoint

        return load_checkpoint(path, self.module, self.optimizer, self.lr_scheduler, contents=contents)

    def export_hf(self, target_dir: str) -> None:
        from hybridrl.engine.checkpoint import export_hf_model

        export_hf_model(self.module, target_dir, tokenizer=self.tokenizer)

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        if not hasattr(self.module, "disable_adapter"):
            raise RuntimeError(f"the {self.role} model has no LoRA adapter to disable")
        return self.module.disable_adapter()
