"""Buckets: how every weight movement cuts a stream of named tensors into bounded pieces.

`iter_buckets` groups a `(name, tensor)` stream into consecutive buckets of at most a byte budget
(the colocated sync, the collective group and the SGLang engine's own update calls use it);
`pack_bucket` / `unpack_bucket` turn one bucket into a single byte buffer and back (the
collective group sends one buffer per bucket); `BufferPool` keeps those buffers for the next
update.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator

import torch

__all__ = [
    "ALIGN",
    "BufferPool",
    "iter_buckets",
    "layer_of",
    "pack_bucket",
    "tensor_nbytes",
    "unpack_bucket",
]

ALIGN = 64  # byte alignment of each tensor in a packed bucket (any dtype's view is valid)
_LAYER = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.")


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_of(name: str) -> str | None:
    """'model.layers.3.mlp.up_proj.weight' -> 'model.layers.3'; None outside the decoder layers."""
    m = _LAYER.search(name)
    return m.group(0).strip(".") if m else None


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, by_layer: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into consecutive buckets of at most `bucket_bytes`.

    Order is preserved; a tensor bigger than `bucket_bytes` is a bucket of its own; no bucket
    is empty. With `by_layer` (veRL's `rollout.layered_summon`) a bucket also never spans two
    decoder layers, so at most one layer's gathered weights are held at a time.

    Args:
        named_tensors: `(name, tensor)` pairs, pulled lazily.
        bucket_bytes: the byte budget of one bucket (> 0).
        by_layer: start a new bucket where the decoder layer changes.

    Yields:
        lists of `(name, tensor)` pairs.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size, layer = 0, None
    for name, tensor in named_tensors:
        n = tensor_nbytes(tensor)
        new_layer = by_layer and bucket and layer_of(name) != layer
        if bucket and (size + n > bucket_bytes or new_layer):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
        layer = layer_of(name)
    if bucket:
        yield bucket


class BufferPool:
    """Byte buffers to reuse across updates (the same bucket sizes come back every update, and
    writing into memory that is already mapped is about twice as fast as into fresh pages)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.get((nbytes, str(device)))
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), str(buf.device)), []).append(buf)


def pack_bucket(
    bucket: list[tuple[str, torch.Tensor]], device: torch.device, pool: BufferPool | None = None
) -> tuple[torch.Tensor, list[tuple[str, str, tuple[int, ...], int]]]:
    """Pack a bucket's tensors into one byte buffer.

    Args:
        bucket: `(name, tensor)` pairs (any dtypes and shapes).
        device: where the buffer lives (the broadcast's device).
        pool: where the buffer comes from (None: a new one).

    Returns:
        (buffer: (nbytes,) uint8, table: `(name, dtype name, shape, byte offset)` per tensor; each
        offset is a multiple of ALIGN bytes).
    """
    table, offset = [], 0
    for name, t in bucket:
        table.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-tensor_nbytes(t) // ALIGN) * ALIGN
    buf = (
        pool.get(offset, device)
        if pool is not None
        else torch.empty(offset, dtype=torch.uint8, device=device)
    )
    for (_, t), (_, _, shape, off) in zip(bucket, table):
        buf[off : off + tensor_nbytes(t)].view(t.dtype).view(shape).copy_(t.detach())
    return buf, table


def unpack_bucket(
    buf: torch.Tensor, table: list[tuple[str, str, tuple[int, ...], int]]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a packed bucket, as views of `buf` (no copy)."""
    out = []
    for name, dtype_name, shape, off in table:
        dtype = getattr(torch, dtype_name)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        out.append((name, buf[off : off + nbytes].view(dtype).view(shape)))
    return out
