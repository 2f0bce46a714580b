"""`async_training.*`: the asynchronous (AReaL-style) off-policy mode, its loading and validation.

The keys AReaL users know (rollout.* / actor.* in AReaL) map onto this section; docs/async.md has
the table. Counts are in *groups* (one prompt with its rollout.n responses), as AReaL counts
prompts:

    max_concurrent_rollouts   groups committed but not finished (queued or generating);
                              null -> (max_head_offpolicyness + 1) * consumer_batch_size
    queue_size                bound of the input and output queues; null -> max_concurrent_rollouts * 16
    consumer_batch_size       groups per trainer step; null -> data.train_batch_size (must equal it)
    max_head_offpolicyness    eta: generation pauses when it would run more than eta versions ahead;
                              0 is synchronous training
    recompute_logprob         the trainer recomputes old log-probs (the proximal policy) before each
                              update; false uses the rollout engine's (behaviour) log-probs
    use_decoupled_loss        AReaL's decoupled PPO loss (policy loss 'decoupled')
    behave_imp_weight_cap     drop tokens whose behaviour importance weight exceeds this

and the placement of the rollout workers (their own Ray resource pool):

    rollout_nnodes, rollout_n_gpus_per_node   rollout slots (one worker process each; CPU slots on
                                              CPU); with rollout.tensor_model_parallel_size = N,
                                              every N slots of a node form one engine
    rollout_cpus_per_worker                   CPU cores per rollout slot
    chunk_size                                groups per generate call; null -> consumer_batch_size
                                              // rollout engines (at least 1)
    partial_rollout                           abort generation at each weight update and continue
                                              each response from its prefix (HF engine)
    weight_update_mode                        object_store (Ray object store) or collective (a
                                              broadcast over a gloo/NCCL group of trainer rank 0 and
                                              the rollout workers; weight_sync/publisher.py)
    weight_update_timeout_s                   deadline of that group's creation and of each broadcast

The training workers use trainer.nnodes x trainer.n_gpus_per_node slots as in synchronous mode.

`load_async_config(cfg)` runs main_ppo's config stage on `AsyncPPOConfig` (the PPO tree plus this
section; hybridrl/trainer/ppo/config_stage.py `check_startup`, the same function main_ppo calls),
with `async_stage` (`validate_async_config`, then `derive_async_config`) before the whole-tree
validation.
"""

from __future__ import annotations

from omegaconf import DictConfig

from hybridrl.trainer.async_ppo.rollout_tp import validate_rollout_tp
from hybridrl.trainer.ppo.config import PPO_KEYS_DOC, PPOConfig
from hybridrl.trainer.ppo.sections import AsyncTrainingConfig
from hybridrl.utils.config_loader import ConfigError

__all__ = [
    "AsyncPPOConfig",
    "AsyncTrainingConfig",
    "async_stage",
    "derive_async_config",
    "load_async_config",
    "n_rollout_engines",
    "n_rollout_workers",
    "validate_async_config",
]

KEY = "async_training"


# The PPO tree carries the section (ppo_trainer.yaml lists its keys); main_ppo ignores it.
AsyncPPOConfig = PPOConfig


def n_rollout_workers(config: AsyncPPOConfig) -> int:
    """Rollout processes (slots): rollout_nnodes x rollout_n_gpus_per_node."""
    at = config.async_training
    return at.rollout_nnodes * at.rollout_n_gpus_per_node


def n_rollout_engines(config: AsyncPPOConfig) -> int:
    """Rollout engines: the slots / rollout TP (each engine's TP ranks are slots of one node)."""
    return n_rollout_workers(config) // config.actor_rollout_ref.rollout.tensor_model_parallel_size


def load_async_config(cfg: DictConfig | dict | list[str] | None = None, explicit_keys=None) -> AsyncPPOConfig:
    """main_ppo's config stage (`config_stage.check_startup`: veRL's spellings, refused keys,
    deprecated micro-batch keys, start-up validation) with the async section as its mode stage;
    returns a typed AsyncPPOConfig. explicit_keys: as in check_startup (None: every key is set)."""
    from hybridrl.trainer.ppo.config_stage import check_startup

    return check_startup(
        cfg, explicit_keys, mode_stage=async_stage, keys_doc=f"{PPO_KEYS_DOC} (async_training: docs/async.md)"
    )


def async_stage(config: AsyncPPOConfig) -> int:
    """The async section's checks of the user's own values, then its derived values. Returns the
    ranks the whole-tree check divides rollout TP into (one node's rollout slots)."""
    if config.trainer.log_floors:  # generation overlaps the update here: no per-phase floor to compare with
        raise ConfigError(
            "trainer.log_floors=true is not supported by main_async yet; use main_ppo or set it false"
        )
    validate_async_config(config)
    derive_async_config(config)
    return config.async_training.rollout_n_gpus_per_node


def validate_async_config(config: AsyncPPOConfig) -> None:
    """Check the async section against the rest of the tree; ConfigError names the key and the fix."""
    at, d = config.async_training, config.data
    arr, algo = config.actor_rollout_ref, config.algorithm
    if at.max_head_offpolicyness < 0:
        raise ConfigError(
            f"{KEY}.max_head_offpolicyness={at.max_head_offpolicyness} must be >= 0 (0 = synchronous)"
        )
    if at.consumer_batch_size is not None and at.consumer_batch_size != d.train_batch_size:
        raise ConfigError(
            f"{KEY}.consumer_batch_size={at.consumer_batch_size} differs from data.train_batch_size="
            f"{d.train_batch_size}; the trainer's batch sizes follow data.train_batch_size, so set "
            f"data.train_batch_size instead (and leave {KEY}.consumer_batch_size null)"
        )
    for name in ("max_concurrent_rollouts", "queue_size", "chunk_size"):
        value = getattr(at, name)
        if value is not None and value < 1:
            raise ConfigError(f"{KEY}.{name}={value} must be >= 1 (or null for the default)")
    for name in ("rollout_nnodes", "rollout_n_gpus_per_node"):
        if getattr(at, name) < 1:
            raise ConfigError(f"{KEY}.{name}={getattr(at, name)} must be >= 1")
    if at.rollout_cpus_per_worker <= 0:
        raise ConfigError(f"{KEY}.rollout_cpus_per_worker={at.rollout_cpus_per_worker} must be > 0")
    if at.behave_imp_weight_cap is not None and at.behave_imp_weight_cap <= 0:
        raise ConfigError(
            f"{KEY}.behave_imp_weight_cap={at.behave_imp_weight_cap} must be > 0 (or null: no cap)"
        )
    if at.use_decoupled_loss and not at.recompute_logprob:
        raise ConfigError(
            f"{KEY}.use_decoupled_loss=true needs {KEY}.recompute_logprob=true: the decoupled loss centres the "
            "trust region on the proximal policy, whose log-probs the trainer recomputes"
        )
    mode = arr.actor.policy_loss.loss_mode
    if at.use_decoupled_loss and mode not in ("vanilla", "decoupled"):
        raise ConfigError(
            f"{KEY}.use_decoupled_loss=true sets actor_rollout_ref.actor.policy_loss.loss_mode=decoupled, but it "
            f"is {mode!r}; set {KEY}.use_decoupled_loss=false to keep {mode!r}"
        )
    _validate_partial_rollout(config)
    _validate_weight_update(config)
    if arr.rollout.enable_rollout_routing_replay:
        raise ConfigError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true (MoE routing replay R3) records routing "
            "in main_ppo's rollout only; the asynchronous rollout workers do not carry it: use "
            "python -m hybridrl.trainer.main_ppo, or router_replay.mode=R2 (docs/moe.md)"
        )
    if algo.filter_groups.enable and config.reward_model.enable:
        raise ConfigError(
            "algorithm.filter_groups.enable=true (DAPO dynamic sampling) with reward_model.enable=true is not "
            "supported in asynchronous mode: groups are filtered as chunks finish, and a reward model scores "
            "on the trainer's path; use a rule-based reward or python -m hybridrl.trainer.main_ppo"
        )
    validate_rollout_tp(config)


def _validate_weight_update(config: AsyncPPOConfig) -> None:
    from hybridrl.weight_sync.collective import MODES

    at = config.async_training
    if at.weight_update_mode not in MODES:
        raise ConfigError(
            f"{KEY}.weight_update_mode={at.weight_update_mode!r}: use one of {MODES} (object_store: through the Ray "
            "object store; collective: a broadcast from trainer rank 0 to every rollout worker)"
        )
    if not at.weight_update_timeout_s > 0:
        raise ConfigError(
            f"{KEY}.weight_update_timeout_s={at.weight_update_timeout_s:g} must be > 0 (seconds the collective "
            "group's creation and each broadcast may take)"
        )


def _validate_partial_rollout(config: AsyncPPOConfig) -> None:
    from hybridrl.agent.runner import agent_loops_configured
    from hybridrl.rollout import get_rollout_class, list_rollouts

    rollout = config.actor_rollout_ref.rollout
    if not config.async_training.partial_rollout:
        return
    try:
        engine = get_rollout_class(rollout.name)
    except ValueError as err:  # an unknown name: the registry's message names the known ones
        raise ConfigError(str(err)) from None
    if not engine.interruptible:
        able = [n for n in list_rollouts() if get_rollout_class(n).interruptible]
        raise ConfigError(
            f"{KEY}.partial_rollout=true needs an engine that can be interrupted between decode steps: "
            f"actor_rollout_ref.rollout.name={' or '.join(able)} (got {rollout.name!r}); "
            f"or set {KEY}.partial_rollout=false"
        )
    if agent_loops_configured(rollout):
        raise ConfigError(
            f"{KEY}.partial_rollout=true does not support the agent loops (actor_rollout_ref.rollout.multi_turn / "
            f"agent): a multi-turn trajectory cannot be resumed from a token prefix yet; set {KEY}.partial_rollout=false"
        )


def derive_async_config(config: AsyncPPOConfig) -> None:
    """Fill the defaults that depend on other keys and point the actor at the decoupled loss.

    Runs once on the driver before any worker starts: consumer_batch_size, max_concurrent_rollouts,
    queue_size and chunk_size get their values; use_decoupled_loss sets the actor's policy loss
    to 'decoupled' with behave_imp_weight_cap; the rollout returns its log-probs (behaviour
    policy) whenever the loss or the old log-probs need them.
    """
    at, arr = config.async_training, config.actor_rollout_ref
    b = config.data.train_batch_size
    at.consumer_batch_size = b
    if at.max_concurrent_rollouts is None:
        at.max_concurrent_rollouts = (at.max_head_offpolicyness + 1) * b
    if at.queue_size is None:
        at.queue_size = at.max_concurrent_rollouts * 16
    if at.chunk_size is None:
        at.chunk_size = max(1, b // n_rollout_engines(config))
    if at.use_decoupled_loss:
        arr.actor.policy_loss.loss_mode = "decoupled"
        arr.actor.policy_loss.behave_imp_weight_cap = at.behave_imp_weight_cap
    if at.use_decoupled_loss or not at.recompute_logprob or arr.actor.policy_loss.loss_mode == "decoupled":
        arr.rollout.calculate_log_probs = True
