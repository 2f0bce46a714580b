"""The worker side of the collective weight update (hybridrl/async_rollout/collective.py): the
remote methods ActorRolloutRefWorker takes from `CollectiveWeightsMixin`.

Training workers (the actor role, disaggregated): `open_weight_group` (rank 0 hosts the store),
`join_weight_group(spec, 0)` (rank 0 joins as group rank 0), `broadcast_weights(version)` (every
rank gathers, rank 0 sends: to a tensor-parallel rollout each TP rank only its slices when
tp_shards.py knows the model, else the full tensors to all). Rollout workers:
`join_weight_group(spec, 1)` (worker r joins as group rank 1 + r, TP rank r % TP, and starts its
receiver thread); `load_weights(collective_payload(v), v)` then loads the staged version v. The
driver's side is hybridrl/trainer/async_ppo/weight_update.py.
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
    _tp_layout: tuple[Any, str] | None = None  # trainer rank 0: (TPLayout or None, why not) once known

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
        tp = self.rollout_config.tensor_model_parallel_size if first_rank > 0 else 1
        self._weight_group = WeightGroup(
            spec, first_rank + self.rank, store=store, who=who, tp_rank=self.rank % tp, tp_size=tp
        )
        if first_rank > 0:
            self._weight_receiver = WeightReceiver(self._weight_group)
        return self._weight_group.join_s

    def _layout(self) -> Any:
        """Trainer rank 0: the rollout's TP layout (tp_shards.tp_layout), None when the full
        tensors go to every TP rank; the choice is printed once."""
        if self._tp_layout is None:
            from transformers import AutoConfig

            from hybridrl.async_rollout.tp_shards import tp_layout
            from hybridrl.models.builtin import resolve_model_path

            tp = self.rollout_config.tensor_model_parallel_size
            path = resolve_model_path(self.model_config.path, key="actor_rollout_ref.model.path")
            self._tp_layout = tp_layout(AutoConfig.from_pretrained(path), tp)
            if tp > 1:
                layout, why = self._tp_layout
                print(
                    f"[hybridrl.async] collective weight update to TP={tp} engines: "
                    + (
                        "each TP rank receives only its slices"
                        if layout
                        else f"full tensors to every TP rank ({why})"
                    )
                )
        return self._tp_layout[0]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def broadcast_weights(self, version: int, tp_shards: bool = True) -> dict[str, float] | None:
        """Disaggregated trainer: gather the full parameters (every rank must call this, as for
        publish_weights); rank 0 sends them to the rollout workers in buckets of
        rollout.update_weights_bucket_megabytes: to a TP > 1 rollout of a model tp_shards.py knows,
        each TP rank gets only its slices; otherwise (or `tp_shards=False`, the reference path of
        tests and bench/async_weight_update.py) every worker gets the full tensors.

        Returns:
            On rank 0: {"version", "bytes" (all buckets), "rank_bytes" (what one rollout worker
            receives), "buckets", "send_s" (packing + transfers), "total_s" (gather included)};
            None on the other ranks.
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
            layout = self._layout() if tp_shards else None
            stats = self._weight_group.send(named, version, bucket_bytes, layout)
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
    def received_weight_bytes(self) -> dict[int, int]:
        """Rollout worker: the bytes the weight-update group delivered, by version (tests, bench)."""
        receiver = self._weight_receiver
        return dict(receiver.received_bytes) if receiver is not None else {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the rollout engine's weights (to check an update: tests, bench): the HF
        engine's state dict, or this vLLM TP rank's (its slices; on CPU vLLM keeps linear weights
        only in packed kernel form, so their entries are empty)."""
        model = getattr(self.rollout, "model", None)
        if isinstance(model, torch.nn.Module):
            return _state_copy(model)
        llm = getattr(self.rollout, "llm", None)
        if llm is None:
            raise RuntimeError(
                "rollout_weights reads the HF or vLLM rollout engine (rollout.name=hf or vllm)"
            )
        return llm.apply_model(_state_copy)[0]


def _state_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
