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
    path: str | None = None  # file defining a custom dataset class (null: hybridrl's RLHFDataset)
    name: str | None = None  # name of the dataset class in that file


@dataclass
class ReasoningGymConfig:
    """`data.reasoning_gym`: reasoning-gym tasks generated at start-up (hybridrl.data.reasoning_gym_task)."""

    # each: {name, size, seed, val_size, val_seed, config}; set, they replace train_files / val_files
    tasks: list[Any] = field(default_factory=list)
    data_dir: str | None = None  # where the parquet files are written (null: ~/.cache/hybridrl/reasoning_gym)
    system_prompt: str | None = None  # a system message put before every question (null: none)


@dataclass
class DataConfig:
    # another tokenizer for the driver (data, reward decoding); null: the model's
    tokenizer: str | None = None
    train_files: Any = None  # str or list[str]; None -> the built-in task
    val_files: Any = None  # str or list[str]; None -> the built-in task's validation split
    train_max_samples: int = -1  # keep only the first N training rows (-1: all)
    val_max_samples: int = -1  # keep only the first N validation rows (-1: all)
    prompt_key: str = "prompt"  # column holding the prompt (chat message list or string)
    reward_fn_key: str = "data_source"  # column naming each row's data source (picks the score function)
    max_prompt_length: int = 512  # prompts are left-padded to this many tokens
    max_response_length: int = 512  # most tokens generated per response (rollout.response_length)
    train_batch_size: int = 1024  # prompts per training step (each sampled rollout.n times)
    val_batch_size: int | None = None  # prompts per validation batch; null: the whole validation set at once
    return_raw_input_ids: bool = False  # veRL's key; only false is accepted (the RM re-tokenizes the text)
    return_raw_chat: bool = False  # add the prompt's message list to each item as `raw_prompt`
    return_full_prompt: bool = False  # add the rendered prompt text to each item as `full_prompts`
    shuffle: bool = True  # shuffle the training rows each epoch (resumable sampler)
    seed: int = 42  # seed of the training sampler's shuffle
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length when loading
    filter_overlong_prompts_workers: int = 1  # processes measuring prompt lengths for that filter
    truncation: str = "error"  # a prompt over max_prompt_length: error, left, right or middle
    trust_remote_code: bool = False  # allow the driver tokenizer's / processor's remote code
    # extra keyword arguments of tokenizer.apply_chat_template
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Multimodal rows (veRL's format, hybridrl.data.multimodal; read when the model has a processor)
    image_key: str = "images"  # column holding each row's images
    video_key: str = "videos"  # column holding each row's videos
    image_patch_size: int | None = 14  # must equal the image processor's patch size (null: not checked)
    return_multi_modal_inputs: bool = True  # put the processor's pixel inputs in each item
    # extra keyword arguments of the processor call
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)
    # veRL's user sampler / curriculum (hybridrl.data.custom_sampler) and loader worker processes
    # (0 here, veRL's default 8: rows are read in the driver unless asked; docs/config.md).
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    dataloader_num_workers: int = 0  # DataLoader worker processes (0: rows are read in the driver)
    # Where the built-in task's parquet files are written when train_files is null.
    builtin_data_dir: str | None = None
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # coefficient of the in-reward KL penalty (the adaptive controller's start)
    horizon: int = 10000  # adaptive controller: steps over which the coefficient adapts
    target_kl: float = 0.1  # adaptive controller: the KL it steers toward


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose `metric` is constant, regenerate until full."""

    enable: bool = False  # turn DAPO dynamic sampling on
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

    rollout_is: str | None = None  # null, token or sequence: level of the importance weights
    rollout_is_threshold: Any = 2.0  # a number, or 'lower_upper'
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch
    rollout_rs: str | None = None  # null, token, sequence or geometric: rejection sampling level
    rollout_rs_threshold: Any = None  # 'lower_upper' or one number U; null: rollout_is_threshold
    bypass_mode: bool = False  # rollout log-probs as the old log-probs (no old-log-prob pass)
    loss_type: str = "ppo_clip"  # the bypass loss: ppo_clip only


@dataclass
class PFPPOConfig:
    """`algorithm.pf_ppo`: policy-filtered PPO resampling weights (hybridrl.algos.pf_ppo)."""

    reweight_method: str = "pow"  # pow | max_min | max_random
    weight_pow: float = 2.0  # exponent of the pow method: weight = abs(score) ** weight_pow


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0  # discount factor of GAE / returns
    lam: float = 1.0  # GAE lambda
    adv_estimator: str = "gae"  # advantage estimator's registry name (gae, grpo, rloo, ...)
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide each advantage by its group's std
    use_kl_in_reward: bool = False  # subtract the KL to the reference from the token rewards
    kl_penalty: str = "kl"  # KL estimator of the in-reward penalty (kl, abs, mse, low_var_kl, ...)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # PF-PPO (Zhang et al. 2025): resample the batch by reward weights after GAE, as veRL does.
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    # Rollout importance sampling (rollout vs training policy mismatch correction).
    rollout_is: bool = False
    rollout_is_threshold: float | None = None  # with rollout_is: upper bound U of the weights (null: none)
    rollout_is_threshold_lower: float | None = None  # with rollout_is: lower bound of mask mode (null: 1/U)
    rollout_is_level: str = "token"  # with rollout_is: token, sequence or geometric weights
    rollout_is_mode: str = "truncate"  # with rollout_is: truncate (min(w, U)) or mask (0 outside bounds)
    # with rollout_is: a token ratio below it zeroes its response
    rollout_is_veto_threshold: float | None = None
    # GDPO (adv_estimator=gdpo): the reward components, keys of the dict the score function returns
    # (its per-row extras), each normalised in its group before the weighted sum (weights: all 1).
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None  # weight of each of gdpo_reward_keys (null: all 1)


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = None  # .py file holding the score function (null: the built-in scorers)
    name: str = "compute_score"  # name of the score function in that file
    # extra keyword arguments passed to the score function
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OverlongBufferConfig:
    enable: bool = False  # dapo manager: penalize responses in the last `len` tokens
    len: int = 0  # tokens before max_response_length where the penalty starts
    penalty_factor: float = 1.0  # penalty at max_response_length (grows linearly in the buffer)
    log: bool = False  # also log each row's overlong penalty


@dataclass
class RewardManagerKwargs:
    """Extra knobs of the reward managers (`prime` parallelism, `dapo` overlong penalty)."""

    num_workers: int = 4  # prime manager: scoring worker processes
    timeout: float = 30.0  # prime manager: seconds per sample; a timed-out sample scores 0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 30  # passes over the training data
    total_training_steps: int | None = None  # when > 0: the number of steps, instead of epochs x batches
    project_name: str = "hybridrl"  # project name for the trackers and the checkpoint folder
    experiment_name: str = "run"  # run name for the trackers and the checkpoint folder
    # trackers: console, file, tensorboard, wandb, mlflow
    logger: Any = field(default_factory=lambda: ["console"])
    log_freq: int = 1  # console line every N steps (and at each validation); trackers get every step
    log_val_generations: int = 0  # validation samples (input, output, score) logged to the trackers
    rollout_data_dir: str | None = None  # write each step's rollouts as JSONL here (null: off)
    validation_data_dir: str | None = None  # write each validation's generations as JSONL here (null: off)
    nnodes: int = 1  # machines in the run
    n_gpus_per_node: int = 1  # GPUs (or CPU slots) per machine
    backend: str = "auto"  # auto | ray | local (one slot in the driver): hybridrl.single_controller.backend
    cpus_per_worker: Any = "auto"  # CPU cores per slot on CPU-only machines; auto: hybridrl.utils.cpus
    save_freq: int = -1  # save a checkpoint every N steps (-1: off)
    save_freq_secs: float = 0.0  # also save once this many seconds passed since the last save (0: off)
    test_freq: int = -1  # validate every N steps (-1: off)
    val_before_train: bool = True  # validate once before the first step
    val_only: bool = False  # validate, then exit without training
    critic_warmup: int = 0  # for the first N steps only the critic is updated
    default_hdfs_dir: str | None = None  # veRL's HDFS copy; only null is accepted (no HDFS client)
    # the checkpoint root folder
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None  # the checkpoint to resume from with resume_mode=resume_path
    remove_previous_ckpt_in_save: bool = False  # keep only the newest checkpoint
    del_local_ckpt_after_load: bool = False  # delete the loaded checkpoint once a newer one is saved
    max_actor_ckpt_to_keep: int | None = None  # keep the newest N checkpoints (null or <= 0: all)
    max_critic_ckpt_to_keep: int | None = None  # keep the critic's part of the newest N (null or <= 0: all)
    balance_batch: bool = True  # reorder rows so each data-parallel rank gets as many tokens
    device: str = "auto"  # auto | cpu | cuda
    ray_wait_register_center_timeout: int = 300  # veRL's key; only the default is accepted
    use_legacy_worker_impl: str = "auto"  # auto only: hybridrl has one worker implementation
    progress_bar: bool = True  # show a progress bar of the steps
    make_report: bool = True  # write a PNG of the run's curves next to the file logger's metrics
    seed: int = 1  # seed of the driver's random, numpy and torch generators
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
    # how long a start or a restart waits for the Ray cluster to grant the workers' slots (a node
    # that left must come back within it; hybridrl.single_controller.ray.nodes)
    resources_timeout_s: float = 120.0
    esi_redundant_time: float = 0.0  # veRL: save every step once the instance's expiry is this close


@dataclass
class RayInitConfig:
    """`ray_kwargs.ray_init`: passed to `ray.init` (num_cpus; runtime_env merged with hybridrl's)."""

    num_cpus: int | None = None  # CPUs Ray may use (null: Ray's own count)
    runtime_env: dict[str, Any] = field(default_factory=dict)  # Ray runtime_env, merged with hybridrl's


@dataclass
class RayKwargsConfig:
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    timeline_json_file: str | None = None  # veRL's Ray timeline; only null is accepted (use global_profiler)


@dataclass
class AsyncTrainingConfig:
    """`async_training`: the asynchronous (AReaL-style) mode, read by `main_async` only.

    Every key is explained in `hybridrl/trainer/async_ppo/config.py` and docs/async.md; `main_ppo`
    (synchronous) ignores the section.
    """

    # groups queued or generating (null: (eta + 1) x consumer batch)
    max_concurrent_rollouts: int | None = None
    queue_size: int | None = None  # bound of the input and output queues (null: 16 x concurrent)
    consumer_batch_size: int | None = None  # groups per trainer step (null: data.train_batch_size)
    max_head_offpolicyness: int = 1  # eta: most policy versions generation may run ahead
    recompute_logprob: bool = True  # recompute old log-probs before each update
    use_decoupled_loss: bool = True  # AReaL's decoupled PPO loss
    behave_imp_weight_cap: float | None = 5.0  # drop tokens whose behaviour weight exceeds this
    rollout_nnodes: int = 1  # machines of the rollout workers
    rollout_n_gpus_per_node: int = 1  # rollout slots per machine
    rollout_cpus_per_worker: float = 1  # CPU cores per rollout slot
    chunk_size: int | None = None  # groups per generate call (null: consumer batch / engines)
    partial_rollout: bool = False  # abort at each weight update, continue from the prefix
    weight_update_mode: str = "collective"  # or "object_store" (hybridrl/weight_sync/collective.py)
    weight_update_timeout_s: float = 300.0
