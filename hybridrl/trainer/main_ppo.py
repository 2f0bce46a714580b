"""`python -m hybridrl.trainer.main_ppo [key=value ...]`: the PPO/GRPO/... entry point.

With no arguments it trains the built-in tiny model on the built-in arithmetic task on CPU.
Locally it starts an embedded Ray instance; with `RAY_ADDRESS` set (or through `ray job submit`)
it attaches to that cluster.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from hybridrl.trainer.ppo.config import PPOConfig, load_config
from hybridrl.trainer.ppo.config_stage import load_for_cli, prepare_argv
from hybridrl.trainer.ppo.launch import run_ppo_config


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_ppo_config(load_for_cli(cfg))  # a config error: one line, exit 1 (HYDRA_FULL_ERROR=1: all)


def run_ppo(cfg: DictConfig | dict | None = None) -> dict[str, float]:
    """Load and validate the config, start Ray and the workers, train; returns final val metrics."""
    config = load_config(cfg)
    return run_ppo_config(config)


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        print(OmegaConf.to_yaml(OmegaConf.structured(PPOConfig)))
        sys.exit(0)
    sys.argv = prepare_argv(sys.argv)  # veRL's `+key=` / `key=` spellings both reach the schema
    main()
