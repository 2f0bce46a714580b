"""Balanced partitions of sequences by length, and token-budget micro-batches.

`get_seqlen_balanced_partitions` splits items into k groups whose summed lengths are as equal as
the Karmarkar-Karp largest-differencing method makes them (optionally with equal item counts).
`rearrange_micro_batches` uses it to cut a batch into the fewest micro-batches that each fit a
token budget (dynamic batch size); `restore_order` puts per-row results back in batch order.

Karmarkar & Karp, "The differencing method of set partitioning" (1982); the k-way variant keeps,
for each partial solution, k subsets sorted by sum and merges the two solutions with the largest
spread (max sum - min sum) by pairing the largest subsets of one with the smallest of the other.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "get_reverse_idx",
    "get_seqlen_balanced_partitions",
    "partition_stats",
    "rearrange_micro_batches",
    "restore_order",
]


class _Solution:
    """k subsets (sum, item indices), kept sorted by sum, largest first."""

    __slots__ = ("subsets",)

    def __init__(self, subsets: list[tuple[int, list[int]]]) -> None:
        self.subsets = sorted(subsets, key=lambda s: (-s[0], s[1]))

    @property
    def spread(self) -> int:
        return self.subsets[0][0] - self.subsets[-1][0]

    def merge(self, other: _Solution) -> _Solution:
        # largest subsets of self with smallest of other: differencing the two solutions
        paired = zip(self.subsets, reversed(other.subsets))
        return _Solution([(a[0] + b[0], a[1] + b[1]) for a, b in paired])


def _karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    order = sorted(range(len(seqlens)), key=lambda i: (seqlens[i], i))
    solutions: list[_Solution] = []
    if equal_size:
        # each starting solution holds k items, one per subset, so every merge keeps counts equal
        for start in range(0, len(order), k):
            solutions.append(_Solution([(seqlens[i], [i]) for i in order[start : start + k]]))
    else:
        for i in order:
            solutions.append(_Solution([(seqlens[i], [i])] + [(0, []) for _ in range(k - 1)]))
    counter = itertools.count()
    heap = [(-s.spread, next(counter), s) for s in solutions]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, next(counter), merged))
    return [sorted(items) for _, items in heap[0][2].subsets]


def get_seqlen_balanced_partitions(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Split item indices into `k` groups with nearly equal summed `seqlens`.

    Args:
        seqlens: length (e.g. valid tokens) of each item; B entries.
        k: number of groups, 1 <= k <= B.
        equal_size: every group gets B / k items (B must be divisible by k).

    Returns:
        k lists of item indices (each sorted ascending); together they hold every index once.
        Groups are ordered by their smallest index.
    """
    seqlens = [int(s) for s in seqlens]
    n = len(seqlens)
    if k < 1:
        raise ValueError(f"number of partitions k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} items into {k} non-empty partitions; need at least {k} items")
    if equal_size and n % k:
        raise ValueError(f"equal_size=True needs the item count ({n}) to be divisible by k={k}")
    if any(s < 0 for s in seqlens):
        raise ValueError("sequence lengths must be >= 0")
    parts = _karmarkar_karp(seqlens, k, equal_size)
    if any(not p for p in parts):
        raise AssertionError("Karmarkar-Karp produced an empty partition")  # cannot happen for n >= k
    return sorted(parts, key=lambda p: p[0])


def partition_stats(
    seqlens: Sequence[int], partitions: Sequence[Sequence[int]], prefix: str = ""
) -> dict[str, float]:
    """min / max / mean of the partition sums, for logging how well a batch is balanced."""
    sums = [sum(int(seqlens[i]) for i in p) for p in partitions]
    return {
        f"{prefix}min": float(min(sums)),
        f"{prefix}max": float(max(sums)),
        f"{prefix}mean": float(sum(sums)) / len(sums),
    }


def _fits(seqlens: Sequence[int], k: int, max_token_len: int) -> list[list[int]] | None:
    if k == len(seqlens):  # one row per micro-batch: fits whenever the longest row does
        return [[i] for i in range(k)]
    parts = get_seqlen_balanced_partitions(seqlens, k, equal_size=False)
    if all(sum(seqlens[i] for i in p) <= max_token_len for p in parts):
        return parts
    return None


def _smallest_fitting_k(seqlens: Sequence[int], k: int, max_token_len: int) -> int:
    while k < len(seqlens) and _fits(seqlens, k, max_token_len) is None:
        k += 1
    return k


def _all_reduce_int(value: int, op: str, group: Any) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _row_lengths(batch: Any) -> list[int]:
    tensors = batch.batch if hasattr(batch, "non_tensor_batch") else batch
    if "attention_mask" not in tensors.keys():
        raise KeyError("dynamic batch size needs 'attention_mask' in the batch to count tokens per row")
    return [int(x) for x in tensors["attention_mask"].sum(dim=-1).tolist()]


def _take_rows(batch: Any, idx: list[int]) -> Any:
    if hasattr(batch, "select_idxs"):
        return batch.select_idxs(idx)
    return batch[torch.tensor(idx, dtype=torch.long)]


def rearrange_micro_batches(
    batch: Any,
    max_token_len: int,
    *,
    dp_group: Any = None,
    min_num_micro_batch: int = 1,
    key: str = "ppo_max_token_len_per_gpu",
) -> tuple[list[Any], list[list[int]]]:
    """Cut `batch` into the fewest balanced micro-batches of at most `max_token_len` tokens each.

    Tokens of a row = `attention_mask.sum()` (prompt + response). The number of micro-batches
    starts at ceil(total / max_token_len) and grows until every Karmarkar-Karp partition fits.
    With `dp_group`, all ranks agree on the largest count (FSDP needs every rank to run the same
    number of forward/backward passes).

    Args:
        batch: a DataProto or TensorDict with 'attention_mask' (B, S).
        max_token_len: token budget per micro-batch; must be >= the longest row.
        dp_group: process group over which the count is made equal (None: no communication;
            pass torch.distributed.group.WORLD explicitly for the default group).
        min_num_micro_batch: lower bound on the count.
        key: config key named in the error when a row does not fit.

    Returns:
        (micro_batches, indices): indices[j] are the rows of `batch` in micro_batches[j].
    """
    seqlens = _row_lengths(batch)
    n = len(seqlens)
    if n == 0:
        raise ValueError("cannot make micro-batches from an empty batch")
    longest = max(seqlens)
    if longest > max_token_len:
        raise ValueError(
            f"{key}={max_token_len} is smaller than the longest sequence ({longest} tokens); raise it to at "
            "least max_prompt_length + max_response_length"
        )
    k = max(min_num_micro_batch, math.ceil(sum(seqlens) / max_token_len))
    k = _smallest_fitting_k(seqlens, min(k, n), max_token_len)
    if dp_group is not None:
        while True:
            k = _all_reduce_int(k, "max", dp_group)
            if k > n:
                raise ValueError(
                    f"ranks disagree on the number of micro-batches ({k}) and this rank has only {n} rows; "
                    "give every rank the same number of rows"
                )
            ok = _fits(seqlens, k, max_token_len) is not None
            if _all_reduce_int(int(ok), "min", dp_group):
                break
            k = _smallest_fitting_k(seqlens, k + (not ok), max_token_len)
    parts = _fits(seqlens, k, max_token_len)
    assert parts is not None  # k == n always fits once the longest row does
    return [_take_rows(batch, p) for p in parts], parts


def get_reverse_idx(idx_map: Sequence[int]) -> list[int]:
    """Inverse permutation: out[idx_map[i]] = i."""
    reverse = [0] * len(idx_map)
    for i, j in enumerate(idx_map):
        reverse[j] = i
    return reverse


def restore_order(outputs: Sequence[torch.Tensor], indices: Sequence[Sequence[int]]) -> torch.Tensor:
    """Concatenate per-micro-batch results (rows in `indices` order) and return them in batch order.

    Args:
        outputs: outputs[j] has shape (len(indices[j]), ...).
        indices: the row indices returned by `rearrange_micro_batches`.

    Returns:
        (B, ...) with row i the result of batch row i.
    """
    flat = list(itertools.chain.from_iterable(indices))
    stacked = torch.cat(list(outputs), dim=0)
    if stacked.shape[0] != len(flat):
        raise ValueError(f"got {stacked.shape[0]} result rows for {len(flat)} indices")
    reverse = torch.tensor(get_reverse_idx(flat), dtype=torch.long, device=stacked.device)
    return stacked[reverse]
