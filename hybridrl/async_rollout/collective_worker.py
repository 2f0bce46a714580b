"""The worker side of the collective weight update (hybridrl/async_rollout/collective.py): the
remote methods ActorRolloutRefWorker takes from `CollectiveWeightsMixin`.

Training workers (the actor role, disaggregated): `open_weight_group` (rank 0 hosts the store),
`join_weight_group(spec, 0)` (rank 0 joins as group rank 0), `broadcast_weights(version)` (every
rank gathers, rank 0 broadcasts). Rollout workers: `join_weight_group(spec, 1)` (worker r joins as
group rank 1 + r and starts its receiver thread); `load_weights(collective_payload(v), v)` then
loads the staged version v. The driver's side is hybridrl/trainer/async_ppo/weight_update.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from hybridrl.async_rollout.collective import (
    MODE_KEY,
    GroupSpec,
    WeightGroup,
    WeightReceiver,
    open_store,
)
from hybridrl.single_controller.base import register
from hybridrl.single_controller.dispatch import Dispatch

__all__ = ["CollectiveWeightsMixin"]


class CollectiveWeightsMixin:
    """Remote methods of the collective weight update (mixed into ActorRolloutRefWorker)."""

    _weight_group: WeightGroup | None = None
    _weight_receiver: WeightReceiver | None = None
    _weight_store: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_weight_group(self, world_size: int, timeout_s: float) -> tuple[str, int] | None:
        """Trainer rank 0: host the group's TCPStore on a free port; returns (host, port) there,
        None on the other ranks."""
        if self.rank != 0:
            return None
        self._weight_store, host, port = open_store(world_size, timeout_s)
        return host, port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_group(self, spec: GroupSpec, first_rank: int) -> float | None:
        """Join the group as group rank `first_rank + self.rank` (every member must call this at
        about the same time: the backend's rendezvous needs all of them).

        Args:
            spec: from the driver (host and port from `open_weight_group`).
            first_rank: 0 on the training group (only its rank 0 joins), 1 on the rollout group.

        Returns:
            Seconds the join took (None on training ranks > 0).
        """
        if first_rank == 0 and self.rank != 0:
            return None
        who = "trainer rank 0" if first_rank == 0 else f"rollout worker {self.rank}"
        store = self._weight_store if first_rank == 0 else None
        self._weight_group = WeightGroup(spec, first_rank + self.rank, store=store, who=who)
        if first_rank > 0:
            self._weight_receiver = WeightReceiver(self._weight_group)
        return self._weight_group.join_s

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def broadcast_weights(self, version: int) -> dict[str, float] | None:
        """Disaggregated trainer: gather the full parameters (every rank must call this, as for
        publish_weights); rank 0 broadcasts them to the rollout workers in buckets of
        rollout.update_weights_bucket_megabytes.

        Returns:
            On rank 0: {"version", "bytes", "buckets", "send_s" (packing + broadcasts), "total_s"
            (gather included)}; None on the other ranks.
        """
        from hybridrl.models.weight_map import to_torch_dtype

        if self.actor_engine is None:
            raise RuntimeError("broadcast_weights needs the actor; init_model has not run")
        if self.rank == 0 and self._weight_group is None:
            raise RuntimeError(f"broadcast_weights before join_weight_group ({MODE_KEY}=collective)")
        t0 = time.perf_counter()
        self.actor_engine.onload()
        try:
            named = self.actor_engine.iter_params(dtype=to_torch_dtype(self.rollout_config.dtype))
            if self.rank != 0:
                for _ in named:  # the gather is a collective of all training ranks
                    pass
                return None
            bucket_bytes = int(self.rollout_config.update_weights_bucket_megabytes * 2**20)
            stats = self._weight_group.send(named, version, bucket_bytes)
        finally:
            self.actor_engine.offload()
        return {"version": float(version), **stats, "total_s": time.perf_counter() - t0}

    def _collective_weights(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged tensors of `version` (load_weights with a collective payload)."""
        if self._weight_receiver is None:
            raise RuntimeError(
                f"load_weights got a collective payload, but this worker never joined the weight-update group "
                f"({MODE_KEY}=collective: the trainer calls join_weight_group first)"
            )
        return self._weight_receiver.take(version)

    def _collective_loaded(self, version: int) -> None:
        """`version` is in the engine: its staging buffers can be reused."""
        if self._weight_receiver is not None:
            self._weight_receiver.recycle(version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the HF rollout engine's weights (to check an update: tests, bench)."""
        model = getattr(self.rollout, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise RuntimeError("rollout_weights reads the HF rollout engine only (rollout.name=hf)")
        return {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
