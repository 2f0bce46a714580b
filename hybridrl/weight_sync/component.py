"""One worker's weight movement, as an object the worker composes (`ActorRolloutRefWorker.weights`).

Every path starts with the same gather (gather.py: the training engine's shards -> full tensors
in the rollout dtype, through the rollout's weight loader) and ends in a rollout engine's
`update_weights` (colocated.py: bucket by bucket):

    colocated     `sync_into_rollout`   the hybrid engine: this process's training engine into
                                        this process's rollout engine (every rank; the engine of
                                        each TP rank keeps its slice)
    object store  `publish`             the asynchronous trainer: rank 0 returns the tensors; a
                                        rollout worker's `load(payload, v)` loads them
    collective    `open_group`, `join_group`, `broadcast`: trainer rank 0 sends the buckets over
                                        the weight-update group (collective.py); a rollout
                                        worker's receiver thread stages them and
                                        `load(collective_payload(v), v)` loads them

The worker keeps its remote methods (so they stay visible) and hands each to this object.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from hybridrl.models.weight_map import to_torch_dtype
from hybridrl.weight_sync.collective import (
    MODE_KEY,
    GroupSpec,
    WeightGroup,
    WeightReceiver,
    is_collective_payload,
    open_store,
)
from hybridrl.weight_sync.colocated import per_rank_sync_metrics, sync_weights, wake_and_sync
from hybridrl.weight_sync.gather import drain, gathered

__all__ = ["WeightSync", "rollout_state_copy"]


class WeightSync:
    """The weight movement of one worker process (trainer side, rollout side, or both).

    Args:
        rank: the worker's rank in its group.
        model_config: `actor_rollout_ref.model` (the TP layout reads the model's HF config).
        rollout_config: `actor_rollout_ref.rollout` (dtype, bucket size, TP size, wake-up order).

    Attributes:
        engine: the training engine whose weights go out (None on a rollout-only worker).
        loader: the rollout's weight loader the gather uses (`rollout.parallel.weight_loader_for`).
        rollout: this process's rollout engine (None on a training-only worker).
        stale: the training engine changed since this process's rollout engine last loaded it.
    """

    def __init__(self, rank: int, model_config: Any, rollout_config: Any) -> None:
        self.rank = rank
        self.model_config, self.rollout_config = model_config, rollout_config
        self.engine: Any = None
        self.loader: str | None = None
        self.rollout: Any = None
        self.stale = False
        self._group: WeightGroup | None = None
        self._receiver: WeightReceiver | None = None
        self._store: Any = None
        self._tp_layout: tuple[Any, str] | None = (
            None  # trainer rank 0: (TPLayout or None, why not) once known
        )

    # ------------------------------------------------------------------ wiring
    def attach_training(self, engine: Any, loader: str | None) -> None:
        """The training engine whose weights this worker sends, and the loader its gather uses."""
        self.engine, self.loader = engine, loader
        self.stale = True

    def attach_rollout(self, rollout: Any) -> None:
        """This process's rollout engine; it starts stale when a training engine sits beside it."""
        self.rollout = rollout
        self.stale = self.engine is not None

    def mark_changed(self) -> None:
        """The training engine's weights changed (an update, a checkpoint load)."""
        self.stale = True

    def gathered(self) -> Any:
        """The one gather routine (gather.py) with this worker's engine, rollout dtype and loader."""
        return gathered(self.engine, to_torch_dtype(self.rollout_config.dtype), self.loader)

    # --------------------------------------------------------------- colocated
    def sync_into_rollout(self) -> dict[str, float]:
        """The hybrid-engine switch: gather and load into this process's rollout engine if the
        training engine changed since the last sync; per-rank bytes and seconds come back as
        metrics ({} when there was nothing to do)."""
        if not self.stale or self.engine is None or self.rollout is None:
            return {}
        with self.gathered() as named:
            metrics = sync_weights(self.rollout, named)
        self.stale = False
        return {**metrics, **per_rank_sync_metrics(metrics)}

    def wake_and_sync(self) -> dict[str, float]:
        """Wake the rollout engine (veRL's multi_stage_wake_up order) and sync it if stale."""
        return wake_and_sync(self.rollout, self.sync_into_rollout, self.rollout_config.multi_stage_wake_up)

    # ------------------------------------------------------------ object store
    def publish(self, version: int) -> dict[str, Any] | None:
        """Every training rank gathers; rank 0 returns {"version", "weights": [(hf_name, CPU tensor
        in the rollout dtype)], "gather_s"}, the other ranks None."""
        self._need_engine("publish_weights")
        t0 = time.perf_counter()
        weights = []
        with self.gathered() as named:
            for name, tensor in named:
                if self.rank == 0:
                    weights.append((name, tensor.detach().to("cpu")))
        if self.rank != 0:
            return None
        return {"version": int(version), "weights": weights, "gather_s": time.perf_counter() - t0}

    # -------------------------------------------------------------- collective
    def open_group(self, world_size: int, timeout_s: float) -> tuple[str, int] | None:
        """Trainer rank 0: host the group's TCPStore on a free port; (host, port) there, else None."""
        if self.rank != 0:
            return None
        self._store, host, port = open_store(world_size, timeout_s)
        return host, port

    def join_group(self, spec: GroupSpec, first_rank: int) -> float | None:
        """Join as group rank `first_rank + rank` (0: trainer rank 0 only; 1: every rollout worker,
        which then starts its receiver thread); seconds the join took, None on trainer ranks > 0."""
        if first_rank == 0 and self.rank != 0:
            return None
        who = "trainer rank 0" if first_rank == 0 else f"rollout worker {self.rank}"
        store = self._store if first_rank == 0 else None
        tp = self.rollout_config.tensor_model_parallel_size if first_rank > 0 else 1
        self._group = WeightGroup(
            spec, first_rank + self.rank, store=store, who=who, tp_rank=self.rank % tp, tp_size=tp
        )
        if first_rank > 0:
            self._receiver = WeightReceiver(self._group)
        return self._group.join_s

    def _layout(self) -> Any:
        """Trainer rank 0: the rollout's TP layout (tp_shards.tp_layout), None when the full
        tensors go to every TP rank; the choice is printed once."""
        if self._tp_layout is None:
            from transformers import AutoConfig

            from hybridrl.models.builtin import resolve_model_path
            from hybridrl.weight_sync.tp_shards import tp_layout

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

    def broadcast(self, version: int, tp_shards: bool = True) -> dict[str, float] | None:
        """Every training rank gathers; rank 0 sends the buckets to the rollout workers (to a TP > 1
        rollout of a model tp_shards.py knows each TP rank only its slices, unless `tp_shards` is
        False). Rank 0 returns {"version", "bytes", "rank_bytes", "buckets", "send_s", "total_s"}."""
        self._need_engine("broadcast_weights")
        if self.rank == 0 and self._group is None:
            raise RuntimeError(f"broadcast_weights before join_weight_group ({MODE_KEY}=collective)")
        t0 = time.perf_counter()
        with self.gathered() as named:
            if self.rank != 0:  # the gather is a collective of all training ranks
                drain(named)
                return None
            bucket_bytes = int(self.rollout_config.update_weights_bucket_megabytes * 2**20)
            layout = self._layout() if tp_shards else None
            stats = self._group.send(named, version, bucket_bytes, layout)
        return {"version": float(version), **stats, "total_s": time.perf_counter() - t0}

    # ------------------------------------------------------------ rollout side
    def load(self, payload: Any, version: int) -> float:
        """A rollout worker loads version `version`: `publish`'s rank-0 result, or (a collective
        payload) what the group delivered; returns the seconds taken, waiting included."""
        collective = is_collective_payload(payload)
        if not collective and (not isinstance(payload, dict) or "weights" not in payload):
            raise ValueError(
                "load_weights: payload must be publish_weights()'s rank-0 result {'weights': ...}"
            )
        t0 = time.perf_counter()
        named = self._staged(version) if collective else iter(payload["weights"])
        sync_weights(self.rollout, named)
        if collective:
            self._receiver.recycle(version)  # its staging buffers may take a later update
        return time.perf_counter() - t0

    def _staged(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        if self._receiver is None:
            raise RuntimeError(
                f"load_weights got a collective payload, but this worker never joined the weight-update group "
                f"({MODE_KEY}=collective: the trainer calls join_weight_group first)"
            )
        return self._receiver.take(version)

    def received_bytes(self) -> dict[int, int]:
        """The bytes the weight-update group delivered, by version."""
        return dict(self._receiver.received_bytes) if self._receiver is not None else {}

    def _need_engine(self, what: str) -> None:
        if self.engine is None:
            raise RuntimeError(f"{what} needs the actor; init_model has not run")


def rollout_state_copy(rollout: Any) -> dict[str, torch.Tensor]:
    """A CPU copy of a rollout engine's weights (to check an update): the HF engine's state dict,
    or this vLLM TP rank's (its slices; on CPU vLLM keeps linear weights only in packed kernel
    form, so their entries are empty)."""
    model = getattr(rollout, "model", None)
    if isinstance(model, torch.nn.Module):
        return _state_copy(model)
    llm = getattr(rollout, "llm", None)
    if llm is None:
        raise RuntimeError("rollout_weights reads the HF or vLLM rollout engine (rollout.name=hf or vllm)")
    return llm.apply_model(_state_copy)[0]


def _state_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()}
