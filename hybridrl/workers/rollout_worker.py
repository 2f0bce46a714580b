"""Workers of the disaggregated (asynchronous) mode: rollout and training in separate processes.

* `AsyncRolloutWorker` — a rollout engine alone on its own slot, with versioned weights. Each
  rollout worker is independent: no process group among them (they never run collectives), so
  losing one does not block the others.
* `AsyncActorWorker` — the trainer side: the FSDP actor (and reference, critic, ... through the
  usual colocated group) without a rollout engine, plus `publish_weights`, which gathers the full
  parameters (a collective over the training ranks) and returns them from rank 0. The driver
  hands the ObjectRef of that return value to every rollout worker's `load_weights`, so the
  weights go trainer rank 0 -> object store -> rollout workers without passing through the driver.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from hybridrl.models.weight_map import to_torch_dtype
from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import register
from hybridrl.single_controller.dispatch import Dispatch
from hybridrl.workers.batch_sizes import PerRankBatchSizes
from hybridrl.workers.config import ActorConfig, ModelConfig, RefConfig
from hybridrl.workers.fsdp_workers import ActorRolloutRefWorker
from hybridrl.workers.rollout.config import RolloutConfig

__all__ = ["AsyncActorWorker", "AsyncRolloutWorker"]


class AsyncRolloutWorker(ActorRolloutRefWorker):
    """A rollout-only worker whose outputs carry the policy version they were generated with.

    Args:
        model: `actor_rollout_ref.model` (architecture, tokenizer, initial weights).
        rollout: the rollout section (the driver sets calculate_log_probs for the decoupled loss).
        num_threads: torch threads of this process (the slot's CPU cores).

    The weights loaded from `model.path` are version 0; with a dummy load format the worker
    refuses to generate before the first `load_weights`.
    """

    def __init__(self, model: ModelConfig, rollout: RolloutConfig, num_threads: int | None = None) -> None:
        super().__init__(model, ActorConfig(), RefConfig(), rollout, role="rollout", num_threads=num_threads)
        self.policy_version = -1 if rollout.is_dummy_load else 0
        self.busy_s = 0.0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the rollout engine (no process group: rollout workers never run collectives).

        Sampling seeds come from the chunk's `meta_info["seed_index"]` (set by the manager), so a
        chunk draws the same samples whichever worker generates it."""
        from hybridrl.workers.engine.fsdp import resolve_model_path

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.model_config.validate()
        self._build_rollout(resolve_model_path(self.model_config.path, "actor_rollout_ref.model.path"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, payload: dict[str, Any], version: int) -> float:
        """Load the weights `AsyncActorWorker.publish_weights` returned; returns the seconds taken."""
        from hybridrl.workers.rollout.weight_sync import sync_weights

        if payload is None or "weights" not in payload:
            raise ValueError(
                "load_weights: payload must be publish_weights()'s rank-0 result {'weights': ...}"
            )
        t0 = time.perf_counter()
        sync_weights(self.rollout, iter(payload["weights"]))
        self.policy_version = int(version)
        elapsed = time.perf_counter() - t0
        self.busy_s += elapsed
        return elapsed

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The rollout contract of ActorRolloutRefWorker.generate_sequences, plus version tags.

        Adds non-tensor "policy_version" (an int per row, object array) and meta_info "policy_version" and
        "worker_busy_s" (this worker's cumulative busy seconds, for idle-time metrics).
        """
        if self.policy_version < 0:
            raise RuntimeError(
                "AsyncRolloutWorker: no weights loaded yet (rollout.load_format is dummy); call load_weights first"
            )
        t0 = time.perf_counter()
        out = super().generate_sequences(prompts)
        self.busy_s += time.perf_counter() - t0
        out.non_tensor_batch["policy_version"] = np.array([self.policy_version] * len(out), dtype=object)
        out.meta_info["policy_version"] = self.policy_version
        out.meta_info["worker_busy_s"] = self.busy_s
        return out


class AsyncActorWorker(ActorRolloutRefWorker):
    """The training side: actor (+ reference when `use_ref`), no rollout engine, and weight publishing.

    Args:
        model, actor, ref, rollout: as ActorRolloutRefWorker (rollout gives the weights' dtype and
            the sampling temperature of the log-prob computations).
        use_ref: also hold the frozen reference policy (KL loss / KL in reward).
        actor_batch_sizes, num_threads, peak_flops: as ActorRolloutRefWorker.
    """

    def __init__(
        self,
        model: ModelConfig,
        actor: ActorConfig,
        ref: RefConfig,
        rollout: RolloutConfig,
        use_ref: bool = False,
        actor_batch_sizes: PerRankBatchSizes | None = None,
        num_threads: int | None = None,
        peak_flops: float | None = None,
    ) -> None:
        role = "actor_rollout_ref" if use_ref else "actor"
        super().__init__(
            model,
            actor,
            ref,
            rollout,
            role=role,
            actor_batch_sizes=actor_batch_sizes,
            num_threads=num_threads,
            peak_flops=peak_flops,
        )
        self._is_rollout = False  # the rollout engines live in their own workers

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def publish_weights(self, version: int) -> dict[str, Any] | None:
        """Gather the full parameters (every rank must call this); rank 0 returns them.

        Returns:
            On rank 0: {"version": version, "weights": [(hf_name, cpu tensor in rollout dtype)],
            "gather_s": seconds}; None on the other ranks.
        """
        if self.actor_engine is None:
            raise RuntimeError("publish_weights needs the actor; init_model has not run")
        t0 = time.perf_counter()
        self.actor_engine.onload()
        dtype = to_torch_dtype(self.rollout_config.dtype)
        weights = []
        for name, tensor in self.actor_engine.iter_full_params(dtype=dtype):
            if self.rank == 0:
                weights.append((name, tensor.detach().to("cpu")))
        self.actor_engine.offload()
        if self.rank != 0:
            return None
        return {"version": int(version), "weights": weights, "gather_s": time.perf_counter() - t0}
