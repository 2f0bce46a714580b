"""Which backend runs a trainer's worker group: Ray actors, or the driver process itself.

`trainer.backend`: `ray` always starts (or attaches to) Ray and one actor per slot; `local` builds
the single worker in the driver (`LocalWorkerGroup`, one slot only); `auto` (default) is `local`
for a one-slot CPU run that is not attached to a cluster (no RAY_ADDRESS, Ray not started by the
caller) and `ray` otherwise.
"""

from __future__ import annotations

import os
import sys

BACKENDS = ("auto", "ray", "local")


def resolve_backend(backend: str, *, slots: int, use_gpu: bool, key: str = "trainer.backend") -> str:
    """'auto' | 'ray' | 'local' -> 'ray' or 'local' (see the module docstring).

    Raises:
        ValueError: an unknown name, or 'local' with more than one slot.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{key}={backend!r}: use one of {BACKENDS}")
    if backend == "local" and slots != 1:
        raise ValueError(
            f"{key}=local runs one worker in the driver, but the run has {slots} slots "
            "(trainer.nnodes x trainer.n_gpus_per_node); use trainer.backend=ray or one slot"
        )
    if backend != "auto":
        return backend
    ray_mod = sys.modules.get("ray")
    attached = bool(os.environ.get("RAY_ADDRESS")) or (ray_mod is not None and ray_mod.is_initialized())
    return "local" if slots == 1 and not use_gpu and not attached else "ray"
