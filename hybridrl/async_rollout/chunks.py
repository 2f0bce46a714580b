"""Splitting a finished chunk: which groups are done and which go back to the queue (partial
rollout), which are kept and which are dropped (DAPO dynamic sampling). Pure functions over the
manager's records; the manager does the locking and the counting."""

from __future__ import annotations

from collections.abc import Sequence

from hybridrl.async_rollout.records import Chunk, Group
from hybridrl.protocol import DataProto
from hybridrl.rollout.resume import unfinished_group_prefixes

__all__ = ["keep_groups", "split_unfinished"]


def _rows(indices: Sequence[int], n: int) -> list[int]:
    return [r for i in indices for r in range(i * n, (i + 1) * n)]


def split_unfinished(chunk: Chunk, out: DataProto, n: int) -> tuple[Chunk, DataProto, list[Group]]:
    """Partial rollout: the groups with an unfinished row get their prefixes (`Group.partial`).

    Args:
        chunk: the dispatched chunk (len(chunk.groups) * n rows).
        out: its generation output; the non-tensor "partial_done" column is popped.
        n: rollout.n, rows per group.

    Returns:
        (chunk of the finished groups, their output rows, the unfinished groups in chunk order).
    """
    prefixes = unfinished_group_prefixes(out, n)  # pops partial_done
    keep = [i for i in range(len(chunk.groups)) if i not in prefixes]
    back = [g for i, g in enumerate(chunk.groups) if i in prefixes]
    for i, cols in prefixes.items():
        chunk.groups[i].partial = cols  # None: nothing generated yet, a fresh start (re-tagged)
    if not back:
        return chunk, out, back
    groups = [chunk.groups[i] for i in keep]
    if not keep:
        return Chunk(chunk.worker, [], chunk.rest, chunk.version), out, back
    rows = _rows(keep, n)
    return (
        Chunk(chunk.worker, groups, chunk.rest.select_idxs(rows), chunk.version),
        out.select_idxs(rows),
        back,
    )


def keep_groups(
    chunk: Chunk, full: DataProto, keep: Sequence[bool], n: int
) -> tuple[Chunk, DataProto, list[Group]]:
    """DAPO dynamic sampling: keep the groups whose rows are all kept.

    Args:
        chunk: a finished chunk; full: its postprocessed rows (len(chunk.groups) * n).
        keep: per-row keep mask (the group filter's verdict).
        n: rollout.n.

    Returns:
        (chunk of the kept groups, their rows, the dropped groups).
    """
    kept = [i for i in range(len(chunk.groups)) if all(keep[i * n : (i + 1) * n])]
    if len(kept) == len(chunk.groups):
        return chunk, full, []
    dropped = [g for i, g in enumerate(chunk.groups) if i not in set(kept)]
    groups = [chunk.groups[i] for i in kept]
    return Chunk(chunk.worker, groups, chunk.rest, chunk.version), full.select_idxs(_rows(kept, n)), dropped
