"""veRL's `distillation.*` config (on-policy distillation): typed sections and start-up checks.

The keys and defaults are veRL's (verl/trainer/config/distillation/distillation.yaml). Here the
teacher is served by the training engines in forward-only mode (the reference policy's engine,
`actor_rollout_ref.ref.*`, with the teacher's weights): `distillation.nnodes=0` colocates it with
the actor on the actor's slots, as in veRL. The `inference.*` keys of an inference server
(memory share, CUDA graphs, batching limits) have nothing to tune on an engine forward pass:
they are accepted and, when changed from veRL's defaults, a warning says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybridrl.utils.config_loader import ConfigError

DEFAULT_TEACHER = "teacher_model"  # veRL's single-teacher entry (dropped when others are added)
DEFAULT_KEY = "default"  # the key of the single teacher: it serves every row


@dataclass
class TeacherInferenceConfig:
    """veRL's `distillation.teacher_models.<name>.inference` (a RolloutConfig there)."""

    name: str | None = None
    dtype: str | None = None
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: Any = None
    free_cache_engine: bool = True
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    tensor_model_parallel_size: int = 2
    pipeline_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    load_format: str = "auto"
    engine_kwargs: dict = field(default_factory=dict)
    limit_images: Any = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = True
    prompt_length: int | None = None
    response_length: int | None = None
    temperature: float | None = None

    @property
    def per_replica_world_size(self) -> int:
        return self.tensor_model_parallel_size * self.data_parallel_size * self.pipeline_model_parallel_size


# Server tuning knobs without an effect on a training-engine forward pass (warned about when changed).
SERVER_ONLY_KEYS = (
    "gpu_memory_utilization", "enforce_eager", "cudagraph_capture_sizes", "free_cache_engine",
    "max_num_batched_tokens", "max_num_seqs", "load_format", "engine_kwargs", "limit_images",
    "enable_chunked_prefill", "enable_prefix_caching", "disable_log_stats", "skip_tokenizer_init",
    "expert_parallel_size",
)  # fmt: skip


@dataclass
class TeacherModelConfig:
    """One teacher: `key` (the `teacher_key` value of its rows), `model_path`, `num_replicas`."""

    key: str | None = None
    model_path: str | None = None
    num_replicas: int = 0
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)


@dataclass
class DistillationLossConfig:
    """veRL's `distillation.distillation_loss` (see hybridrl/algos/distillation.py)."""

    loss_mode: str = "k3"
    topk: int | None = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2  # use_policy_gradient: clip range of the surrogate
    clip_ratio_low: float = 0.2  # use_policy_gradient: lower clip range
    clip_ratio_high: float = 0.2  # use_policy_gradient: upper clip range


@dataclass
class DistillationConfig:
    """veRL's `distillation` section. `teachers()` gives the resolved teachers by key."""

    enabled: bool = False  # turn on-policy distillation from the teacher(s) on
    n_gpus_per_node: int = 8
    nnodes: int = 0
    # teachers by name: key, model_path, num_replicas, inference
    teacher_models: dict[str, TeacherModelConfig] = field(
        default_factory=lambda: {DEFAULT_TEACHER: TeacherModelConfig()}
    )
    teacher_key: str = "data_source"
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)

    @property
    def colocated(self) -> bool:
        """nnodes=0: the teachers share the actor's slots (veRL's colocated mode)."""
        return self.nnodes == 0

    def teachers(self) -> dict[str, TeacherModelConfig]:
        """{key: teacher}: the single `teacher_model` under key "default" (it serves every row), or
        every other named entry under its own key (the default entry dropped, as in veRL)."""
        entries = dict(self.teacher_models)
        if len(entries) == 1 and DEFAULT_TEACHER in entries:
            return {DEFAULT_KEY: dataclasses.replace(entries[DEFAULT_TEACHER], key=DEFAULT_KEY)}
        entries.pop(DEFAULT_TEACHER, None)
        return {t.key: t for t in entries.values()}


def validate_distillation(dist: DistillationConfig, rollout: Any, actor: Any) -> None:
    """Start-up checks of `distillation.*` (nothing when disabled); ConfigError naming key and fix.

    Args:
        dist: the section; rollout: `actor_rollout_ref.rollout` (prompt/response lengths);
        actor: `actor_rollout_ref.actor` (its clip ratios are not the distillation ones).
    """
    if not dist.enabled:
        return
    _validate_loss(dist.distillation_loss)
    _validate_topk_actor(dist.distillation_loss, actor)
    _validate_teachers(dist, rollout)


def _validate_topk_actor(loss: DistillationLossConfig, actor: Any) -> None:
    """forward_kl_topk: the full logits of the HF engines (engine/topk.py), or Megatron's
    vocabulary-parallel logits (engine/megatron/vocab_parallel_topk.py)."""
    from hybridrl.algos.distillation import uses_topk

    if not uses_topk(loss.loss_mode) or actor is None:
        return
    key, mode = "distillation.distillation_loss.loss_mode", loss.loss_mode
    if (
        getattr(actor, "ulysses_sequence_parallel_size", 1) > 1
        or getattr(actor, "use_prefix_grouper", False) is True
    ):
        raise ConfigError(
            f"{key}={mode} with actor.ulysses_sequence_parallel_size > 1 or actor.use_prefix_grouper=true is not "
            "implemented; set them to 1 / false, or use loss_mode=k3"
        )


def _validate_loss(loss: DistillationLossConfig) -> None:
    from hybridrl.algos.distillation import list_distillation_loss_modes, uses_topk

    key = "distillation.distillation_loss"
    modes = list_distillation_loss_modes()
    if loss.loss_mode not in modes:
        raise ConfigError(
            f"{key}.loss_mode={loss.loss_mode!r} is not a distillation loss; use one of {modes}"
        )
    if not loss.use_policy_gradient and loss.loss_mode in ("k1", "kl"):
        raise ConfigError(
            f"{key}.loss_mode={loss.loss_mode} with use_policy_gradient=false: the gradient of k1 does not "
            f"depend on the teacher; set {key}.use_policy_gradient=true (k1 as a reward) or loss_mode=k3"
        )
    if loss.policy_loss_mode != "vanilla":
        raise ConfigError(
            f"{key}.policy_loss_mode={loss.policy_loss_mode!r}: only 'vanilla' is supported (as in veRL)"
        )
    if uses_topk(loss.loss_mode) and (loss.topk is None or loss.topk < 1):
        raise ConfigError(f"{key}.topk must be >= 1 with loss_mode={loss.loss_mode}, got {loss.topk}")
    if loss.loss_max_clamp is not None and loss.loss_max_clamp <= 0:
        raise ConfigError(f"{key}.loss_max_clamp must be > 0 or null, got {loss.loss_max_clamp}")
    if loss.log_prob_min_clamp is not None and loss.log_prob_min_clamp >= 0:
        raise ConfigError(
            f"{key}.log_prob_min_clamp must be < 0 (a log-probability) or null, got {loss.log_prob_min_clamp}"
        )
    if not (0 <= loss.clip_ratio_low < 1 and loss.clip_ratio_high >= 0 and loss.clip_ratio >= 0):
        raise ConfigError(
            f"{key}.clip_ratio_low must be in [0, 1) and clip_ratio / clip_ratio_high >= 0, got "
            f"{loss.clip_ratio_low}, {loss.clip_ratio}, {loss.clip_ratio_high}"
        )


def _validate_teachers(dist: DistillationConfig, rollout: Any) -> None:
    names = list(dist.teacher_models)
    if not names:
        raise ConfigError(
            "distillation.enabled=true needs a teacher: set distillation.teacher_models.teacher_model.model_path"
        )
    by_key: dict[str, str] = {}
    for name, t in dist.teacher_models.items():
        if name == DEFAULT_TEACHER and len(names) > 1:
            continue  # veRL drops the default entry when others are added
        key = f"distillation.teacher_models.{name}"
        if not t.model_path:
            raise ConfigError(
                f"{key}.model_path is required with distillation.enabled=true: the teacher's HF folder"
            )
        if len(names) > 1 and not t.key:
            raise ConfigError(
                f"{key}.key is required with several teachers: the {dist.teacher_key} value of its rows"
            )
        if len(names) > 1 and t.key in by_key:
            raise ConfigError(
                f"{key}.key={t.key!r} is also the key of teacher_models.{by_key[t.key]}; keys must differ"
            )
        by_key[t.key] = name
        _validate_inference(t.inference, key, rollout)
    _validate_pool(dist)


def _validate_inference(inf: TeacherInferenceConfig, key: str, rollout: Any) -> None:
    prompt = inf.prompt_length if inf.prompt_length is not None else rollout.prompt_length
    response = inf.response_length if inf.response_length is not None else rollout.response_length
    if inf.max_model_len is not None and prompt + response + 1 > inf.max_model_len:
        raise ConfigError(
            f"{key}.inference.max_model_len={inf.max_model_len} < prompt + response + 1 = {prompt + response + 1}: "
            "the teacher reads the student's whole prompt and response; raise it or set it to null"
        )
    if inf.temperature is not None and inf.temperature <= 0:
        raise ConfigError(f"{key}.inference.temperature must be > 0, got {inf.temperature}")
    defaults = TeacherInferenceConfig()
    changed = [k for k in SERVER_ONLY_KEYS if getattr(inf, k) != getattr(defaults, k)]
    if changed:
        print(
            f"[hybridrl] note: {key}.inference.{{{', '.join(changed)}}} tune an inference server; the teacher "
            "runs here as a forward pass of the training engine (actor_rollout_ref.ref.*), where they have no effect"
        )


def _validate_pool(dist: DistillationConfig) -> None:
    teachers = dist.teachers()
    pool = dist.n_gpus_per_node * dist.nnodes
    if dist.nnodes < 0 or dist.n_gpus_per_node < 0:
        raise ConfigError("distillation.nnodes and distillation.n_gpus_per_node must be >= 0")
    if len(teachers) == 1 and DEFAULT_KEY in teachers:
        per = teachers[DEFAULT_KEY].inference.per_replica_world_size
        if pool % per:
            raise ConfigError(
                f"distillation pool {dist.nnodes} x {dist.n_gpus_per_node} = {pool} slots is not a multiple of the "
                f"teacher's tensor x data x pipeline parallel size {per}: change distillation.n_gpus_per_node"
            )
        return
    idle = sorted(k for k, t in teachers.items() if dist.nnodes > 0 and t.num_replicas < 1)
    if idle:
        raise ConfigError(
            f"the teachers with keys {idle} have num_replicas < 1 but distillation.nnodes={dist.nnodes} gives the "
            "teachers their own pool: set distillation.teacher_models.<name>.num_replicas >= 1 for each"
        )
    used = sum(t.num_replicas * t.inference.per_replica_world_size for t in teachers.values())
    if used != pool:
        raise ConfigError(
            f"the teachers' num_replicas x (inference tp x dp x pp) sum to {used} slots but the distillation pool "
            f"has distillation.nnodes x n_gpus_per_node = {pool} (0 nodes: colocated with the actor, then every "
            "num_replicas must be 0); make them equal"
        )
