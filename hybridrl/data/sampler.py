"""Resumable sampling and batching: a resumed run sees exactly the remaining batches.

`ResumableSampler` fixes one index order per epoch (a seeded permutation when shuffling, so the
order of epoch e does not depend on how many epochs ran in this process) and remembers where it
is: (epoch, position). `RLDataLoader` draws each batch's indices from it in the calling process,
so its `state_dict()` after k batches says exactly "k batches consumed", and a fresh loader that
loads that state yields the same remaining batches.

With `num_workers > 0` (veRL `data.dataloader_num_workers`) the rows are read and collated by a
torch DataLoader's worker processes, which run ahead of the consumer (prefetch). The indices are
still drawn here, batch by batch, and the sampler state after each draw is kept with the batch:
`state_dict()` is the state after the last batch *handed out*, and a new epoch's iteration first
rewinds the sampler to it, so prefetched-but-unused batches are never skipped.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Sampler

__all__ = ["RLDataLoader", "ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Index sampler over epochs with `state_dict()` / `load_state_dict()`.

    Epoch e's order is `range(data_len)` or, with `shuffle`, the permutation drawn from
    `numpy.random.default_rng([seed, e])`. `position` counts the indices of the current epoch
    already handed out; when an epoch is exhausted the sampler moves to the next one.

    Args:
        data_len: number of rows in the dataset.
        shuffle: permute each epoch (veRL `data.shuffle`).
        seed: base seed (veRL `data.seed`).
    """

    def __init__(self, data_len: int, shuffle: bool = True, seed: int = 0) -> None:
        if int(data_len) < 1:
            raise ValueError(f"ResumableSampler needs a non-empty dataset, got data_len={data_len}")
        self.data_len = int(data_len)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The full index order of `epoch` (pure: depends only on seed, shuffle, data_len, epoch)."""
        if not self.shuffle:
            return list(range(self.data_len))
        rng = np.random.default_rng([self.seed, int(epoch)])
        return rng.permutation(self.data_len).tolist()

    def _current_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        return self._order

    @property
    def epoch_len(self) -> int:
        return self.data_len

    def remaining(self) -> int:
        """Indices of the current epoch not handed out yet."""
        return self.data_len - self.position

    def take(self, n: int) -> list[int]:
        """Hand out the next `min(n, remaining())` indices of the current epoch."""
        order = self._current_order()
        out = order[self.position : self.position + n]
        self.position += len(out)
        return out

    def start_next_epoch(self) -> None:
        """Skip what is left of the current epoch and start the next one at position 0."""
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of `epoch`."""
        self.epoch = int(epoch)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        """Yield the rest of the current epoch, then move to the next epoch.

        With a torch DataLoader that prefetches, `state_dict()` runs ahead of what was consumed;
        use RLDataLoader for exact resumption.
        """
        while self.remaining() > 0:
            (idx,) = self.take(1)
            yield idx
        self.start_next_epoch()

    def __len__(self) -> int:
        return self.data_len

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "data_len": self.data_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore (epoch, position); seed, shuffle and data_len must match the saved run."""
        for key in ("seed", "shuffle", "data_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data sampler: checkpoint has {key}={state[key]!r}, this run has "
                    f"{key}={getattr(self, key)!r}. Use the same data files, data.shuffle and data.seed as "
                    "the saved run, or start without resuming."
                )
        position = int(state["position"])
        if not 0 <= position <= self.data_len:
            raise ValueError(f"sampler state position={position} is outside [0, {self.data_len}]")
        self.epoch = int(state["epoch"])
        self.position = position


class RLDataLoader:
    """A small stateful data loader: batches drawn from a ResumableSampler in this process.

    Iterating yields the remaining batches of the sampler's current epoch and then moves the
    sampler to the next epoch (so `for epoch ...: for batch in loader:` walks epochs). The
    move happens as the epoch's last batch is handed out, so a state saved right after it points
    at the start of the next epoch.

    Args:
        dataset: map-style dataset (`__len__`, `__getitem__`).
        batch_size: rows per batch (veRL `data.train_batch_size`).
        sampler: a ResumableSampler over `len(dataset)` rows.
        collate_fn: list of items -> batch.
        drop_last: drop the final partial batch of each epoch.
        num_workers: worker processes that read and collate rows (0: in this process).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        sampler: ResumableSampler,
        collate_fn: Callable[[list[Any]], Any],
        drop_last: bool = True,
        num_workers: int = 0,
    ) -> None:
        if int(num_workers) < 0:
            raise ValueError(f"data.dataloader_num_workers must be >= 0, got {num_workers}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if sampler.data_len != len(dataset):
            raise ValueError(f"sampler covers {sampler.data_len} rows but the dataset has {len(dataset)}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one batch of {batch_size} with "
                "drop_last=True, so an epoch would be empty; lower the batch size (data.train_batch_size) "
                "or add data."
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.sampler = sampler
        self.collate_fn = collate_fn
        self.drop_last = bool(drop_last)
        self.num_workers = int(num_workers)
        self._handed_out: dict[str, Any] | None = None  # sampler state after the last batch handed out

    def __len__(self) -> int:
        """Batches per full epoch."""
        n = self.sampler.epoch_len
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _epoch_has_more(self) -> bool:
        left = self.sampler.remaining()
        return left >= self.batch_size if self.drop_last else left > 0

    def _epoch_indices(self, snapshots: collections.deque | None = None) -> Iterator[list[int]]:
        """The index lists of the rest of the epoch; the sampler moves to the next epoch as the
        last one is drawn. With `snapshots`, the sampler state after each draw is appended."""
        if not self._epoch_has_more():
            self.sampler.start_next_epoch()
        last = False
        while not last:
            indices = self.sampler.take(self.batch_size)
            last = not self._epoch_has_more()
            if last:
                self.sampler.start_next_epoch()
            if snapshots is not None:
                snapshots.append(copy.deepcopy(self.sampler.state_dict()))
            yield indices

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers == 0:
            for indices in self._epoch_indices():
                yield self.collate_fn([self.dataset[i] for i in indices])
            return
        from torch.utils.data import DataLoader

        if self._handed_out is not None:  # batches prefetched by an abandoned iteration are redrawn
            self.sampler.load_state_dict(self._handed_out)
        snapshots: collections.deque = collections.deque()
        loader = DataLoader(
            self.dataset,
            batch_sampler=_Batches(self, snapshots),
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
        )
        for batch in loader:
            self._handed_out = snapshots.popleft()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self._handed_out if self._handed_out is not None else self.sampler.state_dict(),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sampler position; the batch size may differ (indices continue in order)."""
        self.sampler.load_state_dict(state["sampler"])
        self._handed_out = None


class _Batches:
    """A torch batch sampler: one epoch's index lists drawn from an RLDataLoader's sampler."""

    def __init__(self, loader: RLDataLoader, snapshots: collections.deque) -> None:
        self.loader, self.snapshots = loader, snapshots

    def __iter__(self) -> Iterator[list[int]]:
        return self.loader._epoch_indices(self.snapshots)

    def __len__(self) -> int:
        return len(self.loader)
