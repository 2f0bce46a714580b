"""`python -m hybridrl.trainer.main_rm [key=value ...]`: train a reward model on preference pairs.

Bradley-Terry loss (optional per-pair margin) on TRL's preference format (prompt / chosen /
rejected, text or messages, explicit or implicit prompt) in parquet or jsonl, on the FSDP2 engine.
One process per device slot (`torchrun --nproc_per_node=N -m hybridrl.trainer.main_rm ...` for N).
It logs loss, pairwise accuracy and reward margin, validates on the held-out pairs, checkpoints
and resumes exactly, and writes `<trainer.default_local_dir>/reward_model`: a Hugging Face
sequence-classification model that main_ppo's `reward_model.model.path` loads as it is.
With no arguments it trains the built-in tiny model on the built-in pairs (a correct and a wrong
answer to the same question). Keys: hybridrl/trainer/config/rm_trainer.yaml and docs/rlhf.md.
"""

from __future__ import annotations

import functools

from hybridrl.trainer.pref.config import RMConfig
from hybridrl.trainer.pref.launch import run_and_stop
from hybridrl.utils.cli import hydra_cli


def main(config=None) -> dict[str, float] | None:
    """The command line (no argument), or `main(config)` with a dict / DictConfig of overrides."""
    if config is not None:
        return run_and_stop("rm", config)
    hydra_cli(__doc__, "rm_trainer", RMConfig, functools.partial(run_and_stop, "rm"))
    return None


if __name__ == "__main__":
    main()
