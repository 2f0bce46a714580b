"""Where the PPO step's batch lives, and where each batch function runs.

With Ray workers the fit loop holds the step's batch as a `BatchRef`
(hybridrl/single_controller/batch_ref.py): the token-level tensors stay in the object store and
travel worker to worker; the driver holds the per-sample columns (uid, data source, reward
extras) and receives per-sample values and metrics. A one-slot run in the driver process
(`trainer.backend=local`) holds a `DataProto`, as every stage does after it pulled the batch.

* `add(batch, fn)`: the columns `fn` (a function of hybridrl/trainer/ppo/batch_fns.py) computes from
  the whole batch, added to it; the driver gets `fn`'s per-sample values and metrics. For a
  BatchRef, `fn` runs on the actor group's first worker, which fetches the batch from the object
  store; for a DataProto, on the driver. Either way the same function sees the same tensors.
* `per_rank(batch, fn)`: `fn` on every worker over its own rows (row-wise functions only).
* `pull(batch, why)`: the whole batch as a DataProto on the driver, for a stage that needs it
  there; counted in `batch_ref.TRANSFER` and said once per run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.protocol import DataProto
from hybridrl.single_controller.batch_ref import BatchRef, ShardHandle

StepBatch = DataProto | BatchRef


class StepData:
    """The fit loop's access to the step's batch (see the module docstring).

    Args:
        group: the actor/rollout worker group (its `apply_batch_fn` / `apply_whole_batch_fn`).
        by_reference: hold the batch as a BatchRef (Ray workers that have those methods).
    """

    def __init__(self, group: Any, by_reference: bool) -> None:
        self.group = group
        self.by_reference = by_reference
        self.pulled_for: list[str] = []

    @classmethod
    def for_workers(cls, group: Any) -> StepData:
        """By reference when the group's workers are Ray actors with the batch-function methods."""
        from hybridrl.single_controller.ray.base import RayWorkerGroup

        has_methods = all(hasattr(group, m) for m in ("apply_batch_fn", "apply_whole_batch_fn"))
        return cls(group, has_methods and isinstance(group, RayWorkerGroup))

    def hold(self, data: DataProto) -> StepBatch:
        """The step's batch built from `data` on the driver (its tensors put into the store once)."""
        return BatchRef.from_proto(data) if self.by_reference else data

    def whole(self, batch: StepBatch, fn: Callable[[DataProto], DataProto]) -> tuple[StepBatch, dict]:
        """(the columns `fn` computed, `fn`'s meta_info["out"]) over the whole batch."""
        if isinstance(batch, DataProto):
            out = fn(batch)
        else:
            (future,), _ = batch.shard(1, pad=False)
            handle = self.group.apply_whole_batch_fn(fn, future)
            if not isinstance(handle, ShardHandle):
                raise TypeError(f"apply_whole_batch_fn returned {type(handle).__name__}, not a DataProto")
            out = BatchRef.from_handles([handle], 0)
        return out, out.meta_info.pop("out", {})

    def add(self, batch: StepBatch, fn: Callable[[DataProto], DataProto]) -> tuple[StepBatch, dict]:
        """`batch` with the columns `fn` computed from it added; and `fn`'s per-sample values/metrics."""
        out, values = self.whole(batch, fn)
        return batch.union(out), values

    def per_rank(self, batch: StepBatch, fn: Callable[[DataProto], DataProto]) -> tuple[StepBatch, dict]:
        """`fn` over each worker's rows (a BatchRef) or the whole batch (a DataProto): its columns."""
        if isinstance(batch, DataProto):
            out = fn(batch)
        else:
            out = self.group.apply_batch_fn(fn, batch)
        return out, out.meta_info.pop("out", {})

    def pull(self, batch: StepBatch, why: str) -> DataProto:
        """The batch on the driver (a DataProto); says once per reason that it moved there."""
        if isinstance(batch, DataProto):
            return batch
        if why not in self.pulled_for:
            self.pulled_for.append(why)
            print(f"[hybridrl] {why}: this stage needs the whole batch on the driver (BatchRef.pull)")
        return batch.pull()
