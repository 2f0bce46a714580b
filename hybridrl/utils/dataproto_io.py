"""DataProto on disk in a format that cannot run code when read.

One safetensors file: the tensors of `batch` (one entry each, nested TensorDict keys included),
and, in its JSON header, the layout plus `non_tensor_batch` and `meta_info` as tagged JSON. Numpy
arrays (object arrays of strings, numbers, dicts, lists, nested arrays ...), numpy scalars,
tuples, bytes and small tensors inside them round-trip; anything else is refused at save time,
naming the key, instead of being pickled. Reading never unpickles: a file that is not this format
(e.g. a pickle written by an older hybridrl) fails with a message saying so.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tensordict import TensorDict

FORMAT = "hybridrl.DataProto/1"


class DataProtoFileError(ValueError):
    """A file that is not a DataProto written by `save_dataproto`."""


def encode(value: Any, where: str) -> Any:
    """`value` as JSON-compatible data with type tags; TypeError names `where` for other types."""
    if isinstance(value, np.ndarray):
        items = (
            [encode(v, where) for v in value.reshape(-1).tolist()]
            if value.dtype == object
            else value.tolist()
        )
        return {"__ndarray__": [str(value.dtype), list(value.shape), items]}
    if isinstance(value, np.generic):  # before the plain types: np.float64 and np.str_ subclass them
        return {"__npscalar__": [str(value.dtype), value.item()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {
            "__tensor__": [
                str(t.dtype).removeprefix("torch."),
                list(t.shape),
                t.float().tolist() if t.is_floating_point() else t.tolist(),
            ]
        }
    if isinstance(value, (list, tuple)):
        items = [encode(v, where) for v in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, where), encode(v, where)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    raise TypeError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}; DataProto.save_to_disk stores "
        "tensors, numpy arrays and plain Python values (str, numbers, None, list, tuple, dict, bytes) only"
    )


def decode(value: Any) -> Any:
    """Inverse of `encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    ((tag, body),) = value.items()
    if tag == "__ndarray__":
        dtype, shape, items = body
        if dtype == "object":
            out = np.empty(len(items), dtype=object)
            for i, v in enumerate(items):  # element by element: a list element stays one object
                out[i] = decode(v)
            return out.reshape(shape)
        return np.array(items, dtype=dtype).reshape(shape)
    if tag == "__npscalar__":
        return np.array(body[1], dtype=body[0])[()]
    if tag == "__tensor__":
        return torch.tensor(body[2], dtype=getattr(torch, body[0])).reshape(body[1])
    if tag == "__tuple__":
        return tuple(decode(v) for v in body)
    if tag == "__dict__":
        return {decode(k): decode(v) for k, v in body}
    if tag == "__bytes__":
        return base64.b64decode(body)
    raise DataProtoFileError(f"unknown tag {tag!r} in a DataProto file")


def save_dataproto(path: str | os.PathLike, batch: TensorDict | None, non_tensor: dict, meta: dict) -> None:
    """Write the three parts of a DataProto to `path` (one safetensors file, see the module doc)."""
    tensors, keys = {}, []
    if batch is not None:
        for i, (key, t) in enumerate(batch.items(include_nested=True, leaves_only=True)):
            tensors[f"t{i}"] = t.detach().cpu().contiguous().clone()
            keys.append(list(key) if isinstance(key, tuple) else [key])
    layout = {
        "batch": None if batch is None else {"batch_size": list(batch.batch_size), "keys": keys},
        "non_tensor_batch": {k: encode(v, f"non_tensor_batch[{k!r}]") for k, v in non_tensor.items()},
        "meta_info": encode(meta, "meta_info"),
    }
    save_file(tensors, os.fspath(path), metadata={"format": FORMAT, "layout": json.dumps(layout)})


def load_dataproto(path: str | os.PathLike) -> tuple[TensorDict | None, dict, dict]:
    """(batch, non_tensor_batch, meta_info) from a file written by `save_dataproto`; nothing is unpickled."""
    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except (SafetensorError, OSError, ValueError) as e:
        raise DataProtoFileError(
            f"{path!r} is not a DataProto file written by DataProto.save_to_disk ({e}). Files written by hybridrl "
            "before safe loading were pickles; they are not read, because unpickling a file can run arbitrary "
            "code. Re-create the file with DataProto.save_to_disk."
        ) from None
    if header.get("format") != FORMAT:
        raise DataProtoFileError(
            f"{path!r} is a safetensors file but not a {FORMAT} file (format={header.get('format')!r})"
        )
    layout = json.loads(header["layout"])
    batch = None
    if layout["batch"] is not None:
        batch = TensorDict({}, batch_size=layout["batch"]["batch_size"])
        for i, key in enumerate(layout["batch"]["keys"]):
            batch.set(tuple(key) if len(key) > 1 else key[0], tensors[f"t{i}"])
    non_tensor = {k: decode(v) for k, v in layout["non_tensor_batch"].items()}
    return batch, non_tensor, decode(layout["meta_info"])
