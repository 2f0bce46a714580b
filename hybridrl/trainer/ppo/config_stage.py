"""The config stage of `main_ppo`: everything checked before Ray or any model starts.

- `prepare_argv(argv)`: veRL launch scripts write `+key=value` for keys their yaml lacks (and
  hybridrl's yaml may have) and plain `key=value` for keys of theirs that hybridrl's yaml may
  lack; both become Hydra's `++key=value` (set or add), so the typed schema, not Hydra's
  struct flag, decides and an unknown key gets hybridrl's one-line "did you mean" error.
- `check_startup(cfg, explicit_keys)`: the typed schema merge, start-up validation and the
  driver-side per-rank batch sizes. `scripts/verl_examples.py` runs veRL's scripts through it.
- `load_for_cli(cfg)`: the same for the command line: a config error prints one line (key,
  value, fix) and exits 1 without a traceback; `HYDRA_FULL_ERROR=1` re-raises it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable

from hybridrl import algos
from hybridrl.config.megatron import resolve_fused_kernels, validate_mtp
from hybridrl.trainer.ppo.config import PPO_KEYS_DOC, ConfigError, PPOConfig, load_config
from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes, normalize_critic_batch_sizes
from hybridrl.workers.parallel_dims import ParallelDims

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")


def prepare_argv(argv: list[str]) -> list[str]:
    """Rewrite the overrides of a command line (`argv[0]` untouched) to Hydra's `++key=value`.

    Flags (`--config-name`, `-m`...), deletions (`~key`), `++` overrides and Hydra's own
    `hydra.*` keys are kept as they are.
    """
    out = argv[:1]
    for a in argv[1:]:
        if a.startswith(("-", "~", "++")) or "=" not in a or a.lstrip("+").startswith("hydra."):
            out.append(a)
        else:
            out.append("++" + a.lstrip("+"))
    return out


def override_key(override: str) -> str:
    """'++a.b=1' -> 'a.b'."""
    return override.split("=", 1)[0].lstrip("+~")


def hydra_explicit_keys() -> set[str] | None:
    """The keys given on this run's command line (None outside a Hydra app)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return {override_key(o) for o in HydraConfig.get().overrides.task}
    except (ImportError, ValueError):
        return None


def set_by_user(key: str, explicit_keys: set[str] | None) -> bool:
    """Whether the user set `key` on the command line (unknown: False, unlike the micro-batch rule)."""
    return explicit_keys is not None and key in explicit_keys


def check_startup(
    cfg,
    explicit_keys: Iterable[str] | None = None,
    mode_stage: Callable[[PPOConfig], int | None] | None = None,
    keys_doc: str = PPO_KEYS_DOC,
) -> PPOConfig:
    """Load and validate `cfg` and derive the per-rank batch sizes; raises ConfigError.

    The one config stage of main_ppo and main_async (main_async passes its async_training.*
    derivations and checks as `mode_stage`, see `config.run_config_stage`).

    Args:
        cfg: the composed config (DictConfig or dict).
        explicit_keys: keys the user set; a default micro-batch size that does not fit a small
            mini-batch is only adapted when its key is not among them (None: all keys explicit).
        mode_stage: the trainer mode's derivations and checks, run before the whole-tree validation.
        keys_doc: the yaml named in unknown-key errors.
    """
    explicit_keys = set(explicit_keys) if explicit_keys is not None else None
    config = load_config(cfg, explicit_keys=explicit_keys, mode_stage=mode_stage, keys_doc=keys_doc)
    arr = config.actor_rollout_ref
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    try:
        arr.model.validate()
        key = "actor_rollout_ref.model"
        resolve_fused_kernels(
            arr.model, arr.actor.strategy, key, set_by_user(f"{key}.use_fused_kernels", explicit_keys)
        )
        validate_mtp(arr.model.mtp, arr.actor.strategy, key, arr.rollout, arr.actor.megatron)
        actor_ranks = ParallelDims.for_role(world, arr.actor, "actor_rollout_ref.actor").data_ranks
        normalize_actor_batch_sizes(arr.actor, rollout_n=arr.rollout.n, dp_size=actor_ranks)
        if algos.estimator_needs_critic(config.algorithm.adv_estimator):
            resolve_fused_kernels(
                config.critic.model,
                config.critic.strategy,
                "critic.model",
                set_by_user("critic.model.use_fused_kernels", explicit_keys),
            )
            critic_ranks = ParallelDims.for_role(world, config.critic, "critic").data_ranks
            normalize_critic_batch_sizes(config.critic, dp_size=critic_ranks, rollout_n=arr.rollout.n)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return config


def load_for_cli(cfg, load: Callable[..., PPOConfig] = check_startup, explicit_keys=None) -> PPOConfig:
    """`load(cfg, explicit_keys)` (check_startup, or main_async's loader) for a command line: one
    message and exit status 1 on a config error. explicit_keys None: this Hydra run's overrides."""
    try:
        return load(cfg, explicit_keys if explicit_keys is not None else hydra_explicit_keys())
    except ConfigError as e:
        exit_with_config_error(e)


def exit_with_config_error(e: Exception) -> None:
    """Print `e` as one line and exit 1; with HYDRA_FULL_ERROR=1 re-raise it (full traceback)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise e
    print(f"ConfigError: {e}", file=sys.stderr)
    sys.exit(1)
