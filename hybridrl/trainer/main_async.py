"""`python -m hybridrl.trainer.main_async [key=value ...]`: asynchronous (AReaL-style) PPO/GRPO.

Same keys as main_ppo (hybridrl/trainer/config/ppo_trainer.yaml) plus `async_training.*`
(docs/async.md). Rollout workers run in their own resource pool (async_training.rollout_*) and
the trainer in trainer.nnodes x trainer.n_gpus_per_node slots. With no arguments it trains the
built-in tiny model on the built-in task on CPU with one training and one rollout slot of one
core each (ASYNC_DEFAULTS in hybridrl/trainer/async_ppo/launch.py), eta = max_head_offpolicyness = 1.

Locally it starts an embedded Ray instance; with RAY_ADDRESS set it attaches to that cluster.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from hybridrl.trainer.async_ppo.config import AsyncPPOConfig
from hybridrl.trainer.async_ppo.launch import compose_async_config, run_async
from hybridrl.utils.cli import check_command_line


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(OmegaConf.to_yaml(OmegaConf.structured(AsyncPPOConfig).async_training))
        return {}
    check_command_line(argv, AsyncPPOConfig, "ppo_trainer")
    return run_async(compose_async_config(argv))


if __name__ == "__main__":
    main()
