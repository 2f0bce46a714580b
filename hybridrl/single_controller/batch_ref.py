"""A batch whose token-level tensors stay with the workers: `BatchRef`.

The driver of a PPO step needs the per-sample values it computes with (group ids, scores, group
statistics) and the metrics; it does not need the (B, T) tensors every stage produces. A `BatchRef`
is the driver's view of such a batch:

* `parts`: the tensors, in the Ray object store. A part is what one worker-group call produced:
  its keys, one ObjectRef per producing shard (a `DataProto` put there by the worker that made
  it), and for every row of the batch the shard and the row within the shard that hold it.
* `non_tensor_batch`: per-sample numpy columns held on the driver (uid, data source, scores
  a worker returned as per-sample values), as in `DataProto`.
* `meta_info`: as in `DataProto` (a call's metrics and timings come back here).

Passing a `BatchRef` to a `DP_COMPUTE_PROTO` or mesh-dispatched worker method sends each rank a
`DataProtoFuture` that names only the shards it needs: the rank fetches them from the object
store itself (worker to worker; repartitioned when the producing and the consuming group split
the batch differently, or after `reorder`) and sees an ordinary `DataProto`. The method's
result stays in the object store too: the call returns a `BatchRef` of its new columns, and
`union` adds them to the batch. `pull(keys)` brings named columns to the driver when a stage
really needs them there; `TRANSFER` counts the bytes that did (bench/controller_scale.py
measures both paths).
"""

from __future__ import annotations

import functools
import pickle
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridrl.protocol import DataProto, DataProtoFuture, union_numpy_dict

__all__ = ["TRANSFER", "BatchRef", "BatchShard", "NodeShard", "ShardHandle", "by_ref_output", "column_bytes"]

TRANSFER: Counter = Counter()  # bytes of tensors the driver uploaded ("put") and downloaded ("pulled")


def column_bytes(tensors: dict[str, torch.Tensor], non_tensor: dict[str, np.ndarray]) -> int:
    """Bytes of tensors and numpy columns (object arrays: their pickled size)."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for arr in non_tensor.values():
        total += len(pickle.dumps(arr)) if arr.dtype == object else arr.nbytes
    return total


class BatchShard(DataProtoFuture):
    """One rank's rows of a BatchRef: resolved in the worker; a method given one keeps its result
    in the object store and returns a ShardHandle."""


@dataclass
class ShardHandle:
    """What a worker returns to the driver instead of a DataProto: the object-store reference of
    its tensors plus the small parts (per-sample numpy columns, meta_info) the driver keeps."""

    ref: Any
    keys: tuple[str, ...]
    length: int
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]


@dataclass(frozen=True)
class NodeShard:
    """Shard ``index`` of the list of shard refs that a node's dispatcher put into the object store
    as one object (ray/fanout.py): the driver then holds one reference per node, not per rank;
    a worker that reads the shard resolves the list first."""

    ref: Any
    index: int


def node_shards(handles: list[ShardHandle]) -> list[ShardHandle]:
    """Dispatcher side: the handles of one node's ranks, their refs put into one object."""
    import ray

    node_ref = ray.put([h.ref for h in handles])
    return [
        ShardHandle(NodeShard(node_ref, i), h.keys, h.length, h.non_tensor_batch, h.meta_info)
        for i, h in enumerate(handles)
    ]


def _leaves(entries: list[Any]) -> list[Any]:
    """Shard refs with every NodeShard replaced by the shard ref it names (one ray.get of the
    nodes' lists)."""
    nested = {e.ref.hex(): e.ref for e in entries if isinstance(e, NodeShard)}
    if not nested:
        return entries
    import ray

    lists = dict(zip(nested, ray.get(list(nested.values()))))
    return [lists[e.ref.hex()][e.index] if isinstance(e, NodeShard) else e for e in entries]


def by_ref_output(out: Any) -> Any:
    """Worker side: put a method's DataProto result into the object store, return its handle."""
    if not isinstance(out, DataProto):
        return out
    import ray

    tensors = DataProto(batch=out.batch) if out.batch is not None else DataProto()
    keys = tuple(out.batch.keys()) if out.batch is not None else ()
    return ShardHandle(ray.put(tensors), keys, len(out), dict(out.non_tensor_batch), dict(out.meta_info))


@dataclass
class _Part:
    """Columns `keys` of the batch: shard `loc[i, 0]` holds row i at position `loc[i, 1]`."""

    keys: tuple[str, ...]
    refs: list[Any]
    loc: np.ndarray  # (B, 2) int64

    def take(self, rows: np.ndarray, keys: Sequence[str] | None = None) -> _Part:
        return _Part(tuple(self.keys if keys is None else keys), self.refs, self.loc[rows])


class BatchRef:
    """The driver's handle on a batch whose tensors are in the object store (see the module doc).

    Args:
        parts: the tensor columns (normally built by worker-group calls, not by hand).
        length: number of rows B.
        non_tensor_batch: per-sample numpy columns (length B each) held on the driver.
        meta_info: as DataProto.meta_info.
    """

    def __init__(
        self,
        parts: list[_Part],
        length: int,
        non_tensor_batch: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> None:
        self.parts = [p for p in parts if p.keys]
        self.length = int(length)
        self.non_tensor_batch = dict(non_tensor_batch or {})
        self.meta_info = dict(meta_info or {})
        seen: dict[str, int] = {}
        for p in self.parts:
            for k in p.keys:
                if k in seen:
                    raise ValueError(f"BatchRef: column {k!r} is held twice; pop it before adding it again")
                seen[k] = 1
            if len(p.loc) != self.length:
                raise ValueError(f"BatchRef: a part has {len(p.loc)} rows, the batch {self.length}")
        for k, v in self.non_tensor_batch.items():
            if len(v) != self.length:
                raise ValueError(
                    f"BatchRef: non_tensor_batch[{k!r}] has {len(v)} rows, the batch {self.length}"
                )

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def from_proto(cls, data: DataProto) -> BatchRef:
        """Put `data`'s tensors into the object store once (one shard); numpy columns stay here."""
        import ray

        n = len(data)
        parts = []
        if data.batch is not None and len(data.batch.keys()):
            TRANSFER["put"] += column_bytes(dict(data.batch.items()), {})
            ref = ray.put(DataProto(batch=data.batch))
            loc = np.stack([np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64)], axis=1)
            parts.append(_Part(tuple(data.batch.keys()), [ref], loc))
        return cls(parts, n, dict(data.non_tensor_batch), dict(data.meta_info))

    @classmethod
    def from_handles(cls, handles: Sequence[Any], pad_size: int) -> BatchRef:
        """The result of a call: per-chunk handles in row order, the last `pad_size` rows padding."""
        bad = [i for i, h in enumerate(handles) if not isinstance(h, ShardHandle)]
        if bad:
            raise TypeError(
                f"a call given a BatchRef got {type(handles[bad[0]]).__name__} from chunk {bad[0]}, not a DataProto; "
                "only methods that return a DataProto can take a BatchRef"
            )
        sizes = [h.length for h in handles]
        total = sum(sizes)
        n = total - pad_size
        shard = np.repeat(np.arange(len(handles), dtype=np.int64), sizes)
        local = (
            np.concatenate([np.arange(s, dtype=np.int64) for s in sizes]) if total else np.zeros(0, np.int64)
        )
        loc = np.stack([shard, local], axis=1)[:n]
        meta = DataProto.concat(
            [DataProto(non_tensor_batch=h.non_tensor_batch, meta_info=h.meta_info) for h in handles]
        )
        non_tensor = {k: v[:n] for k, v in meta.non_tensor_batch.items()}
        keys = handles[0].keys if handles else ()
        return cls([_Part(keys, [h.ref for h in handles], loc)], n, non_tensor, meta.meta_info)

    # ---- DataProto-like view ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.length

    def keys(self) -> list[str]:
        """The tensor column names (they live in the object store)."""
        return [k for p in self.parts for k in p.keys]

    def __repr__(self) -> str:
        return f"BatchRef(len={self.length}, keys={self.keys()}, non_tensor={list(self.non_tensor_batch)})"

    def union(self, other: BatchRef) -> BatchRef:
        """Add `other`'s columns, per-sample columns and meta_info (in place); returns self."""
        if not isinstance(other, BatchRef):
            raise TypeError(f"BatchRef.union takes a BatchRef, got {type(other).__name__}")
        if len(other) != len(self):
            raise ValueError(
                f"union: lengths differ ({len(self)} vs {len(other)}); both must describe the same rows"
            )
        clash = set(self.keys()) & set(other.keys())
        if clash:
            raise ValueError(f"union: columns {sorted(clash)} are in both batches; pop them from one first")
        self.parts = self.parts + other.parts
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        for key, value in other.meta_info.items():
            self.meta_info.setdefault(key, value)
        return self

    def select(self, batch_keys: Sequence[str]) -> BatchRef:
        """A BatchRef of only these tensor columns (per-sample columns and meta_info kept)."""
        missing = set(batch_keys) - set(self.keys())
        if missing:
            raise KeyError(f"select: no columns {sorted(missing)}; the batch has {self.keys()}")
        parts = [p.take(slice(None), [k for k in p.keys if k in batch_keys]) for p in self.parts]
        return BatchRef(parts, self.length, self.non_tensor_batch, self.meta_info)

    def pop(self, batch_keys: Sequence[str]) -> BatchRef:
        """Remove these tensor columns from self and return them as a BatchRef."""
        out = self.select(batch_keys)
        self.parts = [p.take(slice(None), [k for k in p.keys if k not in batch_keys]) for p in self.parts]
        self.parts = [p for p in self.parts if p.keys]
        return BatchRef(out.parts, self.length, {}, {})

    def select_idxs(self, idxs: Any) -> BatchRef:
        """Rows by index (int array / list / tensor); nothing moves until a worker reads them."""
        rows = np.asarray(idxs.cpu().numpy() if torch.is_tensor(idxs) else idxs, dtype=np.int64)
        parts = [p.take(rows) for p in self.parts]
        non_tensor = {k: v[rows] for k, v in self.non_tensor_batch.items()}
        return BatchRef(parts, len(rows), non_tensor, self.meta_info)

    def reorder(self, indices: Any) -> None:
        """In place: row i becomes row indices[i] (as DataProto.reorder)."""
        new = self.select_idxs(indices)
        self.parts, self.non_tensor_batch = new.parts, new.non_tensor_batch

    # ---- moving data --------------------------------------------------------------------------
    def shard(self, chunks: int, pad: bool) -> tuple[list[BatchShard], int]:
        """`chunks` futures, each resolving (in the worker that gets it) to its rows as a DataProto.

        Rows are padded by repeating the first ones, as `pad_dataproto_to_divisor` does. With more
        than one chunk the batch's description (its parts' references and row locations, the
        per-sample columns) goes into the object store once and every future names only it and
        its chunk index: the driver's work and message per rank stay constant, whatever the batch;
        each rank works out its rows and fetches its shards itself.
        Returns (futures, pad_size).
        """
        n = self.length
        pad_size = (chunks - n % chunks) % chunks if pad else 0
        if n % chunks and not pad:
            raise ValueError(
                f"batch of {n} rows is not divisible by {chunks} ranks and this mode does not pad"
            )
        if chunks == 1:
            return [self._future(np.arange(n))], pad_size
        import ray

        view = ray.put(self)
        return [
            BatchShard(
                collect_fn=functools.partial(_rows_of_view, index=i, chunks=chunks, total=n + pad_size),
                futures=[view],
            )
            for i in range(chunks)
        ], pad_size

    def rows_of_chunk(self, index: int, chunks: int, total: int) -> np.ndarray:
        """Row indices of chunk `index` of `chunks` over `total` rows (rows past the end repeat the first)."""
        size = total // chunks
        return np.arange(index * size, (index + 1) * size) % max(self.length, 1)

    def _future(self, rows: np.ndarray) -> BatchShard:
        refs: list[Any] = []
        index: dict[int, int] = {}
        plan = []
        for p in self.parts:
            loc = p.loc[rows]
            pieces = []
            for s in np.unique(loc[:, 0]):
                at = np.nonzero(loc[:, 0] == s)[0]
                key = id(p.refs[s])
                if key not in index:
                    index[key] = len(refs)
                    refs.append(p.refs[s])
                pieces.append((index[key], loc[at, 1], at))
            plan.append((p.keys, pieces))
        refs = _leaves(refs)
        non_tensor = {k: v[rows] for k, v in self.non_tensor_batch.items()}
        assemble = functools.partial(
            _assemble, plan=plan, length=len(rows), non_tensor=non_tensor, meta_info=self.meta_info
        )
        return BatchShard(collect_fn=assemble, futures=refs)

    def pull(self, batch_keys: Sequence[str] | None = None) -> DataProto:
        """The whole batch (or these tensor columns) as a DataProto on the driver; counted in TRANSFER."""
        view = self if batch_keys is None else self.select(batch_keys)
        (future,), _ = view.shard(1, pad=False)
        out = future.get()
        TRANSFER["pulled"] += column_bytes(dict(out.batch.items()) if out.batch is not None else {}, {})
        TRANSFER["pulls"] += 1
        return out


def _rows_of_view(views: list[BatchRef], index: int, chunks: int, total: int) -> DataProto:
    """Worker side: this chunk's rows of the batch described by `views[0]`, fetched from the store."""
    view = views[0]
    return view._future(view.rows_of_chunk(index, chunks, total)).get()


def _assemble(
    protos: list[DataProto], plan: list, length: int, non_tensor: dict, meta_info: dict
) -> DataProto:
    """Worker side: gather each part's rows from the fetched shards into one DataProto."""
    tensors: dict[str, torch.Tensor] = {}
    for keys, pieces in plan:
        if len(pieces) == 1 and _is_whole(protos[pieces[0][0]], pieces[0][1], pieces[0][2], length):
            src = protos[pieces[0][0]].batch
            tensors.update({k: src[k] for k in keys})
            continue
        order = np.concatenate([at for _, _, at in pieces])
        inverse = torch.from_numpy(np.argsort(order, kind="stable"))
        for k in keys:
            cols = [protos[i].batch[k][torch.from_numpy(local)] for i, local, _ in pieces]
            tensors[k] = torch.cat(cols)[inverse]
    return DataProto(
        batch=TensorDict(tensors, batch_size=[length]),
        non_tensor_batch=dict(non_tensor),
        meta_info=dict(meta_info),
    )


def _is_whole(proto: DataProto, local: np.ndarray, at: np.ndarray, length: int) -> bool:
    """The piece is the entire shard, in order: use its tensors as they are (no copy)."""
    return (
        len(proto) == length
        and np.array_equal(local, np.arange(length))
        and np.array_equal(at, np.arange(length))
    )
