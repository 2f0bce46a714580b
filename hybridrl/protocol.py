"""DataProto: the batch that flows between the Ray driver and the workers.

A `DataProto` holds three things about B rows (samples):

* `batch`: a `tensordict.TensorDict` whose tensors all share dim 0 (size B), or None;
* `non_tensor_batch`: a dict of 1-D-or-more numpy arrays with `dtype=object` and length B
  (raw prompts, ground truths, uids, ...);
* `meta_info`: a plain dict that is not split or concatenated row-wise (metrics, flags).

Names and semantics follow veRL's DataProto, so code written against it ports directly.
Row operations (`select_idxs`, `slice`, `chunk`, `split`, `concat`, `repeat`, `reorder`) act on
`batch` and `non_tensor_batch` together and keep every non-tensor array a numpy object array.

`DataProtoFuture` wraps Ray object references to DataProtos so that one worker group's output
can feed the next group (chunked per rank) without being materialised on the driver. Ray is
imported lazily: `import hybridrl.protocol` does not import ray.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from hybridrl.utils.batch_ops import (
    as_index,
    merge_metrics,
    pick_keys,
    to_object_array,
    union_numpy_dict,
    union_tensor_dict,
    values_equal,
)
from hybridrl.utils.dataproto_io import load_dataproto, save_dataproto
from hybridrl.utils.tensordict_io import pack_tensordict, unpack_tensordict

__all__ = [
    "DataProto",
    "DataProtoFuture",
    "DataProtoItem",
    "collate_fn",
    "pad_dataproto_to_divisor",
    "union_tensor_dict",
    "unpad_dataproto",
]

_ITERATOR_KWARGS = ("shuffle", "drop_last")


# ----------------------------------------------------------------------------------------------
# DataProtoItem / DataProto
# ----------------------------------------------------------------------------------------------
@dataclass
class DataProtoItem:
    """One row of a DataProto: `batch` has batch_size [], non-tensor values are the raw entries."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of B rows: TensorDict `batch`, numpy-object `non_tensor_batch`, dict `meta_info`."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: to_object_array(v, k) for k, v in self.non_tensor_batch.items()}
        self.check_consistency()

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from tensors (shared dim 0), per-row non-tensor data and meta_info.

        Args:
            tensors: name -> tensor of shape (B, ...). Empty or None gives `batch=None`.
            non_tensors: name -> numpy array or list of length B (converted to dtype=object).
            meta_info: free-form dict carried along unchanged.
        """
        tensors = tensors or {}
        batch = None
        if tensors:
            sizes = {}
            for key, t in tensors.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(
                        f"tensors[{key!r}] is a {type(t).__name__}; pass it in non_tensors or convert it "
                        "with torch.as_tensor."
                    )
                if t.dim() == 0:
                    raise ValueError(f"tensors[{key!r}] is a 0-d tensor; put per-batch scalars in meta_info.")
                sizes[key] = t.shape[0]
            if len(set(sizes.values())) != 1:
                raise ValueError(f"all tensors must share dim 0 (the batch size); got {sizes}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from one dict: tensors go to `batch`, everything else to `non_tensor_batch`."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    # ---- basic protocol ---------------------------------------------------------------------
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return int(next(iter(self.non_tensor_batch.values())).shape[0])
        return 0

    def __getitem__(self, item: Any) -> DataProtoItem | DataProto:
        """int -> DataProtoItem; slice -> DataProto; list / np array / tensor / mask -> DataProto."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (bool, np.bool_)):
            raise TypeError("cannot index a DataProto with a bool; use a boolean mask of length len(data)")
        if isinstance(item, (int, np.integer)) or (isinstance(item, torch.Tensor) and item.dim() == 0):
            i = int(item)
            n = len(self)
            if not -n <= i < n:
                raise IndexError(f"row {i} out of range for a DataProto of {n} rows")
            i %= n
            return DataProtoItem(
                batch=None if self.batch is None else self.batch[i],
                non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"unsupported index type {type(item).__name__} for DataProto")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        keys = [] if self.batch is None else list(self.batch.keys())
        return (
            f"DataProto(len={len(self)}, batch_keys={keys}, "
            f"non_tensor_keys={list(self.non_tensor_batch)}, meta_info_keys={list(self.meta_info)})"
        )

    def check_consistency(self) -> None:
        """Raise ValueError unless batch and non_tensor_batch describe the same number of rows."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDictBase):
                raise TypeError(f"batch must be a tensordict.TensorDict, got {type(self.batch).__name__}")
            if self.batch.batch_dims != 1:
                raise ValueError(
                    f"batch must have exactly one batch dim, got batch_size {tuple(self.batch.batch_size)}"
                )
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        n = None if self.batch is None else int(self.batch.batch_size[0])
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray) or value.dtype != object:
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array with dtype=object")
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is 0-d; per-batch values belong in meta_info")
            if n is None:
                n = value.shape[0]
            elif value.shape[0] != n:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has {value.shape[0]} rows but the batch has {n}; every "
                    "entry must have one value per row."
                )

    def _has_rows(self) -> bool:
        return self.batch is not None or bool(self.non_tensor_batch)

    def _new(self, batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    # ---- key selection ----------------------------------------------------------------------
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Return a DataProto with only the given keys (None keeps all keys of that part).

        Tensors are shared with `self`; `deepcopy=True` deep-copies non-tensor data and meta_info.
        """
        batch = None
        if self.batch is not None:
            batch = self.batch.select(*batch_keys) if batch_keys is not None else self.batch.copy()
        elif batch_keys:
            raise KeyError(f"select: batch is None, cannot select batch keys {list(batch_keys)}")
        non_tensor = pick_keys(self.non_tensor_batch, non_tensor_batch_keys, "select", "non_tensor_batch")
        meta = pick_keys(self.meta_info, meta_info_keys, "select", "meta_info")
        if deepcopy:
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        if batch is None and not non_tensor and len(self):
            batch = TensorDict({}, batch_size=[len(self)])  # keep the row count
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from `self` and return them as a new DataProto."""
        batch_keys, non_tensor_batch_keys = list(batch_keys or []), list(non_tensor_batch_keys or [])
        meta_info_keys = list(meta_info_keys or [])
        pick_keys({} if self.batch is None else dict(self.batch.items()), batch_keys, "pop", "batch")
        pick_keys(self.non_tensor_batch, non_tensor_batch_keys, "pop", "non_tensor_batch")
        pick_keys(self.meta_info, meta_info_keys, "pop", "meta_info")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        batch = TensorDict(tensors, batch_size=[len(self)]) if self.batch is not None else None
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename batch (or non_tensor_batch) keys in place and return self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys but {len(new)} new keys")
        for o, n in zip(old, new):
            if self.batch is not None and o in self.batch.keys():
                self.batch.rename_key_(o, n)
            elif o in self.non_tensor_batch:
                self.non_tensor_batch[n] = self.non_tensor_batch.pop(o)
            else:
                raise KeyError(f"rename: no batch or non_tensor_batch key {o!r}")
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge `other` into `self` (in place) and return self.

        Raises:
            ValueError: on different lengths or an overlapping key with different values (named).
        """
        if self._has_rows() and other._has_rows() and len(self) != len(other):
            raise ValueError(
                f"union: lengths differ ({len(self)} vs {len(other)}); both must describe the same rows"
            )
        if other.batch is not None:
            self.batch = (
                other.batch.copy() if self.batch is None else union_tensor_dict(self.batch, other.batch)
            )
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        for key, value in other.meta_info.items():
            if key in self.meta_info and not values_equal(self.meta_info[key], value):
                raise ValueError(
                    f"union: meta_info key {key!r} differs ({self.meta_info[key]!r} vs {value!r})"
                )
            self.meta_info.setdefault(key, value)
        self.check_consistency()
        return self

    # ---- row operations ---------------------------------------------------------------------
    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows by index: int list, numpy array, torch tensor, or a boolean mask of length B."""
        idx_t, idx_np = as_index(idxs, len(self))
        batch = None if self.batch is None else self.batch[idx_t]
        non_tensor = {k: v[idx_np] for k, v in self.non_tensor_batch.items()}
        return self._new(batch, non_tensor)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows `start:end:step` as a DataProto (views, no copy)."""
        s = slice(start, end, step)
        if step is not None and step < 0:  # TensorDict slicing needs a positive step
            return self.select_idxs(np.arange(len(self))[s])
        batch = None if self.batch is None else self.batch[s]
        return self._new(batch, {k: v[s] for k, v in self.non_tensor_batch.items()})

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` equal pieces; the length must be divisible by `chunks`."""
        if chunks <= 0:
            raise ValueError(f"chunk: chunks must be positive, got {chunks}")
        n = len(self)
        if n % chunks:
            raise ValueError(
                f"chunk: batch size {n} is not divisible by chunks={chunks}. Pad first with "
                f"pad_dataproto_to_divisor(data, {chunks}) and drop the pad with unpad_dataproto, "
                "or choose a batch size that is a multiple of the number of ranks."
            )
        size = n // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Pieces of `split_size` rows; the last piece may be smaller."""
        if split_size <= 0:
            raise ValueError(f"split: split_size must be positive, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate row-wise. meta_info comes from the first piece (keys missing there from the
        later ones), except `metrics`: the metric dicts of all pieces merge into a dict of lists."""
        if not data:
            raise ValueError("concat: got an empty list of DataProto")
        with_batch = [d.batch is not None for d in data]
        if any(with_batch) and not all(with_batch):
            raise ValueError("concat: some pieces have a tensor batch and some have batch=None")
        batch = torch.cat([d.batch for d in data], dim=0) if all(with_batch) else None
        keys = list(data[0].non_tensor_batch)
        for d in data[1:]:
            if set(d.non_tensor_batch) != set(keys):
                raise ValueError(
                    f"concat: non_tensor_batch keys differ: {sorted(keys)} vs {sorted(d.non_tensor_batch)}"
                )
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0) for k in keys}
        meta: dict[str, Any] = {}
        for d in data:
            for k, v in d.meta_info.items():
                if k != "metrics":
                    meta.setdefault(k, v)
        metrics = [d.meta_info["metrics"] for d in data if "metrics" in d.meta_info]
        if metrics:
            meta["metrics"] = merge_metrics(metrics)
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row. interleave=True: a a b b; interleave=False: a b a b."""
        if repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        if interleave:
            index = np.repeat(np.arange(n), repeat_times)
        else:
            index = np.tile(np.arange(n), repeat_times)
        return self.select_idxs(index)

    def reorder(self, indices: Any) -> None:
        """Permute rows in place: row i becomes old row indices[i]."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Yield mini-batches over `epochs` passes.

        `dataloader_kwargs` accepts `shuffle` (default False) and `drop_last` (default False). With
        shuffle and a seed the order is deterministic: one generator seeded once draws a fresh
        permutation per epoch. Without drop_last the last mini-batch of an epoch may be smaller.
        """
        kwargs = dict(dataloader_kwargs or {})
        unknown = set(kwargs) - set(_ITERATOR_KWARGS)
        if unknown:
            raise ValueError(
                f"make_iterator: unsupported dataloader_kwargs {sorted(unknown)}; use {_ITERATOR_KWARGS}"
            )
        if mini_batch_size <= 0 or epochs < 0:
            raise ValueError(
                f"make_iterator: need mini_batch_size > 0 and epochs >= 0, got {mini_batch_size}, {epochs}"
            )
        shuffle, drop_last = bool(kwargs.get("shuffle", False)), bool(kwargs.get("drop_last", False))
        generator = None
        if shuffle and seed is not None:
            generator = torch.Generator().manual_seed(seed)
        return self._iterate(mini_batch_size, epochs, shuffle, drop_last, generator)

    def _iterate(
        self, mbs: int, epochs: int, shuffle: bool, drop_last: bool, generator: torch.Generator | None
    ) -> Iterator[DataProto]:
        n = len(self)
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
            for start in range(0, n, mbs):
                if drop_last and start + mbs > n:
                    break
                yield self.select_idxs(order[start : start + mbs])

    # ---- devices, size, persistence ---------------------------------------------------------
    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensor batch to `device` and return self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def get_size_bytes(self) -> tuple[int, int]:
        """(bytes held by tensors, approximate bytes held by non-tensor arrays' pickles)."""
        tensor_bytes = 0
        if self.batch is not None:
            for _, t in self.batch.items(include_nested=True, leaves_only=True):
                tensor_bytes += t.numel() * t.element_size()
        non_tensor_bytes = sum(
            len(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)) for v in self.non_tensor_batch.values()
        )
        return tensor_bytes, non_tensor_bytes

    def print_size(self, prefix: str = "") -> str:
        """Print and return a one-line size summary."""
        tb, nb = self.get_size_bytes()
        msg = f"{prefix}DataProto of {len(self)} rows: tensors {tb / 2**20:.3f} MiB, non-tensors {nb / 2**20:.3f} MiB"
        print(msg)
        return msg

    def save_to_disk(self, filepath: str) -> None:
        """Write to `filepath` in a format that cannot run code when read (utils.dataproto_io)."""
        save_dataproto(filepath, self.batch, self.non_tensor_batch, self.meta_info)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """Read a file written by `save_to_disk`; nothing is unpickled (DataProtoFileError otherwise)."""
        batch, non_tensor, meta = load_dataproto(filepath)
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    # ---- pickling: tensors travel as one byte buffer each ------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "batch": None if self.batch is None else pack_tensordict(self.batch),
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = None if state["batch"] is None else unpack_tensordict(state["batch"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


# ----------------------------------------------------------------------------------------------
# padding and collation
# ----------------------------------------------------------------------------------------------
def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad `data` so its length is a multiple of `size_divisor`.

    Padding repeats rows from the start (cycling when the pad is longer than the data).

    Returns:
        (padded data, pad_size). pad_size is 0 when no padding was needed (data returned as is).
    """
    if size_divisor <= 0:
        raise ValueError(f"size_divisor must be positive, got {size_divisor}")
    n = len(data)
    pad_size = (size_divisor - n % size_divisor) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise ValueError("cannot pad an empty DataProto: there are no rows to repeat")
    padding = data.select_idxs(np.arange(pad_size) % n)
    return DataProto.concat([data, padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by pad_dataproto_to_divisor."""
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size {pad_size} out of range for a DataProto of {len(data)} rows")
    return data.slice(0, len(data) - pad_size) if pad_size else data


def collate_fn(items: Sequence[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems (e.g. from a torch DataLoader) into a DataProto; meta_info from the first."""
    if not items:
        raise ValueError("collate_fn: got no items")
    batch = None
    if items[0].batch is not None:
        batch = torch.stack([it.batch for it in items]).contiguous()
    keys = list(items[0].non_tensor_batch)
    non_tensor = {k: to_object_array([it.non_tensor_batch[k] for it in items], k) for k in keys}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(items[0].meta_info))


# ----------------------------------------------------------------------------------------------
# DataProtoFuture
# ----------------------------------------------------------------------------------------------
def _take_chunk(data: DataProto, index: int, chunks: int) -> DataProto:
    return data.chunk(chunks)[index]


@dataclass
class DataProtoFuture:
    """DataProtos that are still Ray object references.

    `get()` runs `ray.get` on `futures`, combines them with `collect_fn` (default concat) and, if
    set, applies `dispatch_fn` (e.g. take chunk i of n). Passing a future to a worker lets the
    worker resolve only its own piece, so the data never goes through the driver.

    `timeout_s` is the `trainer.step_timeout_s` of the driver that made the future (None: the
    waiting process's own); `waiter` names the worker method that resolves it inside a worker
    (set there, see `single_controller.base`), which then waits `deadlines.nested_timeout` of it.
    """

    collect_fn: Callable[[list[DataProto]], DataProto]
    futures: list[Any]
    dispatch_fn: Callable[[DataProto], DataProto] | None = None
    timeout_s: float | None = None
    waiter: str = ""

    @staticmethod
    def concat(data: list[Any]) -> DataProtoFuture:
        """A future that resolves to the row-wise concat of the DataProtos behind `data` (ObjectRefs)."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(data))

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures of this one's class and settings; future i resolves to chunk i of this
        future's result."""
        if self.dispatch_fn is not None:
            raise ValueError("chunk: this future is already a chunk; chunk the parent future instead")
        return [
            dataclasses.replace(self, dispatch_fn=functools.partial(_take_chunk, index=i, chunks=chunks))
            for i in range(chunks)
        ]

    def wait_limit(self) -> float:
        """Seconds `get()` may wait without progress (see the class docstring)."""
        from hybridrl.utils import deadlines

        return (
            deadlines.nested_timeout(self.timeout_s)
            if self.waiter
            else (self.timeout_s or deadlines.step_timeout())
        )

    def get(self) -> DataProto:
        from hybridrl.utils import deadlines

        what = f"{self.waiter or 'the driver'}: DataProtoFuture.get"
        output = self.collect_fn(
            deadlines.get_refs(list(self.futures), what=what, timeout_s=self.wait_limit())
        )
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output
