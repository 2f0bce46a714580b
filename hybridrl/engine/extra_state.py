"""The per-rank part of a checkpoint, shared by the FSDP and Megatron engines.

`extra_state_rank{r}.pt` holds rank r's RNG states, its LR-scheduler state and the caller's
`extra` (plain types and tensors only: it is read back with `torch.load(weights_only=True)`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridrl.utils.safe_io import load_state_file
from hybridrl.utils.torch_utils import get_rng_state, set_rng_state


def extra_state_path(path: str, rank: int) -> str:
    """The file of rank `rank` inside checkpoint folder `path`."""
    return os.path.join(path, f"extra_state_rank{rank}.pt")


def save_extra_state(path: str, rank: int, lr_scheduler: Any, extra: Any) -> None:
    """Write this rank's RNG states, LR-scheduler state and `extra` into `path`."""
    state = {
        "rng": get_rng_state(),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        "extra": extra,
    }
    torch.save(state, extra_state_path(path, rank))


def load_extra_state(path: str, rank: int, lr_scheduler: Any, saved_world_size: Any) -> Any:
    """Restore this rank's RNG states and LR scheduler from `path`; returns the saved `extra`."""
    f = extra_state_path(path, rank)
    if not os.path.exists(f):
        raise FileNotFoundError(
            f"{f} is missing: the checkpoint was saved with {saved_world_size} ranks; resume with the same "
            "number of ranks, or drop 'extra' from checkpoint.load_contents"
        )
    state = load_state_file(f)
    set_rng_state(state["rng"])
    if lr_scheduler is not None and state["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    return state["extra"]
