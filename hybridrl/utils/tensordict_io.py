"""Pickling a TensorDict as a few large byte buffers (one per tensor), never per-row Python objects.

Used by `DataProto.__getstate__/__setstate__` so batches cross Ray cheaply (zero-copy from the
object store where possible).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict


def pack_tensordict(td: TensorDict) -> dict[str, Any]:
    leaves = []
    for key, value in td.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"batch[{key!r}] is a {type(value).__name__}, not a tensor; keep non-tensor data in "
                "non_tensor_batch."
            )
        t = value.detach()
        buf = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        leaves.append((key, str(t.dtype).removeprefix("torch."), tuple(t.shape), str(t.device), buf))
    return {
        "batch_size": tuple(td.batch_size),
        "device": None if td.device is None else str(td.device),
        "leaves": leaves,
    }


def restore_device(device: str | None) -> str | None:
    """Keep the original device when this process has it, else fall back to CPU."""
    if device is None or device.startswith("cpu"):
        return device
    kind = device.split(":")[0]
    mod = getattr(torch, kind, None)
    if mod is not None and hasattr(mod, "is_available") and mod.is_available():
        return device
    return "cpu"


def unpack_tensordict(state: dict[str, Any]) -> TensorDict:
    device = restore_device(state["device"])
    td = TensorDict({}, batch_size=state["batch_size"], device=device)
    for key, dtype_name, shape, tensor_device, buf in state["leaves"]:
        if not buf.flags.writeable:  # e.g. zero-copy from the Ray object store
            buf = buf.copy()
        t = torch.from_numpy(buf).view(getattr(torch, dtype_name)).reshape(shape)
        target = restore_device(tensor_device)
        if target != "cpu":
            t = t.to(target)
        td.set(key, t)
    return td
