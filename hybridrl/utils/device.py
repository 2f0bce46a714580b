"""The one place that knows about device kinds.

Everything device-specific (device name, distributed backend, visible-devices variable,
process-group creation with a timeout) goes through these helpers, so the rest of the code
runs unchanged on a CPU-only machine (gloo) and on GPUs (nccl).
"""

from __future__ import annotations

import datetime
import os

import torch

DEFAULT_PG_TIMEOUT_S = 600


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device_name() -> str:
    """'cuda' when a GPU is visible, else 'cpu'."""
    return "cuda" if is_cuda_available() else "cpu"


def get_torch_device(local_rank: int = 0) -> torch.device:
    if is_cuda_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def get_dist_backend() -> str:
    """'nccl' on GPUs, 'gloo' on CPU."""
    return "nccl" if is_cuda_available() else "gloo"


def get_visible_devices_keyword() -> str:
    """Environment variable that restricts the visible accelerators of a process."""
    return "CUDA_VISIBLE_DEVICES"


_PG_TIMEOUT: dict[str, float | None] = {"s": None}


def process_group_timeout_s() -> float:
    """The timeout the default process group was created with here (DEFAULT_PG_TIMEOUT_S if not yet)."""
    return _PG_TIMEOUT["s"] or DEFAULT_PG_TIMEOUT_S


def init_process_group(
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    backend: str | None = None,
) -> None:
    """Create the default process group (once), always with a timeout.

    Rank, world size and the rendezvous address come from the usual env vars
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) when not given; the worker group sets them.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _PG_TIMEOUT["s"] = float(timeout_s)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        backend=backend or get_dist_backend(),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if is_cuda_available():
        # Ray usually shows each actor only its own GPU, so wrap the local rank.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
