"""The whole PPO config tree (veRL key names), its loading and its start-up validation.

`load_config(cfg)` merges the Hydra/OmegaConf config onto the typed schema (so an unknown key
fails at once, naming the key), resolves interpolations, turns it into dataclasses and runs
`validate_config`, which checks everything that can be checked before any actor starts: batch
sizes that do not divide, an estimator that needs a critic without one, missing files. Every
error is one line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig

from hybridrl import algos
from hybridrl.compat.verl_misc import apply_verl_misc
from hybridrl.config.roles import ActorConfig, CriticConfig, ModelConfig, RefConfig, RewardModelConfig
from hybridrl.config.rollout import RolloutConfig
from hybridrl.trainer.ppo.config_checks import run_config_checks
from hybridrl.trainer.ppo.prefix_auto import resolve_prefix_grouper
from hybridrl.trainer.ppo.registry_checks import validate_registered_choices
from hybridrl.trainer.ppo.reward_kwargs import RewardManagerSection
from hybridrl.trainer.ppo.sections import (
    AlgorithmConfig,
    AsyncTrainingConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    RayKwargsConfig,
    RewardManagerKwargs,
    TrainerConfig,
)
from hybridrl.trainer.ppo.startup_checks import check_data_lengths, check_startup_values
from hybridrl.utils import plugins
from hybridrl.utils.config_loader import ConfigError, load_structured, warn_once
from hybridrl.utils.deadlines import check_keys as check_deadline_keys
from hybridrl.utils.profiler import GlobalProfilerConfig
from hybridrl.workers.distillation_config import DistillationConfig, validate_distillation
from hybridrl.workers.parallel_dims import ParallelDims


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # veRL's key; only true is accepted (always colocated)
    nccl_timeout: int = 600  # seconds; the workers' process-group timeout
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_manager_kwargs: RewardManagerKwargs = field(default_factory=RewardManagerKwargs)
    reward_manager: RewardManagerSection = field(default_factory=RewardManagerSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    distillation: DistillationConfig = field(
        default_factory=DistillationConfig
    )  # veRL's on-policy distillation
    # veRL's newest engine switch for actor, ref and critic ("dp" / "fsdp", "megatron"); see ppo/model_engine.py
    model_engine: str | None = None


PPO_KEYS_DOC = "hybridrl/trainer/config/ppo_trainer.yaml"


def load_config(
    cfg: DictConfig | dict | list[str] | None = None,
    explicit_keys=None,
    mode_stage: Callable[[PPOConfig], int | None] | None = None,
    keys_doc: str = PPO_KEYS_DOC,
) -> PPOConfig:
    """Merge `cfg` onto the schema, resolve it and run `run_config_stage`; returns a typed `PPOConfig`.

    explicit_keys: the keys the user set (None: every key counts as set); see
    `config_checks.run_config_checks` (defaults that do not fit a small batch are adapted).
    mode_stage / keys_doc: see `run_config_stage`; keys_doc is named in unknown-key errors.
    """
    from omegaconf import OmegaConf

    from hybridrl.compat.verl_layout import apply_verl_layout
    from hybridrl.utils.config_loader import as_node, schema_node

    node = OmegaConf.create(as_node(cfg))  # a copy: the caller's config is not changed
    explicit_keys = apply_verl_layout(node, explicit_keys, schema_node(PPOConfig))
    # The user's modules first: the choices below are checked against registries they may extend.
    plugins.import_external_libs(plugins.external_lib_entries(node))
    try:
        config: PPOConfig = load_structured(PPOConfig, node, keys_doc)
    except ConfigError:
        raise
    except ValueError as e:  # a section's own check (__post_init__) failed
        raise ConfigError(str(e)) from None
    run_config_stage(config, explicit_keys, mode_stage)
    return config


def run_config_stage(
    config: PPOConfig, explicit_keys=None, mode_stage: Callable[[PPOConfig], int | None] | None = None
) -> None:
    """The config stage main_ppo and main_async share (mutates `config`): derived values, veRL's
    spellings (refused keys, deprecated micro-batch keys, small-batch defaults), veRL's algorithm
    keys, then the trainer mode's own derivations (`mode_stage`, e.g. main_async's
    async_training.*), then the whole-tree validation. A mode stage that returns an int names
    the ranks the rollout's tensor parallelism is checked against (main_async: one node's rollout
    slots); None: the training slots, as main_ppo's colocated engines."""
    derive_config(config, explicit_keys)
    run_config_checks(config, explicit_keys)
    apply_verl_misc(config, explicit_keys)
    rollout_world = mode_stage(config) if mode_stage is not None else None
    validate_config(config, rollout_world)


def derive_config(config: PPOConfig, explicit_keys=None) -> None:
    """Fill the values that default to other keys (veRL's `${...}` links, `model_engine`) before validation."""
    from hybridrl.trainer.ppo.model_engine import apply_model_engine

    apply_model_engine(config, explicit_keys)
    check_data_lengths(config.data)  # before the rollout's lengths are derived from them
    rollout = config.actor_rollout_ref.rollout
    if rollout.prompt_length is None or rollout.prompt_length <= 0:
        rollout.prompt_length = config.data.max_prompt_length
    if rollout.response_length is None or rollout.response_length <= 0:
        rollout.response_length = config.data.max_response_length
    config.trainer.cpus_per_worker = _cpus_per_worker(config.trainer)
    _check_backend(config.trainer)
    _absolute_checkpoint_paths(config.trainer)


def _absolute_checkpoint_paths(tr) -> None:
    """The checkpoint root (and resume path) as absolute paths, resolved here on the driver: the
    workers get them as they are, whatever their own working directory is."""
    tr.default_local_dir = os.path.abspath(os.path.expanduser(str(tr.default_local_dir)))
    if tr.resume_from_path:
        tr.resume_from_path = os.path.abspath(os.path.expanduser(str(tr.resume_from_path)))


def _check_backend(tr) -> None:
    from hybridrl.single_controller.backend import resolve_backend

    try:  # names and slot count only; 'auto' is decided when the workers start
        resolve_backend(tr.backend, slots=tr.nnodes * tr.n_gpus_per_node, use_gpu=False)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _cpus_per_worker(tr) -> int:
    """`trainer.cpus_per_worker` as a number: 'auto' shares this machine's CPUs among a node's slots
    (with RAY_ADDRESS the driver's machine stands for every node: set the number on mixed clusters)."""
    from hybridrl.utils.cpus import resolve_cpus_per_worker

    try:
        return resolve_cpus_per_worker(tr.cpus_per_worker, slots=max(1, tr.n_gpus_per_node))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def n_slots(config: PPOConfig) -> int:
    return config.trainer.nnodes * config.trainer.n_gpus_per_node


def validate_config(config: PPOConfig, rollout_world: int | None = None) -> None:
    """Check the config as a whole; raise ConfigError naming the key and the fix (rollout_world:
    the ranks rollout TP must divide; None: the training slots)."""
    arr, algo = config.actor_rollout_ref, config.algorithm
    world = n_slots(config)
    if world < 1:
        raise ConfigError("trainer.nnodes * trainer.n_gpus_per_node must be >= 1")
    _validate_choices(config)
    check_startup_values(config)
    n = arr.rollout.n
    if n < 1:
        raise ConfigError("actor_rollout_ref.rollout.n must be >= 1")
    _check_group_size(algo.adv_estimator, n)
    try:
        arr.actor.validate_policy_loss()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _validate_ulysses(config, world)
    _validate_routing_replay(config)
    _check_optimizer_overrides(config)
    _check_lora_init(config)
    _check_rollout_engine_parallel(
        config.actor_rollout_ref.rollout, world if rollout_world is None else rollout_world
    )
    resolve_prefix_grouper(config)  # true / false as given; auto decided and printed (prefix_auto.py)
    _validate_actor_batches(config, world)
    if algos.estimator_needs_critic(algo.adv_estimator):
        _validate_critic(config, world)
    if algo.use_kl_in_reward and arr.actor.use_kl_loss:
        print(
            "[hybridrl] warning: both algorithm.use_kl_in_reward and actor.use_kl_loss are on (KL counted twice)"
        )
    _validate_rollout_parallel(config, world if rollout_world is None else rollout_world)
    _validate_paths(config)
    validate_distillation(config.distillation, arr.rollout, arr.actor)
    if config.reward_model.enable and not config.reward_model.model.path:
        raise ConfigError(
            "reward_model.enable=True needs reward_model.model.path (a sequence-classification model)"
        )
    if algo.filter_groups.enable and n < 2:
        raise ConfigError("algorithm.filter_groups.enable=True needs actor_rollout_ref.rollout.n >= 2")


def _validate_routing_replay(config: PPOConfig) -> None:
    """MoE routing replay (docs/moe.md): the modes, what R3 needs from the rollout, where it runs."""
    arr = config.actor_rollout_ref
    r = arr.rollout
    modes = {}
    for role in ("actor", "ref"):
        section = getattr(arr, role)
        key = f"actor_rollout_ref.{role}"
        try:
            section.router_replay.validate(key)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        modes[role] = section.router_replay.mode
        if section.router_replay.mode == "disabled":
            continue
        if section.strategy == "megatron" and section.router_replay.mode == "R2" and role == "actor":
            m = section.megatron
            if (
                m.pipeline_model_parallel_size > 1
                or m.context_parallel_size > 1
                or (m.tensor_model_parallel_size > 1 and m.sequence_parallel)
            ):
                raise ConfigError(
                    f"{key}.router_replay.mode=R2 records the old-log-prob pass's routing, which the Megatron "
                    "engine does with pipeline_model_parallel_size=1, context_parallel_size=1 and no sequence "
                    "parallelism (one rank sees every token); use mode=R3 (replay only) or that layout"
                )
    if "R3" in modes.values() and not r.enable_rollout_routing_replay:
        raise ConfigError(
            "router_replay.mode=R3 replays the experts the rollout routed each token to: set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true (or use mode=R2)"
        )
    if r.enable_rollout_routing_replay:
        _check_rollout_records_routing(r)
        if modes["actor"] == "R2":
            raise ConfigError(
                "actor_rollout_ref.actor.router_replay.mode=R2 records the routing in the old-log-prob pass; "
                "the rollout's routing (rollout.enable_rollout_routing_replay=true) is for R3: set mode=R3 "
                "or enable_rollout_routing_replay=false"
            )


def _check_lora_init(config: PPOConfig) -> None:
    """`model.lora_init_a` (veRL's model.lora.lora_A_init_method) is read by the Megatron engine's LoRA."""
    for key, model, strategy in (
        ("actor_rollout_ref.model", config.actor_rollout_ref.model, config.actor_rollout_ref.actor.strategy),
        ("critic.model", config.critic.model, config.critic.strategy),
    ):
        if model.lora_init_a is not None and strategy != "megatron":
            raise ConfigError(
                f"{key}.lora_init_a={model.lora_init_a!r} (model.lora.lora_A_init_method) sets the Megatron LoRA's "
                f"A init; strategy={strategy} uses PEFT's own init: drop it or use strategy=megatron"
            )


def _check_optimizer_overrides(config: PPOConfig) -> None:
    """veRL's `optim.override_optimizer_config` sets megatron-core's OptimizerConfig: Megatron roles only."""
    roles = (("actor_rollout_ref.actor", config.actor_rollout_ref.actor), ("critic", config.critic))
    for key, section in roles:
        if section.megatron.override_optimizer_config and section.strategy != "megatron":
            raise ConfigError(
                f"{key}.optim.override_optimizer_config sets fields of Megatron's OptimizerConfig, but "
                f"{key}.strategy={section.strategy} trains with torch's AdamW: drop it or use strategy=megatron"
            )


def _check_rollout_engine_parallel(r, world: int) -> None:
    """veRL's rollout `data_parallel_size` / `expert_parallel_size` / `moe_tensor_parallel_size` (its
    RolloutConfig's rules): expert parallelism inside one vLLM / SGLang engine, EP = TP x DP."""
    key = "actor_rollout_ref.rollout"
    tp, dp, ep, moe_tp = (
        r.tensor_model_parallel_size, r.data_parallel_size, r.expert_parallel_size, r.moe_tensor_parallel_size
    )  # fmt: skip
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("data_parallel_size", dp),
        ("expert_parallel_size", ep),
        ("moe_tensor_parallel_size", moe_tp),
    ):
        if value < 1:
            raise ConfigError(f"{key}.{name}={value} must be >= 1")
    if moe_tp > 1:
        raise ConfigError(
            f"{key}.moe_tensor_parallel_size={moe_tp}: TensorRT-LLM's MoE tensor parallelism (veRL takes it with "
            "rollout.name=trtllm only); hybridrl has no TensorRT-LLM rollout. Leave it at 1: the engine's "
            "tensor_model_parallel_size (and expert_parallel_size) split the experts"
        )
    if (dp > 1 or ep > 1) and r.name not in ("vllm", "sglang"):
        raise ConfigError(
            f"{key}.data_parallel_size={dp} / expert_parallel_size={ep} are vLLM / SGLang engine settings; "
            f"rollout.name={r.name} runs one model copy per rank: leave them at 1"
        )
    if ep > 1 and ep != tp * dp:
        raise ConfigError(
            f"{key}.expert_parallel_size={ep} must equal tensor_model_parallel_size * data_parallel_size = {tp * dp} "
            "(the engine spreads the experts over all its ranks, veRL's rule)"
        )
    if dp > 1 and ep > 1:
        raise ConfigError(
            f"{key}.data_parallel_size={dp} with expert_parallel_size={ep}: one engine whose experts span "
            f"{dp} data-parallel groups of {tp} ranks is not implemented (hybridrl runs one engine per "
            f"{tp} ranks). Use expert_parallel_size=tensor_model_parallel_size with data_parallel_size=1"
        )
    if dp > 1 and world % (tp * dp):  # dp == 1: the rollout's TP check names the sizes that fit
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"{key}.tensor_model_parallel_size * data_parallel_size = {tp * dp} must divide the {world} rollout "
            f"ranks; choose sizes whose product is one of {fits}"
        )
    if dp > 1:
        warn_once(
            f"{key}.data_parallel_size={dp} without expert parallelism: {dp} data-parallel copies of a "
            f"{tp}-rank engine, which is what hybridrl's rollout replicas are ({world // tp} engines of {tp} ranks)"
        )


def _check_rollout_records_routing(r) -> None:
    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    if r.name not in ("hf", "vllm"):
        raise ConfigError(
            f"{key} with rollout.name={r.name}: this rollout engine does not return the experts it routed to "
            "(the HF and vLLM rollouts do; vLLM on GPUs only, refused when its engine builds on CPU): use "
            "rollout.name=hf or vllm"
        )
    if r.mode != "sync":
        raise ConfigError(f"{key} records routing in the synchronous rollout only: set rollout.mode=sync")


GROUP_ESTIMATORS_WITH_SINGLETONS = (
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "opo",
    "reinforce_plus_plus_baseline",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
)


def _check_group_size(estimator: str, n: int) -> None:
    """Group estimators with rollout.n=1: veRL gives a group of one the baseline 0 (GRPO: std 1), so
    the advantage is the raw score (REINFORCE without a baseline); hybridrl does the same and says so
    once. grpo_passk needs a second response and fails."""
    if n >= 2:
        return
    if estimator == "grpo_passk":
        raise ConfigError(
            "algorithm.adv_estimator=grpo_passk compares each response with the rest of its group, so "
            "actor_rollout_ref.rollout.n must be >= 2 (e.g. actor_rollout_ref.rollout.n=8)"
        )
    if estimator in GROUP_ESTIMATORS_WITH_SINGLETONS:
        warn_once(
            f"algorithm.adv_estimator={estimator} with actor_rollout_ref.rollout.n=1: each group has one "
            "response, so its baseline is 0 (std 1) and the advantage is the raw score, as in veRL; "
            "set rollout.n >= 2 for a group baseline"
        )


def _validate_choices(config: PPOConfig) -> None:
    d, tr = config.data, config.trainer
    validate_registered_choices(config)  # estimator, losses, rollout, engines, ... (after external_lib)
    _check_choice("data.truncation", d.truncation, ["error", "left", "right", "middle"])
    _check_choice("trainer.resume_mode", tr.resume_mode, ["auto", "disable", "resume_path"])
    _check_choice("trainer.device", tr.device, ["auto", "cpu", "cuda"])
    if tr.constant_reward_warn_steps < 0:
        raise ConfigError(
            f"trainer.constant_reward_warn_steps={tr.constant_reward_warn_steps} must be >= 0: the "
            "number of steps in a row with identical rewards before the warning (0 turns it off)"
        )
    check_deadline_keys(tr)


def _validate_actor_batches(config: PPOConfig, world: int) -> None:
    """data.train_batch_size vs actor mini/micro-batches and the data-parallel ranks (all counts must divide).

    As in veRL, a mini-batch is split over the actor's data-parallel ranks (world / (tp * pp * cp)
    for Megatron), not over every rank: the ranks of one model replica see the same rows. Generation
    and the log-prob passes pad a batch that does not split evenly over their replicas.
    """
    d, arr = config.data, config.actor_rollout_ref
    n, mini = arr.rollout.n, arr.actor.ppo_mini_batch_size
    if d.train_batch_size % mini != 0 and mini <= d.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} is not divisible by "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}; make the mini-batch a divisor"
        )
    if mini > d.train_batch_size:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} > data.train_batch_size={d.train_batch_size}; "
            "it counts prompts (before rollout.n), lower it"
        )
    dp = _data_ranks(world, arr.actor, "actor_rollout_ref.actor")
    if (mini * n) % dp != 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n = {mini * n} rows must divide across "
            f"the actor's {dp} data-parallel ranks (trainer.nnodes * trainer.n_gpus_per_node / model-parallel "
            "size); change one of them"
        )
    per_rank_mini = mini * n // max(1, dp // arr.actor.ulysses_sequence_parallel_size)  # per SP group
    micro = arr.actor.ppo_micro_batch_size_per_gpu
    if not arr.actor.use_dynamic_bsz and micro is not None and per_rank_mini % micro != 0:
        raise ConfigError(
            f"per-rank mini-batch {per_rank_mini} (ppo_mini_batch_size*n/data-parallel ranks) is not divisible "
            f"by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}; pick a divisor"
        )


def _validate_ulysses(config: PPOConfig, world: int) -> None:
    """Ulysses SP sizes divide the ranks, run on FSDP's packed path; the colocated reference
    shares the actor's sequence-parallel groups (hybridrl.engine.ulysses)."""
    from hybridrl.engine.ulysses import check_sp_heads, check_sp_layout
    from hybridrl.rollout.parallel import heads_of_model_path

    arr, c = config.actor_rollout_ref, config.critic
    actor_sp, ref_sp = arr.actor.ulysses_sequence_parallel_size, arr.ref.ulysses_sequence_parallel_size
    roles = [
        ("actor_rollout_ref.actor", actor_sp, arr.model.use_remove_padding, arr.actor.strategy),
        ("actor_rollout_ref.ref", ref_sp, arr.model.use_remove_padding, arr.ref.strategy),
    ]
    if algos.estimator_needs_critic(config.algorithm.adv_estimator):
        roles.append(("critic", c.ulysses_sequence_parallel_size, c.model.use_remove_padding, c.strategy))
    paths = {"critic": c.model.path or arr.model.path}
    try:
        for key, sp, packed, strategy in roles:
            check_sp_layout(key, sp, world, use_remove_padding=packed, strategy=strategy)
            if sp > 1:  # the heads, when the model's config can be read here (else the worker checks)
                heads, kv_heads = heads_of_model_path(
                    paths.get(key, arr.model.path), arr.model.trust_remote_code
                )
                if heads is not None:
                    check_sp_heads(key, sp, heads, kv_heads)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if ref_sp != actor_sp and (config.algorithm.use_kl_in_reward or arr.actor.use_kl_loss):
        raise ConfigError(
            f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref_sp} differs from the actor's {actor_sp}: the "
            "reference runs in the actor's processes on its sequence-parallel groups; set them equal (veRL's default)"
        )


def _validate_paths(config: PPOConfig) -> None:
    """Data files and the custom reward file exist; resume_path mode names its folder."""
    d, tr = config.data, config.trainer
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for f in _as_list(files):
            if not os.path.exists(os.path.expanduser(str(f))):
                raise ConfigError(f"{key}: file {f!r} does not exist; fix the path (parquet files)")
    if config.custom_reward_function.path and not os.path.exists(config.custom_reward_function.path):
        raise ConfigError(
            f"custom_reward_function.path={config.custom_reward_function.path!r} does not exist; fix the path"
        )
    if tr.resume_mode == "resume_path" and not tr.resume_from_path:
        raise ConfigError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>"
        )


def _validate_rollout_parallel(config: PPOConfig, world: int) -> None:
    """Rollout TP divides the ranks and the model's heads, the engine supports it, load_format fits
    the actor's strategy (hybridrl.rollout.parallel)."""
    from hybridrl.rollout.parallel import check_rollout_parallel_config

    arr = config.actor_rollout_ref
    try:
        check_rollout_parallel_config(
            tp=arr.rollout.tensor_model_parallel_size,
            world_size=world,
            engine=arr.rollout.name,
            load_format=arr.rollout.load_format,
            strategy=arr.actor.strategy,
            model_path=arr.model.path,
            trust_remote_code=arr.model.trust_remote_code,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _data_ranks(world: int, section, key: str) -> int:
    """The role's ranks that hold distinct data (ParallelDims: world / (tp * pp)); ConfigError naming the key."""
    try:
        return ParallelDims.for_role(
            world, dataclasses.replace(section, ulysses_sequence_parallel_size=1), key
        ).data_ranks
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_critic(config: PPOConfig, world: int) -> None:
    c, d, n = config.critic, config.data, config.actor_rollout_ref.rollout.n
    if not c.model.path and not config.actor_rollout_ref.model.path:
        raise ConfigError(
            "algorithm.adv_estimator=gae needs a critic: set critic.model.path (defaults to the actor's model)"
        )
    mini = c.ppo_mini_batch_size
    if d.train_batch_size % mini != 0 or mini > d.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} is not divisible by critic.ppo_mini_batch_size={mini}"
        )
    if (mini * n) % world != 0:
        raise ConfigError(
            f"critic.ppo_mini_batch_size * rollout.n = {mini * n} must divide across {world} ranks"
        )
    micro = c.ppo_micro_batch_size_per_gpu
    world = _data_ranks(world, c, "critic")  # Megatron: only DP ranks split the batch
    world = max(1, world // c.ulysses_sequence_parallel_size)  # Ulysses: the ranks of a group share rows
    if not c.use_dynamic_bsz and micro is not None and (mini * n // world) % micro != 0:
        raise ConfigError(
            f"per-rank critic mini-batch {mini * n // world} is not divisible by "
            f"critic.ppo_micro_batch_size_per_gpu={micro}"
        )


def _check_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(choices)}")


def _as_list(files) -> list:
    if files is None:
        return []
    if isinstance(files, (list, tuple)):
        return list(files)
    return [files]
