"""The driver's side of the asynchronous trainer's weight path: how each new version reaches the
rollout workers (`async_training.weight_update_mode`, docs/async.md "Weight updates").

* `object_store`: every training rank gathers; rank 0 returns the tensors, which Ray keeps in
  its object store; each rollout worker's `load_weights(ref, v)` fetches and loads them.
* `collective`: a process group of trainer rank 0 and every rollout worker
  (collective.py), built once before the first update; every training rank gathers and rank 0
  sends the buckets (to TP > 1 engines each TP rank only its slices, where tp_shards.py knows
  the model); each worker's receiver thread stages them and its
  `load_weights(collective_payload(v), v)` loads them.

Both are non-blocking for the driver: `publish(v)` starts the gather and returns the payload the
AsyncRolloutManager hands to `load_weights`. The previous update's results are checked at the
next `publish`, so a failure surfaces there with its traceback and the key to change.
"""

from __future__ import annotations

from typing import Any

from hybridrl.single_controller.ray.base import gather_refs
from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerGroupError
from hybridrl.utils.device import get_dist_backend
from hybridrl.weight_sync.collective import TIMEOUT_KEY, GroupSpec, collective_payload

__all__ = ["WeightPublisher"]

_JOIN_SLACK_S = 30.0  # the driver waits this much longer than the members' own join deadline
_PROBE_S = 10.0  # after a failed broadcast: how long a rollout worker may take to answer it is alive


class WeightPublisher:
    """Publish new policy versions to the rollout workers (one `publish` per trainer step).

    Args:
        train: the actor view of the training group (publish_weights / broadcast_weights, ...).
        rollout_group: the rollout workers' RayWorkerGroup.
        mode: "object_store" or "collective" (async_training.weight_update_mode).
        timeout_s: async_training.weight_update_timeout_s (group creation, each broadcast).
    """

    def __init__(self, train: Any, rollout_group: Any, mode: str, timeout_s: float) -> None:
        self.train, self.rollout_group = train, rollout_group
        self.mode, self.timeout_s = mode, float(timeout_s)
        self._last = None  # the previous publish's future
        self._joined = False
        self.metrics: dict[str, float] = {}  # of the last checked update (async/weight_update/*)

    def publish(self, version: int, workers_lost: bool = False) -> Any:
        """Start publishing `version`; returns the `load_weights` payload for the manager.

        workers_lost: a rollout worker died since the start. A dead member breaks the group, so
        the collective path then hands over to the object store for the rest of the run.
        """
        self.check_last()
        if self.mode == "collective" and workers_lost:
            print(
                "[hybridrl.async] a rollout worker died, which breaks the weight-update group: the weights go "
                "through the Ray object store from now on (async_training.weight_update_mode=object_store)"
            )
            self.mode = "object_store"
        if self.mode == "collective":
            if not self._joined:
                self.join()
            self._last = self.train.broadcast_weights(version)
            return collective_payload(version)
        self._last = self.train.publish_weights(version)
        return self._last.refs[0]

    def check_last(self) -> None:
        """Wait for the previous update's training ranks (rank 0's payload is not fetched)."""
        last, self._last = self._last, None
        if last is None:
            return
        if self.mode != "collective":
            if len(last.refs) > 1:
                ranks = list(range(1, len(last.refs)))
                gather_refs(last.refs[1:], group="train", method="publish_weights", ranks=ranks)
            return
        try:
            got = gather_refs(
                last.refs,
                group="train",
                method="broadcast_weights",
                ranks=list(range(len(last.refs))),
                timeout_s=self.timeout_s + _JOIN_SLACK_S,
                timeout_key=TIMEOUT_KEY,
            )[0]
        except WorkerGroupError as failed:
            dead = self._dead_rollout_worker()
            if dead is not None:  # the broadcast failed because a member died: say which (restartable)
                raise dead from failed
            raise
        self.metrics = {
            "async/weight_update/send_s": got["send_s"],
            "async/weight_update/gather_send_s": got["total_s"],
            "async/weight_update/mbytes": got["bytes"] / 2**20,
            "async/weight_update/mbytes_per_rollout_worker": got["rank_bytes"] / 2**20,
        }

    def _dead_rollout_worker(self) -> WorkerDiedError | None:
        """The error of the first rollout worker found dead (a NodeLostError when its node is gone),
        or None when every rollout worker answers."""
        import ray
        from ray.exceptions import RayActorError

        from hybridrl.single_controller.ray.nodes import node_lost_error

        for rank, actor in enumerate(self.rollout_group.workers):
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=_PROBE_S)
            except RayActorError as err:
                lost = node_lost_error(err, "rollout", rank, "broadcast_weights")
                return lost or WorkerDiedError(
                    f"rollout worker {rank} died during the collective weight update "
                    f"(async_training.weight_update_mode=collective): {err}",
                    group="rollout",
                    rank=rank,
                    method="broadcast_weights",
                    cause=err,
                )
            except Exception:  # noqa: BLE001 - alive but busy, or unknown: not the dead member
                continue
        return None

    def join(self) -> None:
        """Build the weight-update group: trainer rank 0 hosts the store, then trainer rank 0 and
        every rollout worker join at once. A member that cannot join within timeout_s fails the
        start with a message naming async_training.weight_update_timeout_s and the fallback."""
        world = 1 + self.rollout_group.world_size
        host, port = self.train.open_weight_group(world, self.timeout_s)[0]
        spec = GroupSpec(host, port, world, get_dist_backend(), self.timeout_s)
        train_refs = self.train.join_weight_group(spec, 0).refs
        rollout_refs = self.rollout_group.execute_all_async("join_weight_group", spec, 1)
        gather_refs(
            [*train_refs, *rollout_refs],
            group="weight_update",
            method="join_weight_group",
            ranks=list(range(len(train_refs) + len(rollout_refs))),
            timeout_s=self.timeout_s + _JOIN_SLACK_S,
            timeout_key=TIMEOUT_KEY,
        )
        self._joined = True
        print(
            f"[hybridrl.async] weight-update group: trainer rank 0 + {world - 1} rollout worker(s) over "
            f"{spec.backend} at {host}:{port}"
        )
