"""Typed configs of the training-side workers: model, actor, reference, critic, reward model.

Key names and defaults follow veRL (`actor_rollout_ref.model.*`, `actor_rollout_ref.actor.*`,
`actor_rollout_ref.ref.*`, `critic.*`, `reward_model.*`), so users' command lines port unchanged.
Every class is a plain dataclass whose fields all have defaults and use types OmegaConf supports:
the trainer composes them into one structured config (an unknown key then fails at start-up).

Workers never mutate these objects. Sizes that depend on the number of ranks and on
`rollout.n` are derived once, on the driver, in `hybridrl.workers.batch_sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.config.megatron import MegatronConfig, MtpConfig
from hybridrl.utils.profiler import ProfilerConfig

# linear / inverse_square_root: veRL's Megatron optimizer's `lr_decay_style` values (Megatron's schedules)
LR_SCHEDULER_TYPES = ("constant", "cosine", "linear", "inverse_square_root")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")

ACTOR_KEY = "actor_rollout_ref.actor"
SAPO_TAUS = (1.0, 1.05)  # veRL's actor.tau_pos / tau_neg defaults (the SAPO paper's values)
CRITIC_KEY = "critic"


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------
@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then a constant, cosine, linear or inverse-square-root schedule (veRL `*.optim`).

    `lr_warmup_steps` wins when > 0; otherwise warm-up lasts `lr_warmup_steps_ratio *
    total_training_steps`. `total_training_steps` is set by the trainer; it is needed by the
    decaying schedules and by ratio warm-up. `warmup_style` is veRL's older name for
    `lr_scheduler_type`, and `lr_decay_style` its Megatron optimizer's (renamed onto it at load).
    """

    lr: float = 1e-6  # peak learning rate
    lr_warmup_steps: int = -1  # linear warm-up steps; > 0 wins over lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warm-up as a fraction of total_training_steps
    lr_scheduler_type: str = "constant"  # after warm-up: constant, cosine, linear or inverse_square_root
    warmup_style: str | None = None  # veRL's other spelling of lr_scheduler_type (wins when set)
    min_lr_ratio: float = 0.0  # decaying schedules end at lr * min_lr_ratio
    num_cycles: float = 0.5  # cosine schedule: cosine cycles over the decay (0.5: one half-wave)
    weight_decay: float = 0.01  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    clip_grad: float = 1.0  # clip the gradient's global norm to this (grad_clip wins when set)
    total_training_steps: int = -1  # set by the trainer (the schedule's length)

    @property
    def scheduler_type(self) -> str:
        return self.warmup_style or self.lr_scheduler_type


@dataclass
class MixedPrecisionConfig:
    """FSDP2 MixedPrecisionPolicy: compute in `param_dtype`, reduce gradients in `reduce_dtype`."""

    param_dtype: str = "bf16"  # dtype the forward and backward compute in
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in
    buffer_dtype: str = "fp32"  # accepted for veRL compatibility; FSDP2 keeps buffers as loaded


@dataclass
class WrapPolicyConfig:
    """Which modules get their own `fully_shard` (default: the model's `_no_split_modules`).

    min_num_params is accepted for veRL compatibility; FSDP2 sharding here is per decoder layer.
    """

    # module classes sharded one by one (null: _no_split_modules)
    transformer_layer_cls_to_wrap: list[str] | None = None
    min_num_params: int = 0  # veRL's size-based wrap; only 0 is accepted


@dataclass
class FSDPConfig:
    """FSDP2 settings (veRL `*.fsdp_config`).

    fsdp_size: ranks per shard group; -1 (or >= world size) shards over all ranks, 0 < fsdp_size
    < world builds a 2-D (replicate, shard) mesh (hybrid sharding). `model_dtype` is the dtype
    of the master weights; the optimizer runs in it.

    reshard_after_forward: free each layer's gathered parameters after forward (True, veRL's
    default) or keep them until backward (False); None (auto) is False when each shard group is
    one CPU rank (nothing is sharded; keeping them saves a second cast in backward), else True.
    forward_prefetch: each decoder layer's forward starts the next layer's all-gather (FSDP2
    explicit prefetch), overlapping communication with compute; same numbers.
    shard_one_rank: wrap the model with FSDP2 on a one-rank mesh (True, veRL's behaviour) or keep the
    plain module (False); None (auto) keeps it plain on one CPU rank when nothing is cast and no
    FSDP-only key is set (engine/fsdp.resolve_shard_one_rank). Same numbers, same checkpoints.
    compile_layers: every decoder layer compiled in place with torch.compile (dynamic shapes, so a
    new response length does not recompile; Inductor fuses the norms, rotary, SiLU-mul and residual
    adds around the matmuls). The first step compiles (16-25 s for the ~100M bench model on 2 CPU
    cores, earned back after 15-25 steps; bench/compile_layers.py) and it needs a C++ compiler on
    CPU. None (auto, the actor's default in ppo_trainer.yaml) is decided on the driver
    (trainer/ppo/compile_auto.py: on for a text-only model of >= 80M parameters with the padded
    forward, trained on one CPU rank for >= 50 steps); False elsewhere. Parameter names and checkpoints are unchanged. hybridrl's own key.
    onednn_linear: every nn.Linear computes its forward and input gradient with oneDNN's float32
    linear instead of MKL's sgemm where the input is a CPU float32 tensor (cpu/train_linear.py,
    measured by bench/cpu_gemm.py --train; the vocabulary head and weights below 2**17 elements
    stay plain). None (auto) is on for CPU
    training where torch has oneDNN; True is refused elsewhere. Same numbers up to float rounding (~1e-6); parameter names and checkpoints are
    unchanged. hybridrl's own key.
    """

    param_offload: bool = False  # keep the parameters in host memory between calls (accelerators)
    optimizer_offload: bool = False  # keep the optimizer state in host memory between updates
    offload_policy: bool = False  # FSDP2's CPUOffloadPolicy (parameters live on the CPU)
    reshard_after_forward: bool | None = None  # free gathered parameters after forward; null: auto
    forward_prefetch: bool = False  # each layer's forward prefetches the next layer's all-gather
    shard_one_rank: bool | None = None  # wrap with FSDP2 on a one-rank mesh too; null: auto
    compile_layers: bool | None = False  # torch.compile each decoder layer; null: decided at start-up
    onednn_linear: bool | None = None  # CPU float32 linears through oneDNN; null: on where available
    fsdp_size: int = -1  # ranks per shard group (-1: all ranks)
    model_dtype: str = "fp32"  # dtype of the master weights (and of the optimizer)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)


@dataclass
class CheckpointConfig:
    """What a checkpoint holds: 'model', 'optimizer', 'extra' (lr scheduler, RNG), 'hf_model'."""

    # what a checkpoint saves: model, optimizer, extra, hf_model
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    # what a resume loads from it
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])


@dataclass
class PolicyLossRolloutCorrection:
    """`actor.policy_loss.rollout_correction`: the settings of the `bypass_mode` loss, copied by the
    driver from `algorithm.rollout_correction` when its bypass_mode=True (as veRL does).

    loss_type: ppo_clip | reinforce; rollout_is (null | token | sequence), rollout_is_threshold,
    rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold: see hybridrl.algos.rollout_rs.
    """

    loss_type: str = "ppo_clip"  # ppo_clip or reinforce (copied from algorithm.rollout_correction)
    rollout_is: str | None = None  # null, token or sequence importance weights
    rollout_is_threshold: float = 2.0  # upper bound of the importance weights
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch
    rollout_rs: str | None = None  # null, token, sequence or geometric rejection sampling
    rollout_rs_threshold: Any = None  # rejection bounds: 'lower_upper' or one number U


@dataclass
class PolicyLossConfig:
    """`actor.policy_loss`: the registry name of the loss and the hyper-parameters of its variants.

    behave_imp_weight_cap: the 'decoupled' (AReaL) loss drops tokens whose behaviour importance
    weight pi_prox / pi_behav exceeds it (None keeps all). rollout_correction: the settings of the
    'bypass_mode' loss (veRL's algorithm.rollout_correction.bypass_mode). dro_beta: the 'dro' loss's
    penalty coefficient (required, > 0, with that loss). tau_pos / tau_neg: the 'sapo' gate
    temperatures, the spelling of veRL's SAPO example (`+actor.policy_loss.tau_pos`); veRL's
    schema has them on the actor (`actor.tau_pos`), see ActorConfig.sapo_taus.
    """

    loss_mode: str = "vanilla"  # registry name of the policy loss (vanilla, gspo, clip_cov, ...)
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens removed from the loss
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the covariance of candidate tokens
    clip_cov_ub: float = 5.0  # clip_cov: upper bound of the covariance of candidate tokens
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty
    behave_imp_weight_cap: float | None = None  # decoupled: drop tokens whose behaviour weight exceeds it
    dro_beta: float | None = None  # dro: penalty coefficient (required with that loss)
    tau_pos: float | None = None  # sapo: gate temperature of positive advantages (same as actor.tau_pos)
    tau_neg: float | None = None  # sapo: gate temperature of negative advantages (same as actor.tau_neg)
    rollout_correction: PolicyLossRolloutCorrection = field(default_factory=PolicyLossRolloutCorrection)


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------
@dataclass
class FusedKernelOptions:
    """`model.fused_kernel_options`: impl_backend of the fused log-prob path (torch)."""

    impl_backend: str = "torch"  # torch only (no Triton kernel here)


@dataclass
class ModelConfig:
    """`actor_rollout_ref.model`: which Hugging Face model to load and how.

    path: a local Hugging Face folder, a hub id, or 'builtin:tiny' (the shipped tiny model).
    init_from_scratch: build the architecture from `path`'s config with random weights.
    override_config: set on the HF config before building (e.g. {attention_dropout: 0.0,
      attn_implementation: eager}).
    lora_rank: > 0 wraps the model with a PEFT LoRA adapter (lora_alpha, target_modules);
      lora_adapter_path loads a saved adapter instead (its own rank and targets).
    exclude_modules: LoRA: modules that get no adapter (veRL's key, PEFT's `exclude_modules`): a
      regex matched against the full module name (e.g. '.*visual.*' keeps a VLM's vision tower
      without adapters), or a list of names matched exactly or as a name suffix; null: none.
    use_shm: copy a local model folder under /dev/shm once and load it from there (veRL's key).
    enable_activation_offload: tensors saved for backward by the training forward (actor, critic)
      live in CPU memory until backward (models/activation_offload.py; moves nothing on CPU).
    torch_dtype: the dtype the weights are loaded in (Hugging Face's `torch_dtype`); when set it
      becomes `fsdp_config.model_dtype` of every role that loads this model (actor and ref, or the
      critic), so the master weights and the optimizer are in it; compute still follows
      `fsdp_config.mixed_precision.param_dtype`. None: each role's model_dtype.
    use_fused_kernels: log-probs and entropy from the hidden states without the (B, S, V) logits
      (veRL's fused kernels; here the chunked head of hybridrl/engine/lm_head.py, equal
      numbers). hybridrl's default is True (its tested path); False computes the full logits.
      fused_kernel_options.impl_backend: torch only (veRL's triton kernel does not exist here).
    """

    path: str | None = "builtin:tiny"  # Hugging Face folder, hub id, or builtin:tiny (the shipped tiny model)
    tokenizer_path: str | None = None  # tokenizer to load (null: the model's path)
    trust_remote_code: bool = False  # allow the model's and tokenizer's remote code
    # set on the Hugging Face config before the model is built
    override_config: dict[str, Any] = field(default_factory=dict)
    external_lib: Any = None  # a module name or a list of them (hybridrl.utils.plugins)
    enable_gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    enable_activation_offload: bool = False  # keep activations saved for backward in CPU memory
    use_remove_padding: bool = False  # packed forward of the valid tokens only (Ulysses needs it)
    use_fused_kernels: bool = True  # veRL: False; see the docstring
    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    use_liger: bool = False  # Liger kernels; not implemented here, only false is accepted
    use_shm: bool = False  # copy the local model folder under /dev/shm and load it from there
    init_from_scratch: bool = False  # build the architecture from path's config with random weights
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank (0: full fine-tuning)
    lora_alpha: int = 16  # LoRA scaling alpha
    target_modules: Any = "all-linear"  # LoRA: modules that get adapters (all-linear or a list of names)
    exclude_modules: Any = None  # LoRA: modules without adapters (a regex, or a list of names)
    # LoRA A's init with strategy=megatron: xavier | kaiming (veRL's model.lora.lora_A_init_method); null: xavier
    lora_init_a: str | None = None
    # a saved PEFT adapter to start from (replaces lora_rank/alpha/targets)
    lora_adapter_path: str | None = None
    custom_chat_template: str | None = None  # a chat template that replaces the tokenizer's
    torch_dtype: str | None = None  # dtype the weights load in (and the master weights); null: model_dtype
    mtp: MtpConfig = field(default_factory=MtpConfig)  # veRL's model.mtp (Megatron actor only)

    def validate(self, key: str = "actor_rollout_ref.model") -> None:
        backend = self.fused_kernel_options.impl_backend
        if self.use_fused_kernels and backend != "torch":
            raise ValueError(
                f"{key}.fused_kernel_options.impl_backend={backend!r}: the fused log-prob path here is a chunked "
                "torch implementation (hybridrl/engine/lm_head.py); no Triton kernel exists in hybridrl. "
                "Use impl_backend=torch"
            )
        for name in ("use_liger",):
            if getattr(self, name):
                raise ValueError(f"{key}.{name}=True is not implemented in hybridrl; set it to False")
        if self.lora_rank < 0:
            raise ValueError(f"{key}.lora_rank must be >= 0 (0 disables LoRA), got {self.lora_rank}")
        if self.lora_init_a not in (None, "xavier", "kaiming"):
            raise ValueError(f"{key}.lora_init_a={self.lora_init_a!r}: use xavier, kaiming or null")
        check_exclude_modules(self, key)


def check_exclude_modules(model: Any, key: str) -> None:
    """`exclude_modules`: null, a regex string or a list of module names; not with a saved adapter."""
    ex = model.exclude_modules
    if ex is None:
        return
    names = [ex] if isinstance(ex, str) else list(ex) if isinstance(ex, (list, tuple)) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"{key}.exclude_modules={ex!r}: use a regex string (e.g. '.*visual.*') or a list of module names"
        )
    if model.lora_adapter_path:
        raise ValueError(
            f"{key}.exclude_modules with {key}.lora_adapter_path: the saved adapter's own targets apply; "
            "set exclude_modules=null"
        )


# ----------------------------------------------------------------------------------------------
# roles
# ----------------------------------------------------------------------------------------------
@dataclass
class RouterReplayConfig:
    """`actor_rollout_ref.{actor,ref}.router_replay`: routing replay of a mixture-of-experts model
    (docs/moe.md).

    mode: 'disabled'; 'R2': the old-log-prob pass records the experts each token is routed to and
    the update's forwards route with them; 'R3': the rollout records them
    (`rollout.enable_rollout_routing_replay=true`) and every training forward (old log-probs,
    reference, update) routes with them. The routing rides in the batch as `routed_experts`.
    record_file / replay_file: veRL's offline routing files; not implemented (null only).
    """

    mode: str = "disabled"  # disabled / R2 / R3
    record_file: str | None = None  # offline routing file: null only
    replay_file: str | None = None  # offline routing file: null only

    def validate(self, key: str) -> None:
        if self.mode not in ROUTER_REPLAY_MODES:
            raise ValueError(
                f"{key}.router_replay.mode={self.mode!r}: use one of {list(ROUTER_REPLAY_MODES)}"
            )
        for name in ("record_file", "replay_file"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{key}.router_replay.{name}={getattr(self, name)!r}: routing files are not implemented; "
                    "R2 and R3 carry the routing in the batch: leave it null"
                )


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass
class ActorConfig:
    """`actor_rollout_ref.actor`: PPO policy update.

    ppo_mini_batch_size counts prompts over all ranks (multiplied by rollout.n, divided by the
    data-parallel size: see normalize_actor_batch_sizes). ppo_micro_batch_size_per_gpu counts
    rows per forward/backward on one rank; with use_dynamic_bsz, micro-batches are instead packed
    to at most ppo_max_token_len_per_gpu tokens. grad_clip (veRL's older key) overrides
    optim.clip_grad when set. entropy_from_logits_with_chunking / entropy_checkpointing compute
    the entropy 2048 positions at a time, recomputed in backward. calculate_sum_pi_squared: the
    old-log-prob pass also returns sum_v pi(v)^2 per token (`sum_pi_squared`, computed chunk-wise
    with the log-probs; algorithm.adv_estimator=optimal_token_baseline needs it). use_torch_compile: the log-prob /
    entropy kernels (the chunked head's per-chunk softmax statistics and their backward, or the
    plain path's entropy) run through torch.compile, as veRL compiles its entropy kernel; same
    numbers to ~1e-6; hybridrl's default is False (veRL: True): the first step compiles, which
    takes seconds on a CPU and needs a C++ compiler there.

    skip_on_policy_old_log_prob: when the update is exactly on-policy (ppo_epochs == 1 and one
    mini-batch per step, i.e. ppo_mini_batch_size == data.train_batch_size, and nothing reads the
    old log-probs before the update: no KL in the reward, no rollout importance sampling), the
    trainer skips the separate old-log-prob forward and the update uses the detached log-probs of
    its own forward, which are the same numbers. False always runs the separate pass.

    use_prefix_grouper: rows of a micro-batch with the same prompt (a GRPO group) share one
    forward of it in the old-log-prob and update passes (engine/prefix_group.py): the prompt's
    tokens are computed once per group instead of once per row, with the same numbers. Works
    with the packed and the padded layout and the fused head (veRL refuses those with it); not
    with Ulysses SP or Megatron. The reference keeps the plain forward (veRL's ref has no key).
    'auto' (hybridrl's default; veRL's is false) is decided on the driver at start-up
    (trainer/ppo/prefix_auto.py: on for rollout.n > 1 with a group estimator on FSDP and a
    supported model: text, or Qwen2-VL / Qwen2.5-VL / Qwen3-VL with images (and videos; Qwen3-VL refuses
    videos)); an ActorConfig used
    without that config stage takes 'auto' as off.

    tau_pos / tau_neg: the temperatures of the 'sapo' policy loss's gate (veRL's keys and defaults
    1.0 / 1.05, used when null); `policy_loss.tau_pos / tau_neg` is the other spelling.
    """

    strategy: str = "fsdp"  # training engine: fsdp / fsdp2 (FSDP2) or megatron
    ppo_mini_batch_size: int = 256  # prompts per optimizer step over all ranks (times rollout.n rows)
    ppo_micro_batch_size: int | None = None  # a global size: divided by the ranks into the per-GPU key
    ppo_micro_batch_size_per_gpu: int | None = None  # rows per forward/backward on one rank
    use_dynamic_bsz: bool = False  # pack micro-batches by tokens (ppo_max_token_len_per_gpu)
    ppo_max_token_len_per_gpu: int = 16384  # token budget of a micro-batch with use_dynamic_bsz
    ppo_epochs: int = 1  # passes of the update over each batch
    shuffle: bool = False  # shuffle rows before splitting mini-batches (needs data_loader_seed)
    data_loader_seed: int | None = None  # seed of that shuffle
    grad_clip: float | None = None  # veRL's other spelling of optim.clip_grad (wins when set)
    clip_ratio: float = 0.2  # PPO clip range epsilon
    clip_ratio_low: float | None = None  # lower clip range (null: clip_ratio)
    clip_ratio_high: float | None = None  # upper clip range (null: clip_ratio)
    clip_ratio_c: float = 3.0  # dual-clip bound of negative advantages (> 1)
    tau_pos: float | None = None  # veRL: 1.0 (SAPO_TAUS)
    tau_neg: float | None = None  # veRL: 1.05
    loss_agg_mode: str = "token-mean"  # how token losses are averaged: token-mean, seq-mean-token-sum, ...
    entropy_coeff: float = 0.0  # weight of the entropy bonus in the loss
    use_kl_loss: bool = False  # add a KL-to-reference term to the actor loss
    kl_loss_coef: float = 0.001  # weight of that KL term
    kl_loss_type: str = "low_var_kl"  # KL estimator of that term (low_var_kl, k1, k2, k3, ...)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    freeze_vision_tower: bool = False  # a vision-language actor: the vision encoder is not trained
    use_torch_compile: bool = False  # torch.compile the log-prob / entropy kernels
    ulysses_sequence_parallel_size: int = 1  # Ulysses sequence-parallel group size (1: off)
    entropy_from_logits_with_chunking: bool = False  # compute the entropy 2048 positions at a time
    entropy_checkpointing: bool = False  # recompute the entropy in backward instead of storing it
    calculate_sum_pi_squared: bool = False  # old-log-prob pass also returns sum_v pi(v)^2 per token
    skip_on_policy_old_log_prob: bool = True  # skip the old-log-prob pass when exactly on-policy
    use_prefix_grouper: Any = "auto"  # true / false / auto (veRL: false); auto: trainer/ppo/prefix_auto.py
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE routing replay
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    @property
    def max_grad_norm(self) -> float:
        return self.optim.clip_grad if self.grad_clip is None else self.grad_clip

    def sapo_taus(self, key: str = ACTOR_KEY) -> tuple[float, float]:
        """(tau_pos, tau_neg) of the 'sapo' loss from either spelling; ValueError if both differ."""
        out = []
        for name, default in zip(("tau_pos", "tau_neg"), SAPO_TAUS):
            top, nested = getattr(self, name), getattr(self.policy_loss, name)
            if top is not None and nested is not None and top != nested:
                raise ValueError(
                    f"{key}.{name}={top} and {key}.policy_loss.{name}={nested} are the same setting (the SAPO "
                    f"gate temperature) given twice with different values; keep one of them"
                )
            value = default if top is None and nested is None else (top if top is not None else nested)
            if value <= 0:
                raise ValueError(
                    f"{key}.{name}={value} must be > 0 (the SAPO gate divides by it); veRL uses {default}"
                )
            out.append(float(value))
        return out[0], out[1]

    def validate_policy_loss(self, key: str = ACTOR_KEY) -> None:
        """The hyper-parameters of the chosen loss (`policy_loss.loss_mode`) are usable."""
        self.sapo_taus(key)
        pl = self.policy_loss
        if pl.loss_mode == "dro" and (pl.dro_beta is None or pl.dro_beta <= 0):
            raise ValueError(
                f"{key}.policy_loss.loss_mode=dro needs {key}.policy_loss.dro_beta > 0 (the weight of the "
                f"quadratic log-ratio penalty), got {pl.dro_beta}; e.g. {key}.policy_loss.dro_beta=0.1"
            )
        if pl.dro_beta is not None and pl.dro_beta <= 0:
            raise ValueError(f"{key}.policy_loss.dro_beta={pl.dro_beta} must be > 0 (or null when unused)")
        if pl.loss_mode in ("dppo_tv", "dppo_kl"):
            for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
                value = getattr(self, name)
                if value is not None and value < 0:
                    raise ValueError(
                        f"{key}.{name}={value}: with policy_loss.loss_mode={pl.loss_mode} it is the divergence "
                        "bound of the trust region and must be >= 0"
                    )


@dataclass
class RefConfig:
    """`actor_rollout_ref.ref`: the frozen reference policy (forward only).

    entropy_from_logits_with_chunking: the reference's PPOActor computes any entropy 2048
    positions at a time (as the actor's key); the reference pass itself asks for log-probs only
    (as in veRL), so this changes no number today.
    """

    strategy: str = "fsdp"  # engine of the reference: fsdp / fsdp2 or megatron
    log_prob_micro_batch_size: int | None = None  # deprecated global size
    log_prob_micro_batch_size_per_gpu: int | None = None  # rows per reference forward on one rank
    log_prob_use_dynamic_bsz: bool = False  # pack reference forwards by tokens
    log_prob_max_token_len_per_gpu: int = 16384  # token budget of a forward with dynamic batch size
    ulysses_sequence_parallel_size: int = 1  # Ulysses group size (must equal the actor's with KL)
    use_torch_compile: bool = False  # torch.compile the log-prob / entropy kernels (as the actor's key)
    entropy_from_logits_with_chunking: bool = False  # as the actor's key; the ref pass computes no entropy
    router_replay: RouterReplayConfig = field(
        default_factory=RouterReplayConfig
    )  # R2 / R3: replay the batch's routing
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(model_dtype="bf16"))
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    def policy_config(self) -> ActorConfig:
        """The forward-only PPOActor settings of the reference (its entropy function)."""
        return ActorConfig(
            entropy_from_logits_with_chunking=self.entropy_from_logits_with_chunking,
            use_torch_compile=self.use_torch_compile,
            router_replay=self.router_replay,
        )


@dataclass
class CriticModelConfig(ModelConfig):
    """`critic.model`: like the actor's model (path None means the actor's model) plus FSDP settings."""

    path: str | None = None
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticConfig:
    """`critic`: the value model, `AutoModelForTokenClassification` with one label."""

    strategy: str = "fsdp"  # training engine: fsdp / fsdp2 (FSDP2) or megatron
    rollout_n: int = 1  # responses per prompt; follows actor_rollout_ref.rollout.n
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 256  # prompts per optimizer step over all ranks (times rollout.n rows)
    ppo_micro_batch_size: int | None = None  # deprecated global sizes
    forward_micro_batch_size: int | None = None  # a global size: divided by the ranks into the per-GPU key
    ppo_micro_batch_size_per_gpu: int | None = None  # rows per forward/backward of the update on one rank
    # rows per value forward on one rank (null: the update's)
    forward_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False  # pack micro-batches by tokens instead of rows
    ppo_max_token_len_per_gpu: int = 32768  # token budget of an update micro-batch with use_dynamic_bsz
    forward_max_token_len_per_gpu: int = 32768  # token budget of a value forward with use_dynamic_bsz
    ppo_epochs: int = 1  # passes of the update over each batch
    shuffle: bool = False  # shuffle rows before splitting mini-batches (needs data_loader_seed)
    data_loader_seed: int | None = None  # seed of that shuffle
    grad_clip: float | None = None  # veRL's other spelling of optim.clip_grad (wins when set)
    cliprange_value: float = 0.5  # clip range of the value update around the old values
    loss_agg_mode: str = "token-mean"  # how token losses are averaged (as the actor's key)
    ulysses_sequence_parallel_size: int = 1  # Ulysses sequence-parallel group size (1: off)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    @property
    def max_grad_norm(self) -> float:
        return self.optim.clip_grad if self.grad_clip is None else self.grad_clip


@dataclass
class RewardModelModelConfig:
    """`reward_model.model`: an `AutoModelForSequenceClassification` with one label."""

    input_tokenizer: str | None = None  # tokenizer that decodes the policy's tokens (null: the policy's)
    path: str | None = None  # Hugging Face folder or hub id of the reward model
    external_lib: Any = None  # a module name or a list of them (hybridrl.utils.plugins)
    trust_remote_code: bool = False  # allow the reward model's remote code
    # set on the Hugging Face config before the model is built
    override_config: dict[str, Any] = field(default_factory=dict)
    use_remove_padding: bool = False  # packed forward of the valid tokens only
    use_shm: bool = False  # veRL's key; only false is accepted
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(model_dtype="bf16"))


@dataclass
class RewardRolloutConfig:
    """`reward_model.rollout`: the engine that serves the reward model in veRL's reward loop
    (`reward_model.use_reward_loop=True`; hybridrl/reward/reward_loop.py).

    name: vllm (vLLM's pooling runner, `LLM.classify`) or hf (the Hugging Face forward).
    dtype: the engine's weight dtype. tensor_model_parallel_size: GPUs (CPU slots) per replica;
    one replica per group of that many slots. gpu_memory_utilization / enforce_eager: vLLM
    arguments. max_model_len: the longest RM input (default prompt_length + response_length); a
    longer input is an error naming these keys, for both engines.
    """

    name: str = "hf"  # veRL: required (???); hybridrl's CPU default is hf
    dtype: str = "bfloat16"  # the serving engine's weight dtype
    gpu_memory_utilization: float = 0.5  # vLLM GPU memory fraction
    enforce_eager: bool = True  # vLLM: no CUDA graphs
    tensor_model_parallel_size: int = 1  # veRL: 2
    max_model_len: int | None = None  # longest reward-model input (null: prompt + response length)
    prompt_length: int = 2048  # prompt part of the default max_model_len
    response_length: int = 2048  # response part of the default max_model_len
    # sampling defaults of a generative reward model (GenRM: enable + custom_reward_function.path);
    # the custom function's client may override them per request (hybridrl/reward/genrm.py)
    temperature: float = 1.0
    top_k: int = -1  # GenRM sampling top-k (<= 0: off)
    top_p: float = 1.0  # GenRM sampling top-p
    do_sample: bool = True  # GenRM: sample (false: greedy)
    n: int = 1
    request_timeout_s: float = (
        300.0  # hybridrl: a reward-model score / GenRM request not answered in time fails naming this key
    )

    @property
    def effective_max_model_len(self) -> int:
        return self.max_model_len or (self.prompt_length + self.response_length)


@dataclass
class SandboxFusionConfig:
    """`reward_model.sandbox_fusion`: code data sources scored on a SandboxFusion service
    (hybridrl/reward/scorers/sandbox_fusion.py); url null: off."""

    url: str | None = None  # SandboxFusion run_code endpoint (null: off)
    max_concurrent: int = 64  # requests in flight per scoring process
    memory_limit_mb: int = 1024  # memory limit of each run, in MB


@dataclass
class RewardModelConfig:
    """`reward_model`: an optional learned reward model, and the reward manager of the rule scores.

    use_reward_loop: veRL's reward loop: `num_workers` reward-loop workers (Ray actors) score
    the batch concurrently; with `enable` the model is served by `rollout.name` (see
    RewardRolloutConfig) instead of the FSDP RewardModelWorker (the legacy path). Same scores.
    reward_kwargs: veRL's keyword arguments of the reward manager (e.g. dapo's
    `overlong_buffer_cfg`, `max_resp_len`); the rest go to the score function, like
    `custom_reward_function.reward_kwargs` (both may be set if they agree).
    """

    enable: bool = False  # score with a learned reward model
    strategy: str = "fsdp"  # veRL's key; only fsdp is accepted
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size: int | None = None  # deprecated global size
    micro_batch_size_per_gpu: int | None = None  # rows per reward-model forward on one rank
    max_length: int | None = None  # the re-tokenized RM input is truncated to this (null: no limit)
    use_dynamic_bsz: bool = False  # veRL's key; only false is accepted
    forward_max_token_len_per_gpu: int = 32768  # veRL's key; only the default is accepted
    reward_manager: str = "naive"  # registered reward manager: naive, prime, dapo or batch
    # reward manager's keyword arguments; the rest go to the score function
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    launch_reward_fn_async: bool = False  # veRL's key; only false is accepted
    use_reward_loop: bool = False  # score through veRL's reward loop (num_workers Ray actors)
    num_workers: int = 1  # reward-loop workers
    rollout: RewardRolloutConfig = field(default_factory=RewardRolloutConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    ulysses_sequence_parallel_size: int = 1  # veRL's key; only 1 is accepted
