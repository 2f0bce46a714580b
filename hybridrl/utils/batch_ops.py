"""Row-independent helpers behind DataProto: object arrays, value equality, indices, unions, metrics.

Pure functions over TensorDicts, numpy arrays and plain dicts (no DataProto in sight), so
`hybridrl.protocol` stays about the batch type itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase


def to_object_array(value: Any, key: str) -> np.ndarray:
    """Return `value` as a numpy array with dtype=object, keeping dim 0 as the row dim.

    Lists/tuples become 1-D object arrays even when their elements are equal-length lists
    (np.array would silently make those 2-D).
    """
    if isinstance(value, np.ndarray):
        return value if value.dtype == object else value.astype(object)
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"non_tensor_batch[{key!r}] is a torch.Tensor; put tensors in `tensors`/`batch`, "
            "or convert it with .tolist() if it really is per-row Python data."
        )
    if isinstance(value, (list, tuple)):
        out = np.empty(len(value), dtype=object)
        for i, v in enumerate(value):
            out[i] = v
        return out
    raise TypeError(
        f"non_tensor_batch[{key!r}] has type {type(value).__name__}; expected a numpy array or a "
        "list with one entry per row. Put per-batch values in meta_info instead."
    )


def values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, numpy arrays, NaN floats and nested containers."""
    if a is b:
        return True
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        if (
            not (isinstance(a, TensorDictBase) and isinstance(b, TensorDictBase))
            or a.batch_size != b.batch_size
        ):
            return False
        a_keys = set(a.keys(include_nested=True, leaves_only=True))
        if a_keys != set(b.keys(include_nested=True, leaves_only=True)):
            return False
        return all(values_equal(a[k], b[k]) for k in a_keys)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # both NaN
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


def as_index(idxs: Any, length: int) -> tuple[torch.Tensor, np.ndarray]:
    """Normalise an index (int list, numpy array, bool mask, tensor) to (torch, numpy) forms."""
    if isinstance(idxs, torch.Tensor):
        idx_np = idxs.detach().cpu().numpy()
    else:
        idx_np = np.asarray(idxs)
    if idx_np.ndim != 1:
        raise IndexError(f"index must be 1-D, got shape {tuple(idx_np.shape)}")
    if idx_np.dtype == bool:
        if idx_np.shape[0] != length:
            raise IndexError(f"boolean mask has length {idx_np.shape[0]} but the batch has {length} rows")
    elif idx_np.size == 0:
        idx_np = idx_np.astype(np.int64)
    elif not np.issubdtype(idx_np.dtype, np.integer):
        raise IndexError(f"index must hold integers or booleans, got dtype {idx_np.dtype}")
    else:
        idx_np = idx_np.astype(np.int64)
        if idx_np.min() < -length or idx_np.max() >= length:
            raise IndexError(f"index out of range for a batch of {length} rows: {idx_np.tolist()}")
    return torch.from_numpy(np.ascontiguousarray(idx_np)), idx_np


def merge_metrics(pieces: Sequence[Any]) -> dict[str, list]:
    """Merge metric dicts (or lists of dicts) into one dict of flat lists, in order.

    A value that is itself a list is extended, so per-micro-batch lists stay flat.
    """
    merged: dict[str, list] = {}
    for piece in pieces:
        if piece is None:
            continue
        dicts = piece if isinstance(piece, (list, tuple)) else [piece]
        for d in dicts:
            if not isinstance(d, dict):
                raise TypeError(
                    f"meta_info['metrics'] must be a dict or a list of dicts, got {type(d).__name__}"
                )
            for k, v in d.items():
                target = merged.setdefault(k, [])
                if isinstance(v, (list, tuple)):
                    target.extend(v)
                else:
                    target.append(v)
    return merged


def pick_keys(d: dict[str, Any], keys: Sequence[str] | None, op: str, part: str) -> dict[str, Any]:
    """The entries of `d` named by `keys` (all of them for None); KeyError naming missing keys."""
    if keys is None:
        return dict(d)
    missing = [k for k in keys if k not in d]
    if missing:
        raise KeyError(f"{op}: {part} has no keys {missing}; it has {list(d)}")
    return {k: d[k] for k in keys}


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of `tensor_dict2` to `tensor_dict1` (in place) and return it.

    Raises:
        ValueError: if the batch sizes differ, or an overlapping key holds different values.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"union: batch sizes differ ({tuple(tensor_dict1.batch_size)} vs "
            f"{tuple(tensor_dict2.batch_size)}); both sides must describe the same rows."
        )
    for key, value in tensor_dict2.items():
        if key in tensor_dict1.keys():
            if not values_equal(tensor_dict1[key], value):
                raise ValueError(
                    f"union: key {key!r} exists in both batches with different values; rename or pop "
                    "one of them before union."
                )
        else:
            tensor_dict1[key] = value
    return tensor_dict1


def union_numpy_dict(d1: dict[str, np.ndarray], d2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for key, value in d2.items():
        if key in d1 and not values_equal(d1[key], value):
            raise ValueError(
                f"union: non_tensor_batch key {key!r} exists in both with different values; rename or "
                "pop one of them before union."
            )
        d1.setdefault(key, value)
    return d1


def row_parts(n: int, parts: int, keep_empty: bool = False) -> list[tuple[int, int]]:
    """`parts` contiguous [lo, hi) ranges covering range(n) in order, sizes differing by at most one
    (the first n % parts one row longer); empty ranges (more parts than rows) are left out unless
    `keep_empty`.

    >>> row_parts(5, 2)
    [(0, 3), (3, 5)]
    >>> row_parts(2, 3, keep_empty=True)
    [(0, 1), (1, 2), (2, 2)]
    """
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        if keep_empty or hi > lo:
            out.append((lo, hi))
        lo = hi
    return out
