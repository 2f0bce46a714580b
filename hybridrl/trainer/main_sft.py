"""`python -m hybridrl.trainer.main_sft [key=value ...]`: supervised fine-tuning with FSDP2.

One process per device slot, no Ray: run it directly for one slot (CPU or one GPU), or with
`torchrun --nproc_per_node=N -m hybridrl.trainer.main_sft ...` for N slots. The same code runs
on CPU (gloo) and GPUs (nccl). With no arguments it fine-tunes the built-in tiny model on the
built-in task's SFT data on CPU and reports validation loss and greedy accuracy.

Config keys follow veRL's `sft_trainer.yaml` (data.*, model.partial_pretrain, optim.*, trainer.*);
see hybridrl/trainer/config/sft_trainer.yaml and docs/sft.md. An unknown key fails at start-up
with a message naming it.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from hybridrl.trainer.sft.config import CONFIG_DIR, SFTConfig, SFTConfigError, check_override_keys
from hybridrl.trainer.sft.launch import run_sft


def _hydra_main() -> None:
    import hydra

    try:
        check_override_keys(sys.argv[1:], SFTConfig, "sft_trainer")
    except SFTConfigError as e:
        sys.exit(f"SFTConfigError: {e}")

    @hydra.main(config_path="config", config_name="sft_trainer", version_base=None)
    def main(cfg: DictConfig) -> None:
        run_sft(cfg)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    main()


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        print((CONFIG_DIR / "sft_trainer.yaml").read_text())
        sys.exit(0)
    _hydra_main()
