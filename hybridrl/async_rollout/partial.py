"""The rollout worker of partial rollout: generation that a weight update can interrupt.

`PartialRolloutWorker` is the disaggregated rollout worker (ActorRolloutRefWorker,
role='rollout') plus one control method, `abort_generation`, that runs in its own Ray
concurrency group, i.e. while `generate_sequences` is executing. Every other call (generate,
load_weights) stays in the default group, one at a time and in submission order, so a weight
update still lands between two generate calls and never inside one.

At a weight update the manager queues ``load_weights(payload, v)`` and calls
``abort_generation(v, [payload])``: once the new weights exist (the call waits for the payload
without fetching it), a generation running with a version older than v stops at its next decode
step and returns its tokens so far; ``load_weights`` runs next, and the unfinished rows continue
in a later call from their prefix (hybridrl/rollout/resume.py). An abort that arrives
after its generation finished does nothing (the worker's version is then >= v).
"""

from __future__ import annotations

from typing import Any

import ray

from hybridrl.protocol import DataProto
from hybridrl.rollout.resume import generate_resumable
from hybridrl.utils import deadlines
from hybridrl.workers.engine_workers import ActorRolloutRefWorker

__all__ = ["PartialRolloutWorker"]


class PartialRolloutWorker(ActorRolloutRefWorker):
    """ActorRolloutRefWorker(role='rollout', disaggregated=True) whose generation can be aborted.

    Rows that carry the partial columns (resume.PARTIAL_KEYS) are generated with
    `generate_resumable`; others as in the base class.
    """

    ray_concurrency_groups = {"control": 1}
    _abort_below = -1  # abort a generation whose policy version is below this
    aborts = 0  # generations that stopped early

    def _abort_pending(self) -> bool:
        return self._abort_below > self.policy_version

    def _rollout_generate(self, prompts: DataProto) -> DataProto:
        if "partial_done" not in prompts.non_tensor_batch:
            return super()._rollout_generate(prompts)
        # the abort callback is set for this call only: validation (`generate_now`) and the ReMax
        # baseline run on the same engine and must never be cut short by a pending abort
        self.rollout.abort_requested = self._abort_pending
        try:
            out = generate_resumable(self.rollout, prompts, self.policy_version)
        finally:
            self.rollout.abort_requested = None
        if getattr(self.rollout, "last_generate_aborted", False):
            self.aborts += 1
        out.meta_info["worker_aborts"] = self.aborts
        return out

    @ray.method(concurrency_group="control")
    def abort_generation(self, version: int, ready: list[Any] | None = None) -> bool:
        """Stop a generation older than `version` at its next decode step (runs concurrently).

        Args:
            version: the version being published.
            ready: ObjectRefs to wait for first (the weight payload), not fetched.

        Returns:
            True if a generation older than `version` may be running.
        """
        if ready:  # bounded: one payload that never comes must not block the one control thread
            what = f"rollout worker {self.rank} abort_generation (version {version}): the weight payload"
            deadlines.wait_refs(list(ready), what=what)
        self._abort_below = max(self._abort_below, int(version))
        return self._abort_pending()
