"""Typed configuration of the rollout (generation) engines: `actor_rollout_ref.rollout.*`.

Key names and defaults follow veRL's `actor_rollout_ref.rollout` section so that veRL command
lines and YAML files carry over. Every field has a default and an OmegaConf-compatible type:
the trainer composes this dataclass into its structured config.

Notes on a few keys:
- `top_k`: any value <= 0 disables top-k in every engine (veRL uses -1 for vLLM and 0 for HF).
- `temperature == 0` or `do_sample == False` means greedy decoding.
- `n` is used by the *trainer* (it repeats each prompt n times before calling the engine); an
  engine always produces exactly one response per input row.
- `load_format`: "dummy" (or veRL's "dummy_dtensor" / "dummy_hf" / "dummy_megatron") starts
  the engine with random weights and relies on the first weight sync; "auto", "hf" or
  "safetensors" load the checkpoint at `model_path`.
- `mode`: `sync` generates with the engine directly; `async` (veRL's default) generates through
  the agent loops (`hybridrl/agent`, `single_turn_agent` unless configured otherwise), as
  veRL's async mode does. `server` (hybridrl) serves every trajectory to external agents through an
  OpenAI-compatible HTTP endpoint (`agent_server.*`, hybridrl/agent/server/, docs/agent.md).
- `enable_chunked_prefill`, `enable_prefix_caching`, `disable_log_stats`, `scheduling_policy`,
  `logprobs_mode`, `cudagraph_capture_sizes`: vLLM engine arguments veRL exposes at the top level
  (passed to `vllm.LLM`; `engine_kwargs.vllm` still wins). With `name=hf` they do nothing and the
  trainer says so once, except `enable_prefix_caching`: the HF engine then runs the prefill once
  per distinct prompt row of a micro-batch and shares its key/value cache with the row's repeats
  (GRPO's n samples of a prompt; rollout/hf_prefix.py).
- `checkpoint_engine`: veRL's newer home of the weight-sync settings. `backend` must be `naive`
  (the in-process, bucketed sync of the colocated engine, the only one here) and `engine_kwargs`
  must stay empty (the naive backend takes no options);
  `update_weights_bucket_megabytes`, when set, is the bucket size (it replaces the older
  top-level key of the same name).
- `log_prob_micro_batch_size`: veRL's deprecated global size, converted to
  `log_prob_micro_batch_size_per_gpu` (divided by the number of ranks) with a warning.
- `hf_decode_gemm_max_rows` (hybridrl, HF engine only): on CPU in float32, each linear layer of
  the rollout's model copy whose input has 2..this many rows (decode steps: one per row of the
  micro-batch) and whose weight is large enough (>= 2**19 elements with 2+ threads, >= 2**22 with
  one) computes x @ W^T as (W @ x^T)^T, which MKL runs 1.1-2.8x faster there on the 2-core CPU
  machines (cpu/decode_gemm.py, bench/cpu_gemm.py); prefill, other devices and dtypes
  stay on F.linear. 0 turns it off. Same numbers up to float rounding.
- `hf_sampler` (hybridrl, HF engine only): `auto` (default) samples by inverse CDF (one uniform per
  row: cpu/sampler.py) for vocabularies of >= 4096 tokens, where torch.multinomial's
  one exponential draw per vocabulary entry costs ~25 ms per decode step on CPU at 16 x 32k, and
  with `multinomial` (transformers' own) below; `multinomial` / `inverse_cdf` force one. The same
  distribution; other random numbers for the same seed.
- `gpu_memory_utilization`: vLLM / SGLang GPU memory fraction. On vLLM's CPU backend the KV
  cache size comes from `VLLM_CPU_KVCACHE_SPACE` or `engine_kwargs.vllm.kv_cache_memory_bytes`
  (if neither is set the engine sizes it for max_num_seqs x max_model_len, within bounds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridrl.config.agent import (
    AgentConfig,
    MultiTurnConfig,
    validate_agent_config,
    validate_multi_turn_config,
)
from hybridrl.config.agent_server import AgentServerConfig, validate_agent_server_config
from hybridrl.utils.profiler import ProfilerConfig

DUMMY_LOAD_FORMATS = ("dummy", "dummy_dtensor", "dummy_hf", "dummy_megatron")
REAL_LOAD_FORMATS = ("auto", "hf", "safetensors", "pt", "dtensor")
KEY = "actor_rollout_ref.rollout"


@dataclass
class SamplingOverrides:
    """`actor_rollout_ref.rollout.val_kwargs`: sampling used when `meta_info["validate"]` is set."""

    top_k: int = -1  # validation: top-k (<= 0: off)
    top_p: float = 1.0  # validation: nucleus top-p (1: off)
    temperature: float = 0.0  # validation: temperature (0: greedy)
    n: int = 1  # validation: responses per prompt
    do_sample: bool = False  # validation: sample (false: greedy)


@dataclass
class EngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs`: extra keyword arguments passed to the engine."""

    # extra keyword arguments of vllm.LLM (win over the top-level keys)
    vllm: dict[str, Any] = field(default_factory=dict)
    sglang: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of the SGLang engine


@dataclass
class CheckpointEngineConfig:
    """`actor_rollout_ref.rollout.checkpoint_engine`: how trained weights reach the engine."""

    backend: str = "naive"  # naive only (the colocated in-process, bucketed weight sync)
    # when set: replaces rollout.update_weights_bucket_megabytes
    update_weights_bucket_megabytes: int | None = None
    # veRL's per-backend constructor options ({backend: {...}}); must stay empty: the naive backend
    # takes none here (its bucket size is update_weights_bucket_megabytes)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


CHECKPOINT_ENGINE_BACKENDS = ("naive",)


@dataclass
class ServerConfig:
    """`actor_rollout_ref.rollout.server`: limits of the request-level path of
    `sglang_rollout_mode=server` (hybridrl: the batching queue in front of the in-process engine).

    timeout: seconds one generation request may wait + run before it is retried; max_attempts:
    tries per request (then the step fails, naming the keys); retry_delay: seconds between tries;
    max_connections: requests in flight at once. max_start_wait_time (waiting for a separate
    server process to come up) has no counterpart: the engine starts in-process; refused if changed.
    """

    timeout: float = 60.0  # seconds one request may wait and run before it is retried
    max_attempts: int = 3  # tries per request, then the step fails
    retry_delay: float = 2.0  # seconds between tries
    max_connections: int = 1000  # requests in flight at once
    # veRL's server start-up wait; only 300 is accepted (in-process engine)
    max_start_wait_time: float = 300.0


@dataclass
class TraceConfig:
    """`actor_rollout_ref.rollout.trace`: trace agent-loop trajectories (backend: mlflow | null;
    weave is refused), with decoded text when token2text (hybridrl.agent.trace)."""

    backend: str | None = None  # trajectory tracing: mlflow or null (off)
    token2text: bool = False  # also record the decoded text of the traced tokens
    max_samples_per_step_per_worker: int | None = None  # trajectories traced per step and worker (null: all)
    # hybridrl: the MLflow experiment and the experiment_name tag (the yaml links them to
    # trainer.project_name / trainer.experiment_name, as veRL does).
    project_name: str | None = None
    experiment_name: str | None = None  # MLflow experiment_name tag (the yaml links trainer.experiment_name)


SGLANG_ROLLOUT_MODES = ("engine", "server")
TRACE_BACKENDS = (None, "mlflow")


@dataclass
class RolloutConfig:
    """`actor_rollout_ref.rollout`: which engine generates, and how."""

    name: str = "vllm"  # generation engine: vllm, sglang or hf (Hugging Face generate)
    mode: str = "sync"  # sync (engine directly), async (agent loops) or server (external agents)
    temperature: float = 1.0  # sampling temperature (0: greedy)
    top_k: int = -1  # top-k sampling (<= 0: off)
    top_p: float = 1.0  # nucleus sampling top-p (1: off)
    do_sample: bool = True  # sample (false: greedy)
    n: int = 1  # responses sampled per prompt (the trainer repeats each prompt n times)
    prompt_length: int = 512  # longest prompt in tokens (<= 0 at start-up: data.max_prompt_length)
    response_length: int = 512  # most tokens per response (<= 0: data.max_response_length)
    dtype: str = "bfloat16"  # dtype of the engine's weights: bfloat16, float16 or float32
    gpu_memory_utilization: float = 0.5  # vLLM / SGLang GPU memory fraction
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    enforce_eager: bool = True  # vLLM: no CUDA graphs; SGLang: disable_cuda_graph
    free_cache_engine: bool = True  # put the engine to sleep (free its memory) between rollouts
    load_format: str = "dummy"  # dummy: random weights until the first sync; auto/hf/safetensors: load
    tensor_model_parallel_size: int = 1  # tensor-parallel size of one engine replica
    data_parallel_size: int = 1  # vLLM / SGLang data-parallel copies of a TP engine (the replicas); 1 with EP
    expert_parallel_size: int = 1  # vLLM / SGLang MoE: experts over the engine's TP ranks (must be tp x dp)
    moe_tensor_parallel_size: int = 1  # TensorRT-LLM's MoE TP: 1 only (no TensorRT-LLM rollout)
    max_num_batched_tokens: int = 8192  # vLLM: tokens per engine step
    max_num_seqs: int = 1024  # vLLM: sequences per engine step
    max_model_len: int | None = None  # engine context length (null: prompt_length + response_length)
    enable_chunked_prefill: bool = True  # vLLM engine argument
    enable_prefix_caching: bool = True  # vLLM argument; hf: one prefill per distinct prompt row
    disable_log_stats: bool = True  # vLLM engine argument
    scheduling_policy: str = "fcfs"  # vLLM scheduling: fcfs or priority
    logprobs_mode: str = "processed_logprobs"  # vLLM: which log-probs the engine returns
    # vLLM: batch sizes captured as CUDA graphs (null: vLLM's)
    cudagraph_capture_sizes: list[int] | None = None
    log_prob_micro_batch_size: int | None = None  # a global size: divided by the ranks into the per-GPU key
    log_prob_micro_batch_size_per_gpu: int | None = None  # rows per forward of the actor's old-log-prob pass
    log_prob_use_dynamic_bsz: bool = False  # pack the old-log-prob forwards by tokens
    log_prob_max_token_len_per_gpu: int = 16384  # token budget of those forwards with dynamic batch size
    calculate_log_probs: bool = False  # the engine also returns its log-probs (rollout_log_probs)
    enable_rollout_routing_replay: bool = False  # MoE: record each token's experts (routed_experts), for R3
    seed: int = 0  # base seed of the engine's sampling
    engine_kwargs: EngineKwargs = field(default_factory=EngineKwargs)
    val_kwargs: SamplingOverrides = field(default_factory=SamplingOverrides)
    update_weights_bucket_megabytes: int = 512  # size of the weight-sync buckets
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    layered_summon: bool = False  # weight-sync buckets end at decoder-layer boundaries
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    over_sample_rate: float = 0.0  # agent loops: abort the slowest fraction of trajectories
    multi_stage_wake_up: bool = False  # wake the weights, sync, then the KV cache (lower peak memory)
    sglang_rollout_mode: str = "engine"  # engine, or server (requests through a batching queue)
    server: ServerConfig = field(default_factory=ServerConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)  # trainer/ppo/profiling.py
    agent_server: AgentServerConfig = field(default_factory=AgentServerConfig)  # hybridrl: mode=server
    hf_decode_gemm_max_rows: int = 128  # hybridrl: see the module docstring; 0 = off
    hf_sampler: str = "auto"  # hybridrl: auto | multinomial | inverse_cdf (module docstring)

    def __post_init__(self) -> None:
        # Plain dicts (e.g. from a Python caller) become the typed sections.
        if isinstance(self.engine_kwargs, dict):
            self.engine_kwargs = EngineKwargs(**self.engine_kwargs)
        if isinstance(self.checkpoint_engine, dict):
            self.checkpoint_engine = CheckpointEngineConfig(**self.checkpoint_engine)
        ce = self.checkpoint_engine
        if ce.update_weights_bucket_megabytes is not None:
            self.update_weights_bucket_megabytes = ce.update_weights_bucket_megabytes
        if isinstance(self.val_kwargs, dict):
            self.val_kwargs = SamplingOverrides(**self.val_kwargs)
        if isinstance(self.multi_turn, dict):
            self.multi_turn = MultiTurnConfig(**self.multi_turn)
        if isinstance(self.agent, dict):
            self.agent = AgentConfig(**self.agent)
        if isinstance(self.server, dict):
            self.server = ServerConfig(**self.server)
        if isinstance(self.trace, dict):
            self.trace = TraceConfig(**self.trace)
        if isinstance(self.agent_server, dict):
            self.agent_server = AgentServerConfig(**self.agent_server)
        validate_rollout_config(self)

    @property
    def is_dummy_load(self) -> bool:
        return self.load_format in DUMMY_LOAD_FORMATS

    @property
    def effective_max_model_len(self) -> int:
        """max_model_len, or prompt_length + response_length when it is unset."""
        return self.max_model_len or (self.prompt_length + self.response_length)


def _has_options(per_backend: Any) -> bool:
    """True when {backend: {option: value}} sets any option (empty per-backend sections are none)."""
    return any(not isinstance(v, Mapping) or len(v) > 0 for v in dict(per_backend or {}).values())


def _check(ok: bool, key: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{KEY}.{key}={value!r} is invalid: {want}.")


def validate_rollout_config(cfg: RolloutConfig) -> None:
    """Fail early, naming the key and the fix."""
    _check(cfg.mode in ("sync", "async", "server"), "mode", cfg.mode, "use 'sync', 'async' or 'server'")
    _check(
        cfg.mode != "server" or cfg.tensor_model_parallel_size == 1,
        "mode",
        cfg.mode,
        "the rollout server needs tensor_model_parallel_size=1 (one engine per replica); set it to 1",
    )
    validate_agent_server_config(cfg.agent_server)
    _check(cfg.temperature >= 0, "temperature", cfg.temperature, "use a value >= 0 (0 = greedy)")
    _check(0 < cfg.top_p <= 1, "top_p", cfg.top_p, "use a value in (0, 1]; 1 disables top-p")
    _check(cfg.n >= 1, "n", cfg.n, "use n >= 1")
    _check(cfg.prompt_length >= 1, "prompt_length", cfg.prompt_length, "use a positive length")
    _check(cfg.response_length >= 1, "response_length", cfg.response_length, "use a positive length")
    _check(
        cfg.dtype in ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32"),
        "dtype",
        cfg.dtype,
        "use bfloat16, float16 or float32",
    )
    _check(
        0 < cfg.gpu_memory_utilization <= 1,
        "gpu_memory_utilization",
        cfg.gpu_memory_utilization,
        "use a fraction in (0, 1]",
    )
    _check(
        cfg.load_format in DUMMY_LOAD_FORMATS + REAL_LOAD_FORMATS,
        "load_format",
        cfg.load_format,
        f"use one of {DUMMY_LOAD_FORMATS + REAL_LOAD_FORMATS}",
    )
    _validate_engine_options(cfg)
    v = cfg.val_kwargs
    _check(v.temperature >= 0, "val_kwargs.temperature", v.temperature, "use a value >= 0")
    _check(0 < v.top_p <= 1, "val_kwargs.top_p", v.top_p, "use a value in (0, 1]")
    _check(v.n >= 1, "val_kwargs.n", v.n, "use n >= 1")
    validate_multi_turn_config(cfg.multi_turn)
    validate_agent_config(cfg.agent)
    validate_request_options(cfg)


def _validate_engine_options(cfg: RolloutConfig) -> None:
    """The engine's parallel, batching, length and weight-sync keys."""
    _check(
        cfg.tensor_model_parallel_size >= 1,
        "tensor_model_parallel_size",
        cfg.tensor_model_parallel_size,
        ">= 1",
    )
    _check(cfg.max_num_seqs >= 1, "max_num_seqs", cfg.max_num_seqs, "use >= 1")
    _check(cfg.max_num_batched_tokens >= 1, "max_num_batched_tokens", cfg.max_num_batched_tokens, "use >= 1")
    if cfg.max_model_len is not None:
        _check(
            cfg.max_model_len >= cfg.prompt_length + cfg.response_length,
            "max_model_len",
            cfg.max_model_len,
            f"it must hold prompt_length + response_length = {cfg.prompt_length + cfg.response_length} "
            "(raise it or leave it null)",
        )
    if cfg.log_prob_micro_batch_size_per_gpu is not None:
        _check(
            cfg.log_prob_micro_batch_size_per_gpu >= 1,
            "log_prob_micro_batch_size_per_gpu",
            cfg.log_prob_micro_batch_size_per_gpu,
            "use >= 1 or null",
        )
    _check(
        cfg.update_weights_bucket_megabytes >= 1,
        "update_weights_bucket_megabytes",
        cfg.update_weights_bucket_megabytes,
        "use >= 1",
    )
    _check(
        cfg.checkpoint_engine.backend in CHECKPOINT_ENGINE_BACKENDS,
        "checkpoint_engine.backend",
        cfg.checkpoint_engine.backend,
        f"use one of {CHECKPOINT_ENGINE_BACKENDS} (the colocated in-process sync; veRL's nccl/nixl "
        "backends move weights between separate rollout and trainer GPUs, not available here)",
    )
    _check(
        not _has_options(cfg.checkpoint_engine.engine_kwargs),
        "checkpoint_engine.engine_kwargs",
        dict(cfg.checkpoint_engine.engine_kwargs),
        "the naive backend takes no constructor options here; leave it empty (the bucket size is "
        "checkpoint_engine.update_weights_bucket_megabytes; main_async's collective sync is set with "
        "async_training.* keys)",
    )
    _check(
        cfg.scheduling_policy in ("fcfs", "priority"),
        "scheduling_policy",
        cfg.scheduling_policy,
        "use 'fcfs' or 'priority'",
    )
    _check(
        cfg.hf_decode_gemm_max_rows >= 0,
        "hf_decode_gemm_max_rows",
        cfg.hf_decode_gemm_max_rows,
        "use a row count >= 0 (0 turns the CPU decode GEMM off)",
    )
    _check(
        cfg.hf_sampler in ("auto", "multinomial", "inverse_cdf"),
        "hf_sampler",
        cfg.hf_sampler,
        "use 'auto', 'multinomial' or 'inverse_cdf'",
    )


def validate_request_options(cfg: RolloutConfig) -> None:
    """over_sample_rate, sglang_rollout_mode / server.*, trace.*: values, and that they act here."""
    _check(
        0 <= cfg.over_sample_rate < 1, "over_sample_rate", cfg.over_sample_rate, "use a fraction in [0, 1)"
    )
    agent_path = (
        cfg.mode in ("async", "server")
        or cfg.sglang_rollout_mode == "server"
        or cfg.multi_turn.enable
        or cfg.agent.default_agent_loop != "single_turn_agent"
        or bool(cfg.agent.agent_loop_config_path)
    )
    _check(
        cfg.over_sample_rate == 0 or agent_path,
        "over_sample_rate",
        cfg.over_sample_rate,
        "it aborts the slowest trajectories of the agent loops; enable them (multi_turn.enable=true or "
        "rollout.mode=async) or set it to 0",
    )
    _check(
        cfg.sglang_rollout_mode in SGLANG_ROLLOUT_MODES,
        "sglang_rollout_mode",
        cfg.sglang_rollout_mode,
        f"use one of {SGLANG_ROLLOUT_MODES}",
    )
    sv = cfg.server
    _check(sv.timeout > 0, "server.timeout", sv.timeout, "use seconds > 0")
    _check(sv.max_attempts >= 1, "server.max_attempts", sv.max_attempts, "use >= 1")
    _check(sv.retry_delay >= 0, "server.retry_delay", sv.retry_delay, "use seconds >= 0")
    _check(sv.max_connections >= 1, "server.max_connections", sv.max_connections, "use >= 1")
    _check(
        sv.max_start_wait_time == 300.0,
        "server.max_start_wait_time",
        sv.max_start_wait_time,
        "hybridrl's engines start in-process (no server process to wait for); leave it at 300",
    )
    tr = cfg.trace
    _check(
        tr.backend is None or agent_path,
        "trace.backend",
        tr.backend,
        "it traces agent-loop trajectories; enable them (multi_turn.enable=true or rollout.mode=async)",
    )
    _check(
        tr.backend != "mlflow" or importlib.util.find_spec("mlflow") is not None,
        "trace.backend",
        tr.backend,
        "the 'mlflow-skinny' (or 'mlflow') package is not installed: pip install mlflow-skinny",
    )
    _check(
        tr.backend in TRACE_BACKENDS,
        "trace.backend",
        tr.backend,
        "use mlflow or null (weave is not supported here)",
    )
    _check(
        tr.max_samples_per_step_per_worker is None or tr.max_samples_per_step_per_worker >= 0,
        "trace.max_samples_per_step_per_worker",
        tr.max_samples_per_step_per_worker,
        "use a count >= 0 or null (all)",
    )
