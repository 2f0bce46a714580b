"""Process set-up for SFT: the process group, torch threads, and the run (config -> SFTTrainer.fit)."""

from __future__ import annotations

import contextlib
import os
import socket

from omegaconf import DictConfig

from hybridrl.trainer.sft.config import SFTConfig, load_sft_config
from hybridrl.trainer.sft.input_checks import check_sft_inputs
from hybridrl.trainer.sft.trainer import SFTTrainer
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.device import init_process_group, is_cuda_available
from hybridrl.utils.run_lock import RunLock
from hybridrl.utils.shutdown import preemption_saves


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def init_distributed(config: SFTConfig) -> tuple[int, int]:
    """Start (or join) the process group; set the torch thread count. Returns (rank, world_size).

    Without a launcher (no WORLD_SIZE in the environment) this is a one-process group on a free
    local port. Under torchrun every rank joins the launcher's rendezvous.
    """
    import torch
    import torch.distributed as dist

    t = config.trainer
    if t.device == "cuda" and not is_cuda_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    if t.device == "cpu" and is_cuda_available():
        raise ConfigError(
            "trainer.device=cpu on a machine with GPUs: hide them instead (CUDA_VISIBLE_DEVICES= python -m ...)"
        )
    launched = "WORLD_SIZE" in os.environ
    if not dist.is_initialized():
        if not launched:
            slots = t.nnodes * (t.n_gpus_per_node or 1)
            if slots > 1:
                raise ConfigError(
                    f"trainer.nnodes * trainer.n_gpus_per_node = {slots} slots, but this is a single process; "
                    f"launch with `torchrun --nproc_per_node={t.n_gpus_per_node} -m hybridrl.trainer.main_sft ...`"
                )
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
        init_process_group(rank=0 if not launched else None, world_size=1 if not launched else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if t.n_gpus_per_node is not None and launched and world != t.nnodes * t.n_gpus_per_node:
        raise ConfigError(
            f"the launcher started {world} processes but trainer.nnodes * trainer.n_gpus_per_node = "
            f"{t.nnodes * t.n_gpus_per_node}; make them agree (or leave trainer.n_gpus_per_node=null)"
        )
    if not is_cuda_available() or t.device == "cpu":
        torch.set_num_threads(cpu_threads(world if launched else 1))
    return rank, world


def cpu_threads(world: int = 1) -> int:
    """Torch threads per process on CPU: $OMP_NUM_THREADS when set, else the usable cores / local ranks."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, _usable_cpus() // max(1, local_world))


def run_sft(cfg: DictConfig | dict | list[str] | None = None) -> dict[str, float]:
    """Load the config, start the process group, train; returns the final validation metrics."""
    config = load_sft_config(cfg)
    return run_sft_config(config)


def run_sft_config(config: SFTConfig) -> dict[str, float]:
    check_sft_inputs(config)  # model folder and every data row, before the process group and the model
    # SIGTERM / SIGUSR1: the step is finished, saved, and the tracker closed (hybridrl.trainer.sft.preemption)
    with preemption_saves(config.trainer.preemption_grace_s), sft_folder_lock(config):
        init_distributed(config)
        trainer = SFTTrainer(config)
        try:
            return trainer.fit()
        finally:
            trainer.close()


def sft_folder_lock(config: SFTConfig):
    """The run folder's lock (one writing run per trainer.default_local_dir), held by rank 0 only
    (under torchrun every rank runs this; ``RANK`` is set by the launcher)."""
    t = config.trainer
    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        return contextlib.nullcontext()
    root = os.path.abspath(os.path.expanduser(t.default_local_dir))
    return RunLock(root, label=f"{t.project_name}/{t.experiment_name}")


def stop_distributed() -> None:
    """Leave the process group if one was started (every torchrun rank must exit cleanly)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
