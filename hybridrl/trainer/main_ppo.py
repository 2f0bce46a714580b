"""`python -m hybridrl.trainer.main_ppo [key=value ...]`: the PPO/GRPO/... entry point.

With no arguments it trains the built-in tiny model on the built-in arithmetic task on CPU.
Locally it starts an embedded Ray instance; with `RAY_ADDRESS` set (or through `ray job submit`)
it attaches to that cluster. veRL command lines port unchanged: `+key=value` and `key=value`
both set the key (see hybridrl/trainer/ppo/config_stage.py); a config error prints one line
and exits 1 (`HYDRA_FULL_ERROR=1` shows the traceback). From Python, `main(config)` runs a
config composed with hydra's compose API, as veRL's `main(config)` does;
`run_ppo(config, role_worker_mapping={Role.ActorRollout: MyWorker}, trainer_cls=MyTrainer)` runs
the user's worker and trainer classes (docs/extending.md).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from omegaconf import DictConfig

from hybridrl.compat.async_keys import selects_v1_async
from hybridrl.compat.verl_layout import layout_knows
from hybridrl.trainer.ppo.config import PPOConfig, load_config
from hybridrl.trainer.ppo.config_stage import check_startup, load_for_cli, prepare_argv
from hybridrl.trainer.ppo.launch import run_ppo_config
from hybridrl.trainer.ppo.roles import Role
from hybridrl.utils.cli import hydra_cli


def run_ppo(
    cfg: DictConfig | dict | None = None,
    *,
    role_worker_mapping: Mapping[Role, type] | None = None,
    trainer_cls: type | None = None,
) -> dict[str, float]:
    """Load and validate the config, start Ray and the workers, train; returns final val metrics.

    Args:
        cfg: the config (a DictConfig or dict of veRL keys; None: the defaults).
        role_worker_mapping: the user's worker classes by role, as veRL's `role_worker_mapping`
            (e.g. `{Role.ActorRollout: MyWorker}`, `Role` from hybridrl.trainer.ppo.roles); each
            subclasses the built-in class of its role. Roles left out keep the built-in class.
        trainer_cls: a subclass of RayPPOTrainer to run instead of it (e.g. with an extra stage).
    """
    return run_ppo_config(load_config(cfg), role_worker_mapping=role_worker_mapping, trainer_cls=trainer_cls)


def run_ppo_cli(cfg: DictConfig) -> dict[str, float]:
    """The command line's run: the config stage knows which keys were typed (small-batch defaults)."""
    return run_ppo_config(load_for_cli(cfg))


def main(config: DictConfig | dict | None = None) -> dict[str, float] | None:
    """The command line (no argument), or veRL's `main(config)`: run a composed config.

    Args:
        config: a config composed by the caller (e.g. with hydra's `compose` API on
            hybridrl.trainer.config's ppo_trainer, as veRL's tutorial does), or a dict. It goes
            through the command line's config stage with every key counted as set; a config error
            raises ConfigError. None: parse sys.argv (the `python -m` entry).

    Returns:
        The final validation metrics when `config` is given.
    """
    if config is not None:
        return run_ppo_config(check_startup(config))
    if selects_v1_async(sys.argv[1:]):  # veRL's trainer.use_v1 + v1.trainer_mode=*_async: main_async
        from hybridrl.trainer import main_async

        return main_async.main(sys.argv[1:])
    sys.argv = prepare_argv(sys.argv)  # veRL's `+key=` / `key=` spellings both reach the schema
    hydra_cli(__doc__, "ppo_trainer", PPOConfig, run_ppo_cli, also_known=layout_knows)
    return None


if __name__ == "__main__":
    main()
