"""Process set-up of `main_rm` / `main_dpo`: config, input checks, process group, trainer, export.

Every row of the train / val files is read, tokenised and checked before the process group and
the model are built (trainer/pref/data.py), so bad input fails at once naming file, row and fix.
"""

from __future__ import annotations

import os
from typing import Any

from hybridrl.trainer.pref.config import load_pref_config
from hybridrl.trainer.pref.data import check_model_head, load_pref_datasets
from hybridrl.trainer.sft.launch import init_distributed, sft_folder_lock, stop_distributed
from hybridrl.utils.shutdown import preemption_saves

__all__ = ["run_pref", "run_pref_config"]


def run_pref(kind: str, cfg: Any = None) -> dict[str, float]:
    """Load the config of `kind` ("rm" or "dpo"), train; returns the final validation metrics."""
    return run_pref_config(kind, load_pref_config(kind, cfg))


def run_pref_config(kind: str, config: Any) -> dict[str, float]:
    from hybridrl.trainer.pref.trainer import DPOTrainer, RewardModelTrainer

    if kind == "rm":
        check_model_head(config)
    tokenizer, train, val, val_files = load_pref_datasets(config)
    cls = RewardModelTrainer if kind == "rm" else DPOTrainer
    # SIGTERM / SIGUSR1: the step is finished, saved, and the run exits 128 + signal (as main_sft);
    # one writing run per trainer.default_local_dir
    with preemption_saves(config.trainer.preemption_grace_s), sft_folder_lock(config):
        init_distributed(config)
        trainer = cls(config, train, val, tokenizer, val_files)
        try:
            metrics = trainer.fit()
            if kind == "rm" and trainer.global_step >= trainer.total_steps:
                out = os.path.join(trainer.checkpoint_root, "reward_model")
                trainer.export(out)
                trainer._print(f"reward model (sequence classification) written to {out}")
            return metrics
        finally:
            trainer.close()


def run_and_stop(kind: str, cfg: Any) -> dict[str, float]:
    """Train, then leave the process group (torchrun expects every rank to exit cleanly)."""
    try:
        return run_pref(kind, cfg)
    finally:
        stop_distributed()
