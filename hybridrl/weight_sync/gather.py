"""The one gather routine of every weight movement.

The colocated sync, the object-store publish and the collective broadcast all start the same way:
the training engine brings its parameters back to the device, gathers its shards into full
tensors one bucket at a time with the rollout's weight loader (`rollout.load_format` ->
"dtensor" buckets, the "hf" full state dict, or the "megatron" TP/PP gather; see
`TrainEngine.iter_params`), casts them to the rollout dtype, and offloads again when the stream
is done. The gather is a collective of all training ranks: every rank must drain the stream,
also those that do not keep the tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["drain", "gathered"]


@contextmanager
def gathered(
    engine: Any, dtype: torch.dtype | None, loader: str | None
) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """`with gathered(engine, dtype, loader) as named:` the `(hf_name, full tensor)` stream.

    Args:
        engine: the training engine (a `TrainEngine`: onload / iter_params / offload).
        dtype: the rollout's dtype (None: the training dtype).
        loader: the rollout's weight loader (`rollout.parallel.weight_loader_for`); None: the
            engine's own.

    The engine is offloaded when the block ends, also when it raises.
    """
    engine.onload()
    try:
        yield engine.iter_params(dtype=dtype, loader=loader)
    finally:
        engine.offload()


def drain(named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run a gather to its end without keeping anything (a rank that only takes part in it)."""
    for _ in named:
        pass
