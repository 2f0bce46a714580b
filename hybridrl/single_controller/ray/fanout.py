"""Fan-out of a worker-group call through one dispatcher actor per node.

Called directly, a worker-group call costs the driver one Ray actor task per rank (submission,
argument serialisation, reply and reference bookkeeping), so the driver's time per call grows
linearly with the ranks. With the fan-out, the driver sends one task per *node*: a
:class:`NodeDispatcher` actor on that node (no CPU reserved, one per worker group and node)
receives the per-rank arguments of the node's ranks (small: ObjectRefs, BatchRef shards, per-rank
values the driver already put into the object store), submits the actor tasks to its local
ranks, waits for them and hands back one object: the per-rank results in rank order. The results of a call given
a BatchRef are handles on tensors each rank put into the object store: the dispatcher puts its
node's handles' references into one object, so the driver holds one reference per node
(``batch_ref.NodeShard``) and a worker that reads a shard resolves it there. The driver's
work per call then grows with the nodes, not with the ranks (bench/controller_scale.py
``--fanout`` measures both).

The semantics are those of the direct call (ray/base.py, ``gather_refs``):

* a rank that raised or died comes back at once as its own result reference, and the driver
  raises the same WorkerGroupError / WorkerDiedError / NodeLostError naming group, rank and
  method that the direct call raises;
* a node whose ranks make no progress for ``trainer.step_timeout_s`` reports them, and the driver
  raises the same WorkerHungError naming the first unfinished rank (the limit counts from the
  node's last finished rank; the direct call counts from the group's);
* results come back in rank order.

Only blocking calls and ``execute_all`` fan out; non-blocking calls (whose futures other calls may
chunk lazily, rank by rank) and ``execute_rank_zero`` submit directly. By default (a group of at
least ``FANOUT_MIN_RANKS`` ranks) a call that sends a DataProto, tensor or array also goes direct:
its results are the batch, and passing them through the dispatcher costs more than the tasks it
saves (``RayWorkerGroup(fanout=True)`` fans out every blocking call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from hybridrl.single_controller.ray.gather import poll_refs

__all__ = ["FANOUT_MIN_RANKS", "NodeDispatcher"]

# A worker group of at least this many ranks (whose nodes are known) fans out its blocking calls
# that send no tensors by default; RayWorkerGroup(fanout=True / False) decides for one group.
FANOUT_MIN_RANKS = 8
# How long the driver waits beyond trainer.step_timeout_s for a dispatcher that itself stopped
# answering (its ranks' own hang is reported by the dispatcher within the limit).
DISPATCHER_GRACE_S = 30.0


class NodeDispatcher:
    """Ray actor: runs one worker-group call on the ranks of one node.

    Args:
        actors: {rank: actor handle} of the group's ranks on this node.
    """

    def __init__(self, actors: dict[int, Any]) -> None:
        self._actors = dict(actors)

    def ready(self) -> bool:
        return True

    def call(
        self,
        method: str,
        ranks: Sequence[int],
        rank_args: Sequence[tuple],
        rank_kwargs: Sequence[dict[str, Any]],
        limit_s: float,
    ) -> tuple:
        """Submit ``method`` to each rank with its arguments and wait for all of them.

        Returns one of:
            ("ok", [result of each rank, in the order of ``ranks``]);
            ("failed", rank, result ref): the rank raised or died; the driver reads the error
                from the ref and raises it named by rank (as a direct call does);
            ("hung", [unfinished ranks], idle_s, total_s): no rank finished for ``limit_s``.
        """
        refs = [
            getattr(self._actors[r], method).remote(*a, **k) for r, a, k in zip(ranks, rank_args, rank_kwargs)
        ]
        outcome = wait_ranks(refs, list(ranks), limit_s)
        if outcome[0] == "ok" and _all_shard_handles(outcome[1]):
            from hybridrl.single_controller.batch_ref import node_shards

            return ("ok", node_shards(outcome[1]))
        return outcome


def _all_shard_handles(values: list[Any]) -> bool:
    """Results of a call given a BatchRef: one ShardHandle per rank (batch_ref.by_ref_output)."""
    return bool(values) and all(type(v).__name__ == "ShardHandle" for v in values)


class _RankFailed(Exception):
    def __init__(self, index: int) -> None:
        self.index = index


def wait_ranks(refs: list[Any], ranks: list[int], limit_s: float) -> tuple:
    """The outcome of one node's call (see NodeDispatcher.call), polled as ``gather_refs`` polls."""
    values: dict[int, Any] = {}

    def take(done: list[int]) -> None:
        try:
            values.update(zip(done, ray.get([refs[i] for i in done])))
        except RayError:
            for i in done:
                try:
                    ray.get(refs[i])
                except RayError:
                    raise _RankFailed(i) from None

    try:
        stuck, idle_s, total_s = poll_refs(refs, limit_s, take)
    except _RankFailed as failed:
        return ("failed", ranks[failed.index], refs[failed.index])
    if stuck:
        return ("hung", [ranks[i] for i in stuck], idle_s, total_s)
    return ("ok", [values[i] for i in range(len(refs))])
