"""`python -m hybridrl.trainer.main_sft [key=value ...]`: supervised fine-tuning with FSDP2 or Megatron.

One process per device slot, no Ray: run it directly for one slot (CPU or one GPU), or with
`torchrun --nproc_per_node=N -m hybridrl.trainer.main_sft ...` for N slots. The same code runs
on CPU (gloo) and GPUs (nccl). With no arguments it fine-tunes the built-in tiny model on the
built-in task's SFT data on CPU and reports validation loss and greedy accuracy.
`model_engine=megatron` (with `model.megatron.tensor_model_parallel_size=...`) trains with Megatron.

Config keys follow veRL's `sft_trainer.yaml` (data.*, model.partial_pretrain, optim.*, trainer.*);
see hybridrl/trainer/config/sft_trainer.yaml and docs/sft.md. An unknown key fails at start-up
with a message naming it.
"""

from __future__ import annotations

from hybridrl.trainer.sft.config import SFTConfig
from hybridrl.trainer.sft.launch import run_sft, stop_distributed
from hybridrl.utils.cli import hydra_cli


def run_and_stop(cfg) -> dict[str, float]:
    """Train, then leave the process group (torchrun expects every rank to exit cleanly)."""
    try:
        return run_sft(cfg)
    finally:
        stop_distributed()


def main(config=None) -> dict[str, float] | None:
    """The command line (no argument), or veRL's `main(config)`: train on a config composed by the
    caller (hydra's compose API on hybridrl.trainer.config's sft_trainer, or a dict)."""
    if config is not None:
        return run_and_stop(config)
    hydra_cli(__doc__, "sft_trainer", SFTConfig, run_and_stop)
    return None


if __name__ == "__main__":
    main()
