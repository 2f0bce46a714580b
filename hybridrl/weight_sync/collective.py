"""Collective weight updates: trainer rank 0 broadcasts the weights to every rollout worker over a
process group of their own (`async_training.weight_update_mode=collective`; AReaL's
`weight_update_mode=xccl`, veRL's `checkpoint_engine.backend=nccl`).

The group spans trainer rank 0 (group rank 0) and every rollout worker (group ranks 1..N), each a
separate Ray actor. It is created *stateless*: a TCPStore hosted by trainer rank 0 and a
ProcessGroupGloo (CPU) or ProcessGroupNCCL (GPU) built on it directly, never registered as a
torch.distributed group, so the default group the training ranks use for FSDP is untouched and
the rollout workers (which have no default group) need none.

One update (`WeightGroup.send` / `WeightGroup.receive`)::

    trainer rank 0: the gathered (hf_name, tensor) stream -> buckets of
        rollout.update_weights_bucket_megabytes -> per bucket: its tensor table (names, dtypes,
        shapes, byte offsets) into the store, then one broadcast of the packed bytes; then an
        end marker
    rollout worker: a receiver thread waits for the next update's first table, receives every
        bucket into a fresh buffer and stages the tensors (views of it) under their version;
        `load_weights(collective payload, v)` (queued by the manager after the current chunk,
        as on the object-store path) takes version v and streams it into the engine

The receiver runs in a thread of its own, so an update is received while the worker is still
generating its chunk; the engine only changes between two generate calls, as before. A worker
whose load of v comes late keeps v (and any newer version) staged meanwhile; older ones are
dropped.

Tensor-parallel engines: every TP rank is a rollout worker and a group member (rollout worker w is
group rank 1 + w and TP rank w % TP). For the model families tp_shards.py knows, trainer rank 0
sends each TP rank only the slice its vLLM loaders keep: per TP rank its own buckets and tables
(keys `{update}/{tp rank}/{bucket}`), each bucket sent point to point to the workers of that TP
rank; the receiver hands vLLM a full-shape tensor holding its slice (`tp_shards.unshard`). Any
other model (or `tp_shards=False`) takes the full broadcast and the engines' loaders slice, as in
the colocated sync. Each update starts with a header `{update}/head` that says which.

Metadata: the tables, heads and end markers in the store are JSON of a fixed shape (wire.py),
checked field by field on every read. The store listens on the node's address; a value that is
not such metadata is refused with an error that names the store, never executed.

Deadlines: the group's creation (store connection and the backend's rendezvous) and every
broadcast end after `async_training.weight_update_timeout_s`, with an error naming that key and
the fallback (`weight_update_mode=object_store`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.weight_sync import wire
from hybridrl.weight_sync.buckets import BufferPool, iter_buckets, pack_bucket, tensor_nbytes, unpack_bucket
from hybridrl.weight_sync.tp_shards import Shard, TPLayout, shard_of, unshard

__all__ = [
    "MODES",
    "MODE_KEY",
    "TIMEOUT_KEY",
    "GroupSpec",
    "WeightGroup",
    "WeightReceiver",
    "Received",
    "collective_payload",
    "is_collective_payload",
    "materialize",
    "open_store",
]

MODE_KEY = "async_training.weight_update_mode"
TIMEOUT_KEY = "async_training.weight_update_timeout_s"
MODES = ("object_store", "collective")
_POLL_S = 0.5  # how often a waiting receiver checks whether it should stop
_FALLBACK = f"or set {MODE_KEY}=object_store (weights through the Ray object store)"


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the weight-update group meets.

    Attributes:
        host, port: the TCPStore hosted by trainer rank 0.
        world_size: 1 + the number of rollout workers.
        backend: "gloo" (CPU tensors) or "nccl" (GPU tensors).
        timeout_s: deadline of the group's creation and of every broadcast (TIMEOUT_KEY).
    """

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


def collective_payload(version: int) -> dict[str, Any]:
    """The `load_weights` payload of the collective path: the weights are staged on the worker."""
    return {"collective": True, "version": int(version)}


def is_collective_payload(payload: Any) -> bool:
    return isinstance(payload, dict) and bool(payload.get("collective"))


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (a plain process): the loopback address
        return "127.0.0.1"


def open_store(world_size: int, timeout_s: float) -> tuple[Any, str, int]:
    """Host the group's TCPStore here (trainer rank 0) on a free port: (store, host, port)."""
    host = _node_ip()
    store = dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, host, store.port


@dataclass
class Received:
    """One update as a receiver got it.

    Attributes:
        version: the policy version.
        named: (name, tensor, place): the tensor views a staging buffer; place is None for a full
            tensor, else (full shape, dim, start) of a TP slice (`materialize` gives vLLM's input).
        buffers: the staging buffers the tensors view.
        nbytes: bytes received.
    """

    version: int
    named: list[tuple[str, torch.Tensor, tuple | None]]
    buffers: list[torch.Tensor]
    nbytes: int


def materialize(
    named: list[tuple[str, torch.Tensor, tuple | None]],
    pool: BufferPool | None = None,
    loaned: list[torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) stream the engine loads: a TP slice becomes a full-shape tensor holding
    it (tp_shards.unshard), built lazily, one at a time; its memory comes from `pool` (mapped
    pages of an earlier update, not fresh ones) and is appended to `loaned` for the caller to
    give back once the engine has copied it."""
    for name, t, place in named:
        if place is None:
            yield name, t
            continue
        full, dim, start = place
        out = None
        if pool is not None:
            numel = 1
            for d in full:
                numel *= d
            buf = pool.get(numel * t.element_size(), t.device)
            if loaned is not None:
                loaned.append(buf)
            out = buf.view(t.dtype).view(full)
        yield name, unshard(t, full, Shard(dim, start, t.shape[dim]), out=out)


# ---------------------------------------------------------------------------------------- group
def _backend(spec: GroupSpec, store: Any, rank: int) -> Any:
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    if spec.backend == "nccl":  # GPU path: written against torch's API, untested here
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, spec.world_size, opts)
    raise ValueError(f"weight-update group backend {spec.backend!r}: use gloo or nccl")


class WeightGroup:
    """This process's member of the weight-update group (rank 0: the sender).

    Args:
        spec: the group's GroupSpec.
        rank: this member's group rank (0 = trainer rank 0).
        store: rank 0's own TCPStore (from `open_store`); None: connect to spec.host:spec.port.
        who: how error messages name this member ("rollout worker 1").
        tp_rank, tp_size: a receiver's place in its rollout engine (rollout worker w: w % TP, TP).

    Raises:
        RuntimeError: the store or the group could not be reached within spec.timeout_s.
    """

    def __init__(
        self, spec: GroupSpec, rank: int, store: Any = None, who: str = "", tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.spec, self.rank, self.who = spec, rank, who or f"group rank {rank}"
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.timeout = timedelta(seconds=spec.timeout_s)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if spec.backend == "nccl"
            else torch.device("cpu")
        )
        t0 = time.perf_counter()
        try:
            if store is None:
                store = dist.TCPStore(
                    spec.host, spec.port, spec.world_size, is_master=False, timeout=self.timeout
                )
            self.meta = dist.PrefixStore("meta/", store)
            self.pg = _backend(spec, dist.PrefixStore("pg/", store), rank)
        except (RuntimeError, OSError) as err:
            raise RuntimeError(
                f"{MODE_KEY}=collective: {self.who} could not join the weight-update group at "
                f"{spec.host}:{spec.port} within {spec.timeout_s:g} s ({TIMEOUT_KEY}): "
                f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}. Every rollout "
                f"worker must reach trainer rank 0 over TCP; raise {TIMEOUT_KEY}, {_FALLBACK}"
            ) from None
        self.join_s = time.perf_counter() - t0
        self._seq = 0  # updates sent / received so far
        self._pool = BufferPool()  # the sender's packing buffers

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        except RuntimeError as err:
            raise RuntimeError(
                f"{MODE_KEY}=collective: {self.who}: the transfer of {what} failed or did not finish within "
                f"{self.spec.timeout_s:g} s ({TIMEOUT_KEY}); a member of the group died or hangs "
                f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}). "
                f"Raise {TIMEOUT_KEY}, {_FALLBACK}"
            ) from None

    def _broadcast(self, buf: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        self._wait(self.pg.broadcast([buf], opts), what)

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        bucket_bytes: int,
        layout: TPLayout | None = None,
    ) -> dict[str, float]:
        """Rank 0: send one update; returns bytes (all the buckets packed), rank_bytes (what one
        receiver gets, the most over TP ranks), buckets and seconds.

        layout None: broadcast the full tensors to every member. A TPLayout: each TP rank gets its
        slices (tp_shards.shard_of) in buckets of its own, sent to the workers of that TP rank.
        """
        if self.rank != 0:
            raise RuntimeError("WeightGroup.send runs on group rank 0 (trainer rank 0) only")
        seq, self._seq = self._seq, self._seq + 1
        t0 = time.perf_counter()
        tp = 1 if layout is None else layout.tp
        self.meta.set(f"{seq}/head", wire.encode_head(version, tp, layout is not None))
        if layout is None:
            nbytes, buckets = self._send_full(named, seq, version, bucket_bytes)
            rank_bytes = nbytes
        else:
            per_rank, buckets = self._send_sharded(named, seq, version, bucket_bytes, layout)
            nbytes, rank_bytes = sum(per_rank), max(per_rank)
        return {
            "bytes": float(nbytes),
            "rank_bytes": float(rank_bytes),
            "buckets": float(buckets),
            "send_s": time.perf_counter() - t0,
        }

    def _send_full(
        self, named: Iterable[tuple[str, torch.Tensor]], seq: int, version: int, bucket_bytes: int
    ) -> tuple[int, int]:
        """Broadcast the stream bucket by bucket to every member: (bytes, buckets)."""
        nbytes, i = 0, 0
        for bucket in iter_buckets(named, bucket_bytes):
            buf, table = pack_bucket([(n, t.to(self.device)) for n, t in bucket], self.device, self._pool)
            bucket.clear()
            self.meta.set(f"{seq}/{i}", wire.encode_bucket(table, buf.numel()))
            self._broadcast(buf, f"bucket {i} of version {version} ({buf.numel() / 2**20:.1f} MiB)")
            nbytes += buf.numel()
            self._pool.put(buf)  # the broadcast is done with it
            i += 1
        self.meta.set(f"{seq}/{i}", wire.encode_end())  # end of this update
        return nbytes, i

    def _tp_members(self, tp: int) -> list[list[int]]:
        """Group ranks of the rollout workers of each TP rank (worker w: group rank 1 + w, TP rank w % tp)."""
        workers = self.spec.world_size - 1
        if workers % tp:
            raise ValueError(f"{workers} rollout workers do not split into engines of {tp} TP ranks")
        return [[1 + w for w in range(r, workers, tp)] for r in range(tp)]

    def _send_sharded(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        seq: int,
        version: int,
        bucket_bytes: int,
        layout: TPLayout,
    ) -> tuple[list[int], int]:
        """Each TP rank's slices in its own buckets, each bucket sent to that rank's workers as it
        fills: (bytes per TP rank, buckets in all)."""
        members = self._tp_members(layout.tp)
        pending: list[list[tuple[str, torch.Tensor, Shard | None, tuple[int, ...]]]] = [[] for _ in members]
        sizes, counts, sent = [0] * len(members), [0] * len(members), [0] * len(members)
        inflight: list[tuple[list[Any], torch.Tensor, str]] = []  # (sends, buffer, what) not yet waited for

        def flush(r: int) -> None:
            bucket, pending[r], sizes[r] = pending[r], [], 0
            buf, table = pack_bucket(
                [(n, p.to(self.device)) for n, p, _, _ in bucket], self.device, self._pool
            )
            places = {j: (full, s.dim, s.start) for j, (_, _, s, full) in enumerate(bucket) if s is not None}
            self.meta.set(f"{seq}/{r}/{counts[r]}", wire.encode_bucket(table, buf.numel(), places))
            what = f"bucket {counts[r]} of TP rank {r}, version {version} ({buf.numel() / 2**20:.1f} MiB)"
            works = [self.pg.send([buf], dst, 0) for dst in members[r]] if buf.numel() else []
            inflight.append((works, buf, what))
            if len(inflight) > len(members):  # one bucket in flight per TP rank: they go out side by side
                done()
            sent[r] += buf.numel()
            counts[r] += 1

        def done() -> None:
            works, buf, what = inflight.pop(0)
            for work in works:
                self._wait(work, what)
            self._pool.put(buf)

        for name, tensor in named:
            full = tuple(tensor.shape)
            for r in range(len(members)):
                s = shard_of(name, full, layout, r)
                piece = tensor if s is None else tensor.narrow(s.dim, s.start, s.length)
                n = tensor_nbytes(piece)
                if pending[r] and sizes[r] + n > bucket_bytes:
                    flush(r)
                pending[r].append((name, piece, s, full))
                sizes[r] += n
        for r in range(len(members)):
            if pending[r]:
                flush(r)
            self.meta.set(f"{seq}/{r}/{counts[r]}", wire.encode_end())  # end of this rank's update
        while inflight:
            done()
        return sent, sum(counts)

    def _read(self, key: str, decode: Any) -> Any:
        """The store's value under `key`, decoded and checked by `decode` (wire.py).

        Raises:
            wire.WeightMetadataError: the value is not metadata trainer rank 0 wrote (refused, never run).
        """
        try:
            return decode(self.meta.get(key), key)
        except wire.WeightMetadataError as err:
            raise wire.WeightMetadataError(
                f"{MODE_KEY}=collective: {self.who} refused the weight metadata in the group's store at "
                f"{self.spec.host}:{self.spec.port}: {err}. Only trainer rank 0 writes there, as JSON; another "
                "process that can reach this port wrote to it. Nothing it wrote was run. Keep the port reachable "
                f"from the cluster's nodes only, {_FALLBACK}"
            ) from None

    def _next_head(self, key: str, stop: threading.Event | None) -> dict | None:
        """The update head under `key`, waiting for it (forever, in _POLL_S rounds, until `stop`)."""
        while stop is None or not stop.is_set():
            try:
                self.meta.wait([key], timedelta(seconds=_POLL_S))
            except dist.DistStoreError as err:  # a timeout: nothing published yet
                if "timeout" not in str(err).lower():
                    raise
                continue
            return self._read(key, wire.decode_head)
        return None

    def receive(self, stop: threading.Event | None = None, pool: BufferPool | None = None) -> Received | None:
        """Ranks >= 1: the next update (Received); None if `stop` was set first. Buffers come from
        `pool` when given."""
        seq = self._seq
        head = self._next_head(f"{seq}/head", stop)
        if head is None:
            return None
        self._seq += 1
        version = head["version"]
        if head["sharded"] and head["tp"] != self.tp_size:
            raise RuntimeError(
                f"{MODE_KEY}=collective: {self.who} is TP rank {self.tp_rank} of {self.tp_size}, but trainer rank 0 "
                f"sliced version {version} for TP {head['tp']}: the trainer and the rollout workers must share "
                "actor_rollout_ref.rollout.tensor_model_parallel_size"
            )
        prefix = f"{seq}/{self.tp_rank}/" if head["sharded"] else f"{seq}/"
        got = Received(version, [], [], 0)
        meta = self._read(f"{prefix}0", wire.decode_bucket)  # set before the update's first transfer
        while meta is not None:
            n = meta["nbytes"]
            buf = (
                pool.get(n, self.device)
                if pool is not None
                else torch.empty(n, dtype=torch.uint8, device=self.device)
            )
            what = f"bucket {len(got.buffers)} of version {version}"
            if not head["sharded"]:
                self._broadcast(buf, what)
            elif n:
                self._wait(self.pg.recv([buf], 0, 0), what)
            places = meta["places"]
            got.named.extend(
                (name, t, places.get(j)) for j, (name, t) in enumerate(unpack_bucket(buf, meta["table"]))
            )
            got.buffers.append(buf)
            got.nbytes += n
            # the next table was set before the transfer it precedes
            meta = self._read(f"{prefix}{len(got.buffers)}", wire.decode_bucket)
        return got


class WeightReceiver:
    """A rollout worker's receiver thread: stages every update the group delivers, by version.

    Args:
        group: this worker's WeightGroup (rank >= 1).
    """

    def __init__(self, group: WeightGroup) -> None:
        self.group = group
        self._staged: dict[int, Received] = {}
        self.received_bytes: dict[int, int] = {}  # bytes of every version received, by version
        self._loaned: dict[int, list[torch.Tensor]] = {}  # buffers of versions being loaded
        self._pool = BufferPool()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridrl-weight-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got = self.group.receive(self._stop, self._pool)
                if got is None:
                    return
                with self._cond:
                    self._staged[got.version] = got
                    self.received_bytes[got.version] = got.nbytes
                    self._cond.notify_all()
        except BaseException as err:  # raised by the next `take`
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def take(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Wait for `version` (at most the group's timeout), drop older ones, return its tensors
        (views of staging buffers: call `recycle(version)` once the engine has copied them)."""
        limit = self.group.spec.timeout_s
        deadline = time.monotonic() + limit
        with self._cond:
            while version not in self._staged:
                if self._error is not None:
                    raise RuntimeError(
                        f"{MODE_KEY}=collective: {self.group.who}: receiving version {version} failed: {self._error}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{MODE_KEY}=collective: {self.group.who} did not receive version {version} within {limit:g} s "
                        f"({TIMEOUT_KEY}); trainer rank 0 is hung or the update was lost. Raise {TIMEOUT_KEY}, {_FALLBACK}"
                    )
                self._cond.wait(min(left, _POLL_S))
            got = self._staged.pop(version)
            self._loaned[version] = got.buffers  # the full-shape tensors of TP slices join them
            for v in [v for v in self._staged if v < version]:
                for buf in self._staged.pop(v).buffers:
                    self._pool.put(buf)
        return materialize(got.named, self._pool, got.buffers)

    def recycle(self, version: int) -> None:
        """The engine has loaded `version`: its staging buffers may take a later update."""
        with self._cond:
            bufs = self._loaned.pop(version, [])
        for buf in bufs:
            self._pool.put(buf)

    def close(self) -> None:
        """Stop the thread (it notices within _POLL_S when idle)."""
        self._stop.set()
        self._thread.join(timeout=4 * _POLL_S)
