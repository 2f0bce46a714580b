"""Staleness control for asynchronous rollouts: pure bookkeeping, no Ray, no threads.

Vocabulary (docs/async.md has the long form):

* a *group* is one prompt and its `rollout.n` responses; every count here is in groups;
* the *policy version* v is the number of optimizer updates applied so far; trainer batch k is
  trained at version k (its proximal policy) and produces version k + 1;
* a group generated with weights of version w and consumed in batch k has *staleness* k - w;
* eta = `max_head_offpolicyness` bounds the staleness; its *deadline* is w + eta, the last batch
  it may go into.

Two rules keep every consumed group within the bound (AReaL, Fu et al. 2025, arXiv 2505.24298,
section 5.1, gives the producer rule; the consumer rule makes the bound hard when groups finish
out of order):

1. Producer gate (`StalenessManager.capacity`): at rollout version v a new group may be committed
   only while ``committed_total + 1 <= (v + eta + 1) * B`` and ``running + 1 <=
   max_concurrent_rollouts`` (B = consumer batch size).
2. Consumer rule (`select_batch`): batch k takes the B finished groups with the earliest
   deadlines, but only if afterwards, for every deadline d >= k, at most (d - k) * B outstanding
   groups with deadline <= d remain, i.e. they still fit in batches k+1..d. Otherwise it waits.

Why this never exceeds eta: rule 1 gives, before batch k, ``outstanding(deadline <= d) <= (d - k
+ 1) * B`` for all d (the groups with deadline <= d were committed at versions <= d - eta, so at
most (d + 1) * B of them exist, and k * B were consumed). Rule 2 keeps that invariant from k to
k + 1, and for d = k it forces every group with deadline k into batch k. So no group is consumed
after its deadline. With eta = 0 both rules reduce to the synchronous loop: batch k is exactly
the B groups generated with version k.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "StalenessError",
    "StalenessManager",
    "select_batch",
    "staleness_metrics",
    "token_version_metrics",
]


class StalenessError(RuntimeError):
    """A group is past its deadline: the staleness bound was broken (a bug, never user error)."""


@dataclass
class StalenessManager:
    """Counters of the producer gate (rule 1 of the module docstring).

    Args:
        consumer_batch_size: B, groups per trainer batch.
        max_head_offpolicyness: eta >= 0.
        max_concurrent_rollouts: most groups committed but not finished at once.
        start_version: the trainer's version when the run (or a resumed run) starts; the
            counters behave as if start_version batches had been committed and consumed.

    Attributes:
        submitted: groups committed since version 0 (including the virtual ones before
            start_version).
        running: committed and not yet finished (queued or generating).
        consumed: groups handed to the trainer since version 0.
    """

    consumer_batch_size: int
    max_head_offpolicyness: int
    max_concurrent_rollouts: int
    start_version: int = 0
    submitted: int = field(init=False)
    running: int = field(init=False, default=0)
    consumed: int = field(init=False)

    def __post_init__(self) -> None:
        if self.consumer_batch_size < 1:
            raise ValueError(f"consumer_batch_size must be >= 1, got {self.consumer_batch_size}")
        if self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {self.max_head_offpolicyness}")
        if self.max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {self.max_concurrent_rollouts}")
        if self.start_version < 0:
            raise ValueError(f"start_version must be >= 0, got {self.start_version}")
        self.submitted = self.consumed = self.start_version * self.consumer_batch_size

    @property
    def batch_index(self) -> int:
        """k, the index of the next batch the trainer takes (= the version it trains at)."""
        return self.consumed // self.consumer_batch_size

    def capacity(self, version: int) -> int:
        """How many more groups may be committed while the rollout is at `version`."""
        by_staleness = (version + self.max_head_offpolicyness + 1) * self.consumer_batch_size - self.submitted
        by_concurrency = self.max_concurrent_rollouts - self.running
        return max(0, min(by_staleness, by_concurrency))

    def on_commit(self, n: int = 1) -> None:
        self.submitted += n
        self.running += n

    def on_finish(self, n: int = 1) -> None:
        if n > self.running:
            raise ValueError(f"on_finish({n}) but only {self.running} groups are running")
        self.running -= n

    def on_drop(self, n: int) -> None:
        """`n` finished groups were dropped (DAPO dynamic sampling): they no longer count as
        committed, so the gate admits as many new ones. Rule 1's bound then counts the groups that
        can still be trained, which is what the consumer rule needs."""
        if n > self.submitted - self.running - self.consumed:
            raise ValueError(
                f"on_drop({n}): only {self.submitted - self.running - self.consumed} finished groups exist"
            )
        self.submitted -= n

    def on_consume(self, n: int) -> None:
        if self.consumed + n > self.submitted - self.running:
            raise ValueError(
                f"on_consume({n}): only {self.submitted - self.running - self.consumed} finished groups exist"
            )
        self.consumed += n


def select_batch(
    finished: Sequence[tuple[Hashable, int]],
    unfinished_deadlines: Iterable[int],
    batch_index: int,
    batch_size: int,
) -> list[Hashable] | None:
    """Rule 2 of the module docstring: which finished groups form batch k, or None to wait.

    Args:
        finished: (key, deadline) of every finished, not yet consumed group, in arrival order.
        unfinished_deadlines: deadlines of the committed groups still queued or generating (for a
            queued group, a lower bound: its commit version + eta).
        batch_index: k, the trainer's version.
        batch_size: B.

    Returns:
        B keys, earliest deadline first (ties in arrival order), or None when the batch has to
        wait for more groups to finish.

    Raises:
        StalenessError: an outstanding group's deadline is before k (the bound is already broken).
    """
    unfinished = list(unfinished_deadlines)
    deadlines = [d for _, d in finished] + unfinished
    if deadlines and min(deadlines) < batch_index:
        raise StalenessError(
            f"batch {batch_index}: an outstanding group has deadline {min(deadlines)} < {batch_index}; "
            "the staleness bound was broken (a bug in the producer gate or the consumer)"
        )
    if len(finished) < batch_size:
        return None
    order = sorted(range(len(finished)), key=lambda i: finished[i][1])  # stable: ties by arrival
    take = [finished[i] for i in order[:batch_size]]
    outstanding = Counter(deadlines)
    taken = Counter(d for _, d in take)
    outstanding_le = taken_le = 0
    for d in sorted(outstanding):
        outstanding_le += outstanding[d]
        taken_le += taken.get(d, 0)
        if outstanding_le - taken_le > (d - batch_index) * batch_size:
            return None
    return [key for key, _ in take]


def staleness_metrics(staleness: Sequence[int], max_head_offpolicyness: int) -> dict[str, float]:
    """Per-batch staleness summary: mean, max, and the histogram as fractions of the groups.

    Args:
        staleness: k - w for every group of the batch.
        max_head_offpolicyness: eta; the histogram has bins 0..eta.

    Returns:
        async/staleness/mean, async/staleness/max and async/staleness/hist_<s> for s in 0..eta.
    """
    if not staleness:
        return {}
    n = len(staleness)
    counts = Counter(staleness)
    out = {
        "async/staleness/mean": sum(staleness) / n,
        "async/staleness/max": float(max(staleness)),
    }
    for s in range(max(max_head_offpolicyness, max(staleness)) + 1):
        out[f"async/staleness/hist_{s}"] = counts.get(s, 0) / n
    return out


def token_version_metrics(rollout_versions: torch.Tensor, batch_index: int) -> dict[str, float]:
    """Per-token staleness of a batch generated with partial rollout.

    Args:
        rollout_versions: (B, T) int, the policy version of each response token, -1 on padding.
        batch_index: k, the version the batch is trained at.

    Returns:
        async/token_staleness/mean and /max (k - version over the response tokens) and
        async/partial/mixed_version_frac, the share of responses whose tokens come from more than
        one policy version.
    """
    valid = rollout_versions >= 0
    if not bool(valid.any()):
        return {}
    stale = (batch_index - rollout_versions)[valid].float()
    big = torch.iinfo(rollout_versions.dtype).max
    lo = torch.where(valid, rollout_versions, torch.full_like(rollout_versions, big)).min(dim=-1).values
    hi = rollout_versions.max(dim=-1).values
    rows = valid.any(dim=-1)
    return {
        "async/token_staleness/mean": float(stale.mean()),
        "async/token_staleness/max": float(stale.max()),
        "async/partial/mixed_version_frac": float((hi > lo)[rows].float().mean()),
    }
