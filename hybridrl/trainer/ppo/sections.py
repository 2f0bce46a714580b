"""Typed config sections owned by the trainer: data, algorithm, trainer, custom reward function.

Field names and defaults follow veRL's `ppo_trainer.yaml`, so users' command lines port unchanged.
The worker sections (model, actor, ref, rollout, critic, reward model) live next to the workers
that read them; `hybridrl.trainer.config` composes everything into one tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.data.custom_sampler import SamplerConfig


@dataclass
class CustomClsConfig:
    path: str | None = None
    name: str | None = None


@dataclass
class DataConfig:
    tokenizer: str | None = None
    train_files: Any = None  # str or list[str]; None -> the built-in task
    val_files: Any = None
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: int | None = None
    return_raw_input_ids: bool = False
    return_raw_chat: bool = False
    return_full_prompt: bool = False
    shuffle: bool = True
    seed: int = 42
    filter_overlong_prompts: bool = False
    filter_overlong_prompts_workers: int = 1
    truncation: str = "error"
    trust_remote_code: bool = False
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Multimodal rows (veRL's format, hybridrl.data.multimodal; read when the model has a processor)
    image_key: str = "images"
    video_key: str = "videos"
    image_patch_size: int | None = 14
    return_multi_modal_inputs: bool = True
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)
    # veRL's user sampler / curriculum (hybridrl.data.custom_sampler) and loader worker processes
    # (0 here, veRL's default 8: rows are read in the driver unless asked; docs/config.md).
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    dataloader_num_workers: int = 0
    # Where the built-in task's parquet files are written when train_files is null.
    builtin_data_dir: str | None = None


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose `metric` is constant, regenerate until full."""

    enable: bool = False
    metric: str = "acc"  # acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 0  # <= 0: no limit


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction` (veRL's newer spelling of the rollout importance sampling).

    rollout_is: null | token | sequence: importance weights pi_old / pi_rollout at that level,
      truncated at rollout_is_threshold (TIS), or with a 'lower_upper' string (e.g. '0.5_5.0') set
      to 0 outside [lower, upper] (IcePop); rollout_is_batch_normalize rescales them to mean 1
      over the batch's tokens.
    rollout_rs: null | token | sequence | geometric: rejection sampling; tokens (or whole responses)
      whose ratio lies outside [lower, upper] get weight 0. rollout_rs_threshold: 'lower_upper'
      (e.g. '0.5_2.0') or one number U (bounds 1/U, U); null: rollout_is_threshold.
    bypass_mode: use the rollout engine's log-probs as the old log-probs (no old-log-prob pass;
      needs rollout.calculate_log_probs=True); every weight is then 1, so only the
      rejection mask acts. loss_type: ppo_clip (the configured policy loss) only.
    """

    rollout_is: str | None = None
    rollout_is_threshold: Any = 2.0  # a number, or 'lower_upper'
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


@dataclass
class PFPPOConfig:
    """`algorithm.pf_ppo`: policy-filtered PPO resampling weights (hybridrl.algos.pf_ppo)."""

    reweight_method: str = "pow"  # pow | max_min | max_random
    weight_pow: float = 2.0


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # PF-PPO (Zhang et al. 2025): resample the batch by reward weights after GAE, as veRL does.
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    # Rollout importance sampling (rollout vs training policy mismatch correction).
    rollout_is: bool = False
    rollout_is_threshold: float | None = None
    rollout_is_threshold_lower: float | None = None
    rollout_is_level: str = "token"
    rollout_is_mode: str = "truncate"
    rollout_is_veto_threshold: float | None = None
    # GDPO (adv_estimator=gdpo): the reward components, keys of the dict the score function returns
    # (its per-row extras), each normalised in its group before the weighted sum (weights: all 1).
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class RewardManagerKwargs:
    """Extra knobs of the reward managers (`prime` parallelism, `dapo` overlong penalty)."""

    num_workers: int = 4
    timeout: float = 30.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 30
    total_training_steps: int | None = None
    project_name: str = "hybridrl"
    experiment_name: str = "run"
    logger: Any = field(default_factory=lambda: ["console"])
    log_freq: int = 1  # console line every N steps (and at each validation); trackers get every step
    log_val_generations: int = 0
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    nnodes: int = 1
    n_gpus_per_node: int = 1
    backend: str = "auto"  # auto | ray | local (one slot in the driver): hybridrl.single_controller.backend
    cpus_per_worker: Any = "auto"  # CPU cores per slot on CPU-only machines; auto: hybridrl.utils.cpus
    save_freq: int = -1
    save_freq_secs: float = 0.0  # also save once this many seconds passed since the last save (0: off)
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    critic_warmup: int = 0
    default_hdfs_dir: str | None = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None
    remove_previous_ckpt_in_save: bool = False
    del_local_ckpt_after_load: bool = False
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    balance_batch: bool = True
    device: str = "auto"  # auto | cpu | cuda
    ray_wait_register_center_timeout: int = 300
    use_legacy_worker_impl: str = "auto"  # auto only: hybridrl has one worker implementation
    progress_bar: bool = True
    make_report: bool = True
    seed: int = 1
    # warn once after this many consecutive steps whose rewards were all identical (0: off)
    constant_reward_warn_steps: int = 5
    # deadlines (hybridrl.utils.deadlines): a remote wait with no rank finishing for this long fails
    step_timeout_s: float = 3600.0
    reward_timeout_s: float = 600.0  # one reward manager call in the driver; 0: no deadline
    log_floors: bool = False  # start-up: GEMM peak, decode bound; log perf/floor/* (utils/floors.py)
    max_restarts: int = (
        0  # after a dead / hung worker: restart the workers, resume (hybridrl.trainer.ppo.restarts)
    )
    # SIGTERM / SIGUSR1: finish or abandon the step, save it and exit within this many seconds
    # (hybridrl.trainer.ppo.preemption); 0: exit at once without saving
    preemption_grace_s: float = 25.0
    esi_redundant_time: float = 0.0  # veRL: save every step once the instance's expiry is this close


@dataclass
class RayInitConfig:
    """`ray_kwargs.ray_init`: passed to `ray.init` (num_cpus; runtime_env merged with hybridrl's)."""

    num_cpus: int | None = None
    runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass
class RayKwargsConfig:
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    timeline_json_file: str | None = None


@dataclass
class AsyncTrainingConfig:
    """`async_training`: the asynchronous (AReaL-style) mode, read by `main_async` only.

    Every key is explained in `hybridrl/trainer/async_ppo/config.py` and docs/async.md; `main_ppo`
    (synchronous) ignores the section.
    """

    max_concurrent_rollouts: int | None = None
    queue_size: int | None = None
    consumer_batch_size: int | None = None
    max_head_offpolicyness: int = 1
    recompute_logprob: bool = True
    use_decoupled_loss: bool = True
    behave_imp_weight_cap: float | None = 5.0
    rollout_nnodes: int = 1
    rollout_n_gpus_per_node: int = 1
    rollout_cpus_per_worker: float = 1
    chunk_size: int | None = None
    partial_rollout: bool = False
    weight_update_mode: str = "collective"  # or "object_store" (hybridrl/weight_sync/collective.py)
    weight_update_timeout_s: float = 300.0
