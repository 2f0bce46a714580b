"""Loading files someone else may have written, without running code from them.

Checkpoint state files (`data.pt`, `extra_state_rank*.pt`) hold tensors and plain Python types
only (ints, floats, strings, None, lists, tuples, dicts; RNG states as tensors), so they load with
`torch.load(weights_only=True)`, which refuses any other pickled object instead of constructing it.
A refused file raises `UnsafeCheckpointError` naming the file and the reason, including a file
written by hybridrl before safe loading (its RNG state was pickled numpy/Python objects).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds objects that `torch.load(weights_only=True)` will not construct."""


def load_state_file(path: str | os.PathLike) -> Any:
    """`torch.load(path, weights_only=True)`; a refused file raises UnsafeCheckpointError."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UnsafeCheckpointError(
            f"refusing to load {os.fspath(path)!r}: it holds Python objects other than tensors and plain "
            f"types, which could run code when unpickled ({reason}). hybridrl writes only tensors and plain "
            "types; a file written by hybridrl before safe loading (numpy / Python RNG objects) cannot be "
            "resumed: start from its model weights (model_merger) or re-run from an earlier safe checkpoint. "
            "Do not load files you do not trust."
        ) from None
