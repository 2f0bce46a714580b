"""Per-rank batch sizes of the training roles, derived once on the driver from their configs.

`normalize_actor_batch_sizes` / `normalize_critic_batch_sizes` turn veRL's global sizes
(`ppo_mini_batch_size` in prompts over all ranks, `*_micro_batch_size_per_gpu` per rank, Ulysses
groups sharing rows) into a frozen `PerRankBatchSizes`, or raise a ValueError naming the key and
the fix. The config classes themselves are in `hybridrl.config.roles`, `PerRankBatchSizes` in
`hybridrl.config.batch`.
"""

from __future__ import annotations

from hybridrl import algos
from hybridrl.config.batch import PerRankBatchSizes
from hybridrl.config.roles import (
    ACTOR_KEY,
    CHECKPOINT_CONTENTS,
    CRITIC_KEY,
    LR_SCHEDULER_TYPES,
    ActorConfig,
    CheckpointConfig,
    CriticConfig,
    OptimConfig,
)


def _check_common(key: str, *, strategy: str, loss_agg_mode: str, ulysses: int, epochs: int) -> None:
    from hybridrl.engine.base import all_spellings

    if strategy not in all_spellings():
        raise ValueError(f"{key}.strategy={strategy!r} is not supported; use one of {all_spellings()}")
    if int(ulysses) != ulysses or ulysses < 1:
        raise ValueError(f"{key}.ulysses_sequence_parallel_size={ulysses}: use an integer >= 1")
    modes = algos.list_loss_agg_modes()  # the registry, with the user's external_lib modes
    if loss_agg_mode not in modes:
        raise ValueError(f"{key}.loss_agg_mode={loss_agg_mode!r} is not one of {modes}")
    if epochs < 1:
        raise ValueError(f"{key}.ppo_epochs must be >= 1, got {epochs}")


def _check_optim(key: str, optim: OptimConfig) -> None:
    if optim.scheduler_type not in LR_SCHEDULER_TYPES:
        raise ValueError(
            f"{key}.optim.lr_scheduler_type={optim.scheduler_type!r} is not one of {LR_SCHEDULER_TYPES}"
        )
    if len(optim.betas) != 2:
        raise ValueError(f"{key}.optim.betas must hold two numbers, got {optim.betas}")


def _check_checkpoint(key: str, ckpt: CheckpointConfig) -> None:
    for name in ("save_contents", "load_contents"):
        bad = [c for c in getattr(ckpt, name) if c not in CHECKPOINT_CONTENTS]
        if bad:
            raise ValueError(
                f"{key}.checkpoint.{name} has unknown entries {bad}; use a subset of {CHECKPOINT_CONTENTS}"
            )


def sp_data_parallel_size(key: str, ranks: int, sp: int) -> int:
    """Data-parallel groups of a role with Ulysses SP: its `ranks` / `sp` (the ranks of a group share
    their rows); raises ValueError naming the key when sp does not divide the ranks."""
    if ranks % sp:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ValueError(
            f"{key}.ulysses_sequence_parallel_size={sp} does not divide the {ranks} data-parallel ranks; "
            f"use one of {divisors}"
        )
    return ranks // sp


def _per_rank(
    key: str,
    *,
    mini: int,
    micro: int | None,
    use_dynamic_bsz: bool,
    max_token_len: int,
    rollout_n: int,
    dp_size: int,
) -> tuple[int, int | None]:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if rollout_n < 1:
        raise ValueError(f"actor_rollout_ref.rollout.n must be >= 1, got {rollout_n}")
    if mini < 1:
        raise ValueError(f"{key}.ppo_mini_batch_size must be >= 1, got {mini}")
    rows = mini * rollout_n
    if rows % dp_size:
        raise ValueError(
            f"{key}.ppo_mini_batch_size * rollout.n = {mini} * {rollout_n} = {rows} rows cannot be split evenly "
            f"over {dp_size} data-parallel ranks; make {key}.ppo_mini_batch_size * rollout.n a multiple of {dp_size}"
        )
    per_rank = rows // dp_size
    if use_dynamic_bsz:
        if max_token_len < 1:
            raise ValueError(f"{key}.ppo_max_token_len_per_gpu must be >= 1 with use_dynamic_bsz=True")
        return per_rank, None
    if micro is None:
        raise ValueError(
            f"{key}.ppo_micro_batch_size_per_gpu is not set; set it (e.g. {key}.ppo_micro_batch_size_per_gpu=8) "
            f"or set {key}.use_dynamic_bsz=True"
        )
    if micro < 1 or per_rank % micro:
        raise ValueError(
            f"{key}.ppo_micro_batch_size_per_gpu={micro} does not divide the per-rank mini-batch of {per_rank} rows "
            f"(ppo_mini_batch_size * rollout.n / dp_size = {mini} * {rollout_n} / {dp_size}); pick a divisor of {per_rank}"
        )
    return per_rank, micro


def _update_batch_sizes(
    key: str,
    config: ActorConfig | CriticConfig,
    *,
    rollout_n: int,
    dp_size: int,
    forward_micro: int | None,
    forward_max_token_len: int,
) -> PerRankBatchSizes:
    """The checks and per-rank sizes the actor and the critic update share (their keys have the
    same names under `key`). forward_micro: the forward passes' micro-batch (None: the update's)."""
    _check_common(
        key,
        strategy=config.strategy,
        loss_agg_mode=config.loss_agg_mode,
        ulysses=config.ulysses_sequence_parallel_size,
        epochs=config.ppo_epochs,
    )
    _check_optim(key, config.optim)
    _check_checkpoint(key, config.checkpoint)
    if config.shuffle and config.data_loader_seed is None:
        raise ValueError(f"{key}.shuffle=True needs {key}.data_loader_seed (e.g. 42)")
    dp_size = sp_data_parallel_size(key, dp_size, config.ulysses_sequence_parallel_size)
    per_rank, micro = _per_rank(
        key,
        mini=config.ppo_mini_batch_size,
        micro=config.ppo_micro_batch_size_per_gpu,
        use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len=config.ppo_max_token_len_per_gpu,
        rollout_n=rollout_n,
        dp_size=dp_size,
    )
    forward_micro = forward_micro or micro
    if not config.use_dynamic_bsz and forward_micro is not None and forward_micro < 1:
        raise ValueError(f"{key}.forward_micro_batch_size_per_gpu must be >= 1, got {forward_micro}")
    return PerRankBatchSizes(
        mini_batch_size=per_rank,
        micro_batch_size=micro,
        use_dynamic_bsz=config.use_dynamic_bsz,
        max_token_len=config.ppo_max_token_len_per_gpu,
        forward_micro_batch_size=forward_micro,
        forward_max_token_len=forward_max_token_len,
        epochs=config.ppo_epochs,
        shuffle=config.shuffle,
        seed=config.data_loader_seed,
        dp_size=dp_size,
        rollout_n=rollout_n,
    )


def normalize_actor_batch_sizes(config: ActorConfig, *, rollout_n: int, dp_size: int) -> PerRankBatchSizes:
    """Validate `config` and derive the per-rank sizes of the PPO update.

    Args:
        config: the actor config (not modified).
        rollout_n: responses per prompt (`actor_rollout_ref.rollout.n`).
        dp_size: number of data-parallel ranks of the actor; with Ulysses SP the batch is split
            over dp_size / ulysses_sequence_parallel_size groups (the result's dp_size), and the
            per-rank sizes are per group, as in veRL.

    Raises:
        ValueError: naming the key and the fix when sizes do not divide or a value is unsupported.
    """
    if config.use_kl_loss and config.kl_loss_coef < 0:
        raise ValueError(f"{ACTOR_KEY}.kl_loss_coef must be >= 0, got {config.kl_loss_coef}")
    return _update_batch_sizes(
        ACTOR_KEY,
        config,
        rollout_n=rollout_n,
        dp_size=dp_size,
        forward_micro=None,
        forward_max_token_len=config.ppo_max_token_len_per_gpu,
    )


def normalize_critic_batch_sizes(
    config: CriticConfig, *, dp_size: int, rollout_n: int | None = None
) -> PerRankBatchSizes:
    """Validate `config` and derive the per-rank sizes of the critic update and forward passes.

    Args:
        config: the critic config (not modified).
        dp_size: number of data-parallel ranks of the critic (with Ulysses SP: split over
            dp_size / ulysses_sequence_parallel_size groups, see `normalize_actor_batch_sizes`).
        rollout_n: responses per prompt; defaults to `critic.rollout_n`.

    Raises:
        ValueError: naming the key and the fix when sizes do not divide or a value is unsupported.
    """
    config.model.validate(f"{CRITIC_KEY}.model")
    return _update_batch_sizes(
        CRITIC_KEY,
        config,
        rollout_n=config.rollout_n if rollout_n is None else rollout_n,
        dp_size=dp_size,
        forward_micro=config.forward_micro_batch_size_per_gpu,
        forward_max_token_len=config.forward_max_token_len_per_gpu,
    )
