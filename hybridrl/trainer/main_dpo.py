"""`python -m hybridrl.trainer.main_dpo [key=value ...]`: preference optimisation of a policy.

DPO (sigmoid loss with beta and label smoothing), IPO, or the reference-free SimPO
(`dpo.loss_type`), on TRL's preference format in parquet or jsonl, on the FSDP2 engine; LoRA with
the frozen base as the reference (`model.lora_rank`). The reference log-probs are computed once
before training (`dpo.precompute_ref_log_probs=true`) or beside every step. With no arguments it
trains the built-in tiny model on the built-in pairs and reports greedy accuracy on held-out
questions. Keys: hybridrl/trainer/config/dpo_trainer.yaml and docs/rlhf.md.
"""

from __future__ import annotations

import functools

from hybridrl.trainer.pref.config import DPOConfig
from hybridrl.trainer.pref.launch import run_and_stop
from hybridrl.utils.cli import hydra_cli


def main(config=None) -> dict[str, float] | None:
    """The command line (no argument), or `main(config)` with a dict / DictConfig of overrides."""
    if config is not None:
        return run_and_stop("dpo", config)
    hydra_cli(__doc__, "dpo_trainer", DPOConfig, functools.partial(run_and_stop, "dpo"))
    return None


if __name__ == "__main__":
    main()
