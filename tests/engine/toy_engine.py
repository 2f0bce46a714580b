"""A whole training engine in one file: the example of docs/extending.md, "Add a training engine".

`ToyEngine` runs one role's Hugging Face model as it is, in this process (one rank, no sharding),
with a torch optimizer. It subclasses `TrainEngine` directly: the abstract methods below are all a
new backend must write; `lr`, `lr_scheduler_step`, `onload` / `offload` come from the base class.
The last line registers it, so `strategy=toy` / `model_engine=toy` select it (in the processes
that imported this module). tests/engine/test_engine_contract.py runs it through the same
role-level checks as the FSDP and Megatron engines.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybridrl.algos.utils import entropy_from_logits, logprobs_from_logits
from hybridrl.engine.base import (
    EngineBuildSpec,
    LogProbRequest,
    LogProbs,
    LossFn,
    PerfModel,
    TrainEngine,
    ValueRequest,
    register_engine,
)
from hybridrl.engine.batching import optimizer_step
from hybridrl.engine.extra_state import load_extra_state, save_extra_state
from hybridrl.engine.optim import build_lr_scheduler, build_optimizer
from hybridrl.models.hf import build_hf_model
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.flops import attention_dims, count_params


class ToyEngine(TrainEngine):
    """One role's HF model on one rank: a causal LM (actor, ref) or token classification (critic)."""

    dp_size, dp_rank, dp_group = 1, 0, None  # one rank: every row is this rank's, nothing to reduce

    def __init__(self, module: torch.nn.Module, role: str, optimizer=None, lr_scheduler=None) -> None:
        self.module, self.role = module, role
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler

    @classmethod
    def build_role(cls, spec: EngineBuildSpec) -> ToyEngine:
        """The registry's entry: the workers call it on every rank with the role's config sections."""
        if spec.mesh.world_size != 1:
            raise ValueError(
                f"{spec.key}.strategy=toy runs on one rank, not {spec.mesh.world_size}; set "
                "trainer.n_gpus_per_node=1 trainer.nnodes=1, or use strategy=fsdp"
            )
        module = build_hf_model(spec.model_config, role=spec.role, key=spec.model_key).to(get_torch_device())
        if spec.optim_config is None:  # the reference (and any forward-only role)
            return cls(module, spec.role)
        optimizer = build_optimizer(module, spec.optim_config)
        lr_scheduler = build_lr_scheduler(optimizer, spec.optim_config, key=f"{spec.key}.optim")
        return cls(module, spec.role, optimizer, lr_scheduler)

    # -- compute -------------------------------------------------------------------------------
    def _output(self, micro: Any, request: LogProbRequest | ValueRequest) -> Any:
        """LogProbs of the response tokens (b, T), or the values (b, T), of one micro-batch.

        Position s predicts token s + 1, so the T positions before the end score the T response
        tokens. The request's speed options (compile_kernels, prefix_group, entropy_chunk_size)
        change no number, so this engine ignores them.
        """
        t = micro["responses"].shape[-1]
        keys = ("input_ids", "attention_mask", "position_ids")
        logits = self.module(**{k: micro[k] for k in keys}).logits[:, -t - 1 : -1].float()
        if isinstance(request, ValueRequest):
            return logits[..., 0]  # the critic's one label
        logits = logits / request.temperature
        entropy = sum_pi_sq = None
        if request.calculate_entropy:
            entropy = entropy_from_logits(logits if request.entropy_grad else logits.detach())
        if request.sum_pi_squared:
            sum_pi_sq = logits.detach().softmax(-1).square().sum(-1)
        return LogProbs(logprobs_from_logits(logits, micro["responses"]), entropy, sum_pi_sq)

    def forward(self, micros: Sequence[Any], request: LogProbRequest | ValueRequest) -> list[Any]:
        self.module.eval()
        with torch.no_grad():
            return [self._output(micro, request) for micro in micros]

    def forward_backward(
        self, micros: Sequence[Any], request: LogProbRequest | ValueRequest, loss_fn: LossFn
    ) -> list[Any]:
        self.module.train()
        auxes = []
        for micro in micros:
            loss, aux = loss_fn(micro, self._output(micro, request))
            loss.backward()  # gradients accumulate over the micro-batches
            auxes.append(aux)
        return auxes

    def optimizer_step(self, max_grad_norm: float) -> tuple[float, bool]:
        self.require_optimizer("optimizer_step")
        return optimizer_step(self.module, self.optimizer, max_grad_norm)  # clip, skip non-finite, zero

    def perf_model(self) -> PerfModel:
        return PerfModel(count_params(self.module), *attention_dims(self.module.config))

    # -- weights -------------------------------------------------------------------------------
    def iter_params(
        self, dtype: torch.dtype | None = None, loader: str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if loader not in (None, "dtensor", "hf"):  # both take full tensors with HF names
            raise ValueError(
                f"the toy engine feeds the 'dtensor' and 'hf' weight loaders, not {loader!r}; set "
                "actor_rollout_ref.rollout.load_format to auto, dummy_dtensor or dummy_hf"
            )
        params = self.module.named_parameters()
        return ((name, p.detach().to(dtype or p.dtype)) for name, p in params)

    def save_checkpoint(self, path: str, contents=None, global_step: int | None = None, extra=None) -> None:
        """Everything, whatever `contents` says: model.pt, optimizer.pt, extra_state_rank0.pt (lr
        schedule, RNG, `extra`), written to `<path>.tmp` and renamed."""
        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save({"model": self.module.state_dict(), "global_step": global_step}, f"{tmp}/model.pt")
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), f"{tmp}/optimizer.pt")
        save_extra_state(tmp, 0, self.lr_scheduler, extra)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)

    def load_checkpoint(self, path: str, contents=None) -> dict[str, Any]:
        """What `save_checkpoint` wrote, restricted to `contents` (default model, optimizer, extra)."""
        contents = set(contents or ("model", "optimizer", "extra"))
        model = torch.load(f"{path}/model.pt", weights_only=True)
        if "model" in contents:
            self.module.load_state_dict(model["model"])
        if "optimizer" in contents and self.optimizer is not None:
            self.optimizer.load_state_dict(torch.load(f"{path}/optimizer.pt", weights_only=True))
        extra = load_extra_state(path, 0, self.lr_scheduler, 1) if "extra" in contents else None
        return {"global_step": model["global_step"], "extra": extra}

    def export_hf(self, target_dir: str) -> None:
        self.module.save_pretrained(target_dir)


register_engine("toy", ToyEngine)
