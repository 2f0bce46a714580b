"""`python -m hybridrl.trainer.main_async [key=value ...]`: asynchronous (AReaL-style) PPO/GRPO.

Same keys as main_ppo (hybridrl/trainer/config/ppo_trainer.yaml) plus `async_training.*`
(docs/async.md). Rollout workers run in their own resource pool (async_training.rollout_*) and
the trainer in trainer.nnodes x trainer.n_gpus_per_node slots. With no arguments it trains the
built-in tiny model on the built-in task on CPU with one training and one rollout slot of one
core each (ASYNC_DEFAULTS in hybridrl/trainer/async_ppo/launch.py), eta = max_head_offpolicyness = 1.

Locally it starts an embedded Ray instance; with RAY_ADDRESS set it attaches to that cluster.
The config goes through main_ppo's config stage (veRL's spellings, refused keys, one-line errors),
after AReaL's keys and veRL v1's async-trainer keys are translated (hybridrl/compat/async_keys.py).

AReaL users bring their experiment file: `python -m hybridrl.trainer.main_async --config
areal.yaml [key=value ...]` translates every key of it (hybridrl/compat/areal_file.py); overrides of
the file's own sections (`actor.path=...`) change the file, the others are hybridrl keys.
From Python, `main(config)` runs a composed config, as veRL's `main(config)` does.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from hybridrl.compat.areal_file import load_areal_file, split_config_flag
from hybridrl.compat.async_keys import translate_argv
from hybridrl.compat.verl_layout import layout_knows
from hybridrl.trainer.async_ppo.config import AsyncPPOConfig, load_async_config
from hybridrl.trainer.async_ppo.launch import compose_async_config, run_async_config
from hybridrl.trainer.ppo.config_stage import exit_with_config_error, load_for_cli, override_key, prepare_argv
from hybridrl.utils.cli import check_command_line
from hybridrl.utils.config_loader import ConfigError


def main(config: DictConfig | dict | list[str] | None = None) -> dict[str, float]:
    """The command line, or veRL's `main(config)`: run a composed config.

    Args:
        config: a DictConfig / dict composed by the caller (hydra's compose API on ppo_trainer, plus
            async_training.*), run through main_ppo's config stage with every key counted as set
            (a config error raises ConfigError); or a list of `key=value` overrides (None:
            sys.argv[1:]), spelled as on main_ppo's command line (`+key=`, `key=`), whose config
            errors print one line and exit 1.
    """
    if isinstance(config, (DictConfig, dict)):
        return run_async_config(load_async_config(config))
    argv = sys.argv[1:] if config is None else list(config)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(OmegaConf.to_yaml(OmegaConf.structured(AsyncPPOConfig).async_training))
        return {}
    try:
        areal_file, argv = split_config_flag(argv)
        if areal_file is not None:  # an AReaL experiment file, then the command line's keys
            argv = load_areal_file(areal_file, argv)
        argv = translate_argv(argv)  # AReaL / veRL v1 keys first
    except ConfigError as e:
        exit_with_config_error(e)
    argv = prepare_argv(["main_async", *argv])[1:]
    check_command_line(argv, AsyncPPOConfig, "ppo_trainer", also_known=layout_knows)
    explicit = {override_key(o) for o in argv}
    return run_async_config(load_for_cli(compose_async_config(argv), load_async_config, explicit))


if __name__ == "__main__":
    main()
