"""Ray workers for `strategy=megatron`: the FSDP workers with their engines swapped for MegatronEngine.

`MegatronActorRolloutRefWorker` and `MegatronCriticWorker` keep the remote interface (and the
rollout, weight-sync and checkpoint plumbing) of `ActorRolloutRefWorker` / `CriticWorker`, their
compute methods included; only the model build and the mesh they declare differ. The "actor" /
"critic" mesh is Megatron's layout, pp x dp x tp (Megatron's rank order tp-cp-ep-dp-pp: TP
innermost, PP outermost), split over dp only and collected from the last pipeline stage's TP rank
0 (`megatron_mesh`), so the mesh dispatch gives every rank of one model replica the same rows. The
driver computes the per-rank batch sizes with Megatron's data-parallel size
(`megatron_config.data_parallel_size`).

The reference policy follows the actor's engine (veRL links `ref.strategy` and `ref.megatron.*`
to the actor's). Weight sync into the rollout uses `MegatronEngine.iter_full_params` (TP shards
and PP stages gathered, HF names and layout), streamed like the FSDP weights.
"""

from __future__ import annotations

import os

import torch

from hybridrl.single_controller.base import register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.single_controller.mesh import MeshLayout
from hybridrl.utils.device import init_process_group
from hybridrl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker
from hybridrl.workers.megatron_config import MEGATRON_STRATEGY
from hybridrl.workers.rollout_worker import AsyncActorWorker

__all__ = [
    "MegatronActorRolloutRefWorker",
    "MegatronAsyncActorWorker",
    "MegatronCriticWorker",
    "megatron_mesh",
    "uses_megatron",
]

_PG_TIMEOUT_S = float(os.environ.get("HYBRIDRL_PG_TIMEOUT_S", 600))


def uses_megatron(strategy: str) -> bool:
    return strategy == MEGATRON_STRATEGY


def _setup(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
    init_process_group(timeout_s=_PG_TIMEOUT_S)


def megatron_mesh(world_size: int, cfg) -> MeshLayout:
    """Megatron's layout as a dispatch mesh: pp x dp x tp, batch split over dp, results from the
    last pipeline stage's tensor-parallel rank 0."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    return MeshLayout.create(
        world_size, {"pp": pp, "dp": -1, "tp": tp}, dp_dims=("dp",), collect={"pp": -1, "tp": 0}
    )


class MegatronActorRolloutRefWorker(ActorRolloutRefWorker):
    """ActorRolloutRefWorker whose actor and reference are MegatronEngines."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridrl.workers.engine.fsdp import resolve_model_path
        from hybridrl.workers.engine.megatron.engine import MegatronEngine
        from hybridrl.workers.engine.megatron.roles import MegatronPPOActor

        _setup(self.num_threads)
        self.model_config.validate()
        if self.model_config.lora_rank > 0 or self.model_config.lora_adapter_path:
            raise ValueError(
                "actor_rollout_ref.model.lora_rank > 0 is not supported with strategy=megatron; use fsdp"
            )
        a, r = self.actor_config, self.ref_config
        model_path = resolve_model_path(self.model_config.path, "actor_rollout_ref.model.path")
        self._declare_training_mesh()
        if self._is_actor:
            self.actor_engine = MegatronEngine.build(
                self.model_config, a.megatron, a.optim, role="actor", max_grad_norm=a.max_grad_norm
            )
            self.actor = MegatronPPOActor(
                a, self.actor_engine, batch_sizes=self.actor_batch_sizes, peak_flops=self.peak_flops
            )
        if self._is_ref:
            if not uses_megatron(r.strategy):
                raise ValueError(
                    f"actor_rollout_ref.ref.strategy={r.strategy!r} with actor.strategy=megatron: the reference shares "
                    "the actor's Megatron process groups; set actor_rollout_ref.ref.strategy=megatron"
                )
            self.ref_engine = MegatronEngine.build(
                self.model_config, r.megatron, None, role="ref", key="actor_rollout_ref.ref.megatron"
            )
            self.ref_policy = MegatronPPOActor(None, self.ref_engine)
        if self._is_rollout:
            self._build_rollout(model_path)

    def _declare_training_mesh(self) -> None:
        """The "actor" mesh (also the reference's): Megatron's pp x dp x tp."""
        self.set_mesh("actor", megatron_mesh(self.world_size, self.actor_config.megatron))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, target_dir: str) -> None:
        """Write the full actor as a Hugging Face folder (rank 0 writes)."""
        from hybridrl.workers.engine.megatron.checkpoint import export_hf_folder

        export_hf_folder(self.actor_engine, target_dir)


class MegatronCriticWorker(CriticWorker):
    """CriticWorker whose value model is a MegatronEngine (GPT backbone + value head)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridrl.workers.engine.megatron.engine import MegatronEngine
        from hybridrl.workers.engine.megatron.roles import MegatronPPOCritic

        _setup(self.num_threads)
        c = self.config
        self.engine = MegatronEngine.build(
            c.model,
            c.megatron,
            c.optim,
            role="critic",
            key="critic.megatron",
            model_key="critic.model",
            optim_key="critic.optim",
            max_grad_norm=c.max_grad_norm,
        )
        self.set_mesh("critic", megatron_mesh(self.world_size, c.megatron))
        self.critic = MegatronPPOCritic(
            c, self.engine, batch_sizes=self.batch_sizes, peak_flops=self.peak_flops
        )


class MegatronAsyncActorWorker(AsyncActorWorker, MegatronActorRolloutRefWorker):
    """The asynchronous trainer's training side on Megatron: AsyncActorWorker's role set-up (no
    rollout engine) and weight publishing (`iter_full_params`, a collective over TP and PP that
    every rank joins), MegatronActorRolloutRefWorker's model build and mesh."""
