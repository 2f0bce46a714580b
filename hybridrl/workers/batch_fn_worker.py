"""Worker methods that run a driver's function on the batch where its tensors are.

The PPO fit loop keeps its batch in the object store (`BatchRef`) and sends the function to the
data: over every rank's own rows (`apply_batch_fn`), over the whole batch on the first rank
(`apply_whole_batch_fn`, for a stage that needs the whole batch; its tensors come from the
object store, worker to worker), or once in every worker process (`run_in_every_process`).
Functions are pickled by reference: they must be importable in the workers (module-level).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.protocol import DataProto
from hybridrl.single_controller.base import Execute, register
from hybridrl.single_controller.dispatch import Dispatch

__all__ = ["BatchFnWorker"]


class BatchFnWorker:
    """Mixin of a worker class: the batch-function methods (see the module docstring)."""

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply_batch_fn(self, fn: Callable[[DataProto], DataProto], data: DataProto) -> DataProto:
        """`fn(rows)` over this rank's rows; `fn` is row-wise (its result on a row needs only that row)."""
        return fn(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def apply_whole_batch_fn(self, fn: Callable[[DataProto], DataProto], data: DataProto) -> DataProto:
        """`fn(batch)` over the whole batch, on rank 0 only."""
        return fn(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def run_in_every_process(self, fn: Callable[[], Any]) -> None:
        """`fn()` once in this worker's process (e.g. keep an object the batch functions use)."""
        fn()
