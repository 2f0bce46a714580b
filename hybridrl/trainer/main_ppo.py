"""`python -m hybridrl.trainer.main_ppo [key=value ...]`: the PPO/GRPO/... entry point.

With no arguments it trains the built-in tiny model on the built-in arithmetic task on CPU.
Locally it starts an embedded Ray instance; with `RAY_ADDRESS` set (or through `ray job submit`)
it attaches to that cluster.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hybridrl.trainer.ppo.config import PPOConfig, load_config
from hybridrl.trainer.ppo.launch import run_ppo_config
from hybridrl.utils.cli import hydra_cli


def run_ppo(cfg: DictConfig | dict | None = None) -> dict[str, float]:
    """Load and validate the config, start Ray and the workers, train; returns final val metrics."""
    return run_ppo_config(load_config(cfg))


def main() -> None:
    hydra_cli(__doc__, "ppo_trainer", PPOConfig, run_ppo)


if __name__ == "__main__":
    main()
