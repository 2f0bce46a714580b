"""The table of AReaL experiment-file keys (`RULES`) and their translations into hybridrl keys.

Each entry is a leaf key of AReaL's gsm8k GRPO example (or a section read as one value) and says
whether it is translated, a no-op under Ray (with the reason), or refused unless off (with the
reason). `hybridrl.compat.areal_file` reads a file against it; docs/async.md lists it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridrl.compat.async_keys import AT, allocation_overrides, weight_update_overrides
from hybridrl.utils.config_loader import ConfigError

__all__ = ["RULES", "Rule", "fmt", "rule_for"]

ARR = "actor_rollout_ref"
ACTOR = f"{ARR}.actor"
ROLLOUT = f"{ARR}.rollout"
DTYPES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
}


@dataclass(frozen=True)
class Rule:
    """How one AReaL key is read.

    kind: "translated", "no-op" or "refused".
    why: for a no-op, why Ray makes it moot; for a refusal, what hybridrl lacks and what to use.
    translate: (value, file) -> hybridrl `key=value` overrides ("translated" only).
    check: (value, file) -> None, raises ConfigError for a value that cannot be honoured.
    off: for "refused", the values that leave the feature off (accepted).
    """

    kind: str
    why: str = ""
    translate: Callable[[Any, DictConfig], list[str]] | None = None
    check: Callable[[Any, DictConfig], None] | None = None
    off: tuple = (None, False)


def _to(*keys: str) -> Callable[[Any, DictConfig], list[str]]:
    return lambda v, _: [f"{k}={fmt(v)}" for k in keys]


def fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(fmt(v) for v in value) + "]"
    return str(value)


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def _same_as(other: str, what: str) -> Callable[[Any, DictConfig], None]:
    """A per-section copy of another key: any other value is refused (hybridrl has one)."""

    def check(value: Any, cfg: DictConfig) -> None:
        if value != _get(cfg, other):
            raise ConfigError(f"differs from {other}={_get(cfg, other)!r}; {what}")

    return check


def _one_of(allowed: tuple, why: str) -> Callable[[Any, DictConfig], None]:
    def check(value: Any, _: DictConfig) -> None:
        if value not in allowed:
            raise ConfigError(f"{why} (accepted: {', '.join(map(repr, allowed))})")

    return check


# ------------------------------------------------------------------------------------ translations
def _dtype(value: Any) -> str:
    if str(value) not in DTYPES:
        raise ConfigError(f"dtype {value!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[str(value)]


def _actor_dtype(v: Any, cfg: DictConfig) -> list[str]:
    d = _dtype(v)  # FSDP keeps fp32 master weights and computes in this dtype, as AReaL's bf16 training
    return [f"{ACTOR}.fsdp_config.mixed_precision.param_dtype={d}"]


def _ref_dtype(v: Any, cfg: DictConfig) -> list[str]:
    return [f"{ARR}.ref.fsdp_config.mixed_precision.param_dtype={_dtype(v)}"]


def _engine(cfg: DictConfig) -> str:
    return str(_get(cfg, "allocation_mode", "")).partition(":")[0]


def _engine_key(
    engine: str, fn: Callable[[Any, DictConfig], list[str]]
) -> Callable[[Any, DictConfig], list[str]]:
    """A `sglang.*` / `vllm.*` key acts only when allocation_mode selects that engine."""
    return lambda v, cfg: fn(v, cfg) if _engine(cfg) == engine else []


def _engine_same_path(engine: str) -> Callable[[Any, DictConfig], None]:
    def check(value: Any, cfg: DictConfig) -> None:
        if _engine(cfg) == engine and value != _get(cfg, "actor.path"):
            raise ConfigError(
                f"differs from actor.path={_get(cfg, 'actor.path')!r}: the rollout engine serves the actor's weights"
            )

    return check


def _skip_tokenizer(value: Any, cfg: DictConfig) -> None:
    """Either value works: hybridrl sends token ids and detokenizes on its own side."""


def _dataset_type(value: Any, _: DictConfig) -> None:
    if value != "rl":
        raise ConfigError(
            f"type {value!r}: main_async trains on RL prompts (type: rl); supervised data goes to "
            "python -m hybridrl.trainer.main_sft"
        )


def _max_length(v: Any, _: DictConfig) -> list[str]:
    # AReaL drops prompts longer than max_length; hybridrl does the same with the filter on
    return [f"data.max_prompt_length={v}", "data.filter_overlong_prompts=true"]


def _tokens_per_mb(role: str) -> Callable[[Any, DictConfig], list[str]]:
    """AReaL splits micro-batches by tokens: hybridrl's dynamic batch size with that token budget."""

    def translate(v: Any, _: DictConfig) -> list[str]:
        if role == "actor":
            return [
                f"{ACTOR}.use_dynamic_bsz=true",
                f"{ACTOR}.ppo_max_token_len_per_gpu={v}",
                f"{ROLLOUT}.log_prob_use_dynamic_bsz=true",
                f"{ROLLOUT}.log_prob_max_token_len_per_gpu={v}",
            ]
        return [f"{ARR}.ref.log_prob_use_dynamic_bsz=true", f"{ARR}.ref.log_prob_max_token_len_per_gpu={v}"]

    return translate


def _betas(_: Any, cfg: DictConfig) -> list[str]:
    b1, b2 = _get(cfg, "actor.optimizer.beta1", 0.9), _get(cfg, "actor.optimizer.beta2", 0.999)
    return [f"{ACTOR}.optim.betas=[{b1},{b2}]"]


def _kl(v: Any, _: DictConfig) -> list[str]:
    """AReaL's kl_ctl is a fixed KL penalty in the reward (0: none)."""
    if float(v) == 0.0:
        return ["algorithm.use_kl_in_reward=false", f"{ACTOR}.use_kl_loss=false"]
    return [
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=fixed",
        f"algorithm.kl_ctrl.kl_coef={v}",
    ]


def _minibatches(v: Any, cfg: DictConfig) -> list[str]:
    batch = _get(cfg, "train_dataset.batch_size")
    if batch is None or int(v) < 1 or int(batch) % int(v):
        raise ConfigError(
            f"{v} must divide train_dataset.batch_size={batch} (hybridrl's ppo_mini_batch_size = "
            "batch_size / ppo_n_minibatches)"
        )
    return [f"{ACTOR}.ppo_mini_batch_size={int(batch) // int(v)}"]


def _estimator(_: Any, cfg: DictConfig) -> list[str]:
    """reward_norm (group mean / std) and adv_norm (batch mean / std) as an advantage estimator."""
    rn, an = _get(cfg, "actor.reward_norm"), _get(cfg, "actor.adv_norm")
    r_mean, r_std = (_get(rn, "mean_level"), _get(rn, "std_level")) if rn is not None else (None, None)
    a_mean, a_std = (_get(an, "mean_level"), _get(an, "std_level")) if an is not None else (None, None)
    if r_mean != "group" or r_std not in ("group", None):
        raise ConfigError(
            f"reward_norm mean_level={r_mean!r} std_level={r_std!r}: hybridrl's group estimators normalise "
            "within the group (mean_level: group, std_level: group or null)"
        )
    if (a_mean, a_std) not in ((None, None), ("batch", "batch")):
        raise ConfigError(
            f"adv_norm mean_level={a_mean!r} std_level={a_std!r}: translated are no adv_norm (null) and "
            "batch / batch (whitening over the batch's response tokens)"
        )
    name = "grpo_batch_whitened" if a_mean == "batch" else "grpo"
    return [f"algorithm.adv_estimator={name}", f"algorithm.norm_adv_by_std_in_grpo={fmt(r_std == 'group')}"]


def _affine_reward(value: Any, cfg: DictConfig) -> None:
    """(r + bias) * scaling is undone by group mean / std normalisation (up to its epsilon)."""
    rn = _get(cfg, "actor.reward_norm")
    if rn is None or _get(rn, "mean_level") != "group" or _get(rn, "std_level") != "group":
        raise ConfigError(
            "reward scaling / bias are only moot under reward_norm mean_level: group, std_level: group; "
            "hybridrl has no reward affine transform: put it in your reward function"
        )


def _run_dir(section: str, sub: str) -> Callable[[Any, DictConfig], list[str]]:
    def translate(root: Any, cfg: DictConfig) -> list[str]:
        if section == "rollout" and not _get(cfg, "rollout.dump_to_file", False):
            return []
        where = f"{root}/{sub}/{_get(cfg, 'experiment_name')}/{_get(cfg, 'trial_name')}"
        key = "trainer.default_local_dir" if section == "saver" else "trainer.rollout_data_dir"
        return [f"{key}={where}"]

    return translate


def _steps_per_epoch(cfg: DictConfig) -> int:
    """Full batches in one pass over train_dataset (rows before the length filter; the last
    partial batch is dropped, as hybridrl's sampler does)."""
    path, batch = _get(cfg, "train_dataset.path"), int(_get(cfg, "train_dataset.batch_size"))
    if not (isinstance(path, str) and path.endswith(".parquet") and Path(path).is_file()):
        raise ConfigError(
            f"counts epochs of train_dataset.path={path!r}, which is not a local parquet file; give the "
            "frequency in steps (freq_steps) or set trainer.save_freq / trainer.test_freq"
        )
    import pyarrow.parquet as pq

    return max(1, pq.read_metadata(path).num_rows // batch)


def _freq(section: str) -> Callable[[Any, DictConfig], list[str]]:
    """saver / evaluator freq_epochs and freq_steps: one step frequency (AReaL fires on either)."""
    key = "trainer.save_freq" if section == "saver" else "trainer.test_freq"

    def translate(_: Any, cfg: DictConfig) -> list[str]:
        epochs, steps = _get(cfg, f"{section}.freq_epochs"), _get(cfg, f"{section}.freq_steps")
        every = [int(steps)] if steps else []
        if epochs:
            every.append(int(epochs) * _steps_per_epoch(cfg))
        return [f"{key}={min(every) if every else -1}"]

    return translate


def _recover(v: Any, _: DictConfig) -> list[str]:
    modes = {"disabled": "disable", "auto": "auto", "fault": "auto", "resume": "auto"}
    if v not in modes:
        raise ConfigError(f"mode {v!r} is not one of {', '.join(modes)}")
    return [f"trainer.resume_mode={modes[v]}"]


def _recover_freq(value: Any, cfg: DictConfig) -> None:
    if _get(cfg, "recover.mode") != "disabled" and value is not None:
        raise ConfigError(
            "hybridrl writes one checkpoint, at saver.freq_*, and resumes from it; with recover.mode other "
            "than disabled leave recover.freq_* null and set saver.freq_*"
        )


def _wandb(v: Any, _: DictConfig) -> list[str]:
    if v == "disabled":
        return ["trainer.logger=[console]"]
    if v in ("online", "offline"):
        if v == "offline":
            os.environ.setdefault("WANDB_MODE", "offline")
        return ["trainer.logger=[console,wandb]"]
    raise ConfigError(f"mode {v!r} is not one of disabled, online, offline")


def _cluster_nodes(v: Any, _: DictConfig) -> list[str]:
    if int(v) != 1:
        raise ConfigError(
            f"n_nodes={v}: the AReaL file is translated for one node; on several, set trainer.nnodes and "
            f"{AT}.rollout_nnodes on the command line (allocation_mode then counts one node's devices)"
        )
    return ["trainer.nnodes=1", f"{AT}.rollout_nnodes=1"]


def _fits_cluster(value: Any, cfg: DictConfig) -> None:
    """allocation_mode must fit n_gpus_per_node (the devices themselves Ray finds)."""
    mode = str(_get(cfg, "allocation_mode", ""))
    used = 0
    for part in mode.partition(":")[2].split("+"):
        nums = (
            [int(x) for x in part[1:].replace("p", " ").replace("t", " ").split()] if part[:1] == "d" else []
        )
        used += nums[0] * nums[2] if len(nums) == 3 else 0
    if value is not None and used > int(value):
        raise ConfigError(f"allocation_mode={mode} uses {used} devices, more than n_gpus_per_node={value}")


# ------------------------------------------------------------------------------------------ table
NAME = "hybridrl names the run once, from experiment_name and trial_name"
SCHED = "Ray places the workers in its resource pools (allocation_mode sizes them); no per-worker launch spec"
FILES = "hybridrl writes files where the saver (checkpoints) and rollout.dump_to_file (samples) say"
SAME_RUN = _same_as("experiment_name", NAME)
SAME_TRIAL = _same_as("trial_name", NAME)


def _named(section: str) -> dict[str, Rule]:
    return {
        f"{section}.experiment_name": Rule("no-op", NAME, check=SAME_RUN),
        f"{section}.trial_name": Rule("no-op", NAME, check=SAME_TRIAL),
    }


def _files(section: str) -> dict[str, Rule]:
    return {f"{section}.fileroot": Rule("no-op", FILES)}


RULES: dict[str, Rule] = {
    # ---- the run
    "experiment_name": Rule("translated", translate=_to("trainer.project_name")),
    "trial_name": Rule("translated", translate=_to("trainer.experiment_name")),
    "seed": Rule("translated", translate=_to("trainer.seed")),
    "enable_offload": Rule("translated", translate=_to(f"{ACTOR}.fsdp_config.param_offload")),
    "total_train_epochs": Rule("translated", translate=_to("trainer.total_epochs")),
    "tokenizer_path": Rule("translated", translate=_to(f"{ARR}.model.tokenizer_path")),
    "allocation_mode": Rule("translated", translate=lambda v, _: allocation_overrides(str(v))),
    # ---- cluster / scheduler
    "cluster.n_nodes": Rule("translated", translate=_cluster_nodes),
    "cluster.n_gpus_per_node": Rule(
        "no-op",
        "Ray finds the node's devices; allocation_mode says how many each pool takes",
        check=_fits_cluster,
    ),
    "cluster.fileroot": Rule("no-op", FILES),
    "cluster.name_resolve": Rule(
        "no-op", "workers find each other through Ray's control store (no NFS/etcd records)"
    ),
    "scheduler.type": Rule(
        "no-op",
        "the Ray cluster is the scheduler (locally an embedded one; RAY_ADDRESS or `ray job submit` for a cluster)",
        check=_one_of(
            (None, "local", "ray"), "hybridrl runs on Ray: submit to a cluster with `ray job submit`"
        ),
    ),
    # ---- rollout
    **_named("rollout"),
    "rollout.max_concurrent_rollouts": Rule("translated", translate=_to(f"{AT}.max_concurrent_rollouts")),
    "rollout.queue_size": Rule("translated", translate=_to(f"{AT}.queue_size")),
    "rollout.consumer_batch_size": Rule("translated", translate=_to(f"{AT}.consumer_batch_size")),
    "rollout.max_head_offpolicyness": Rule("translated", translate=_to(f"{AT}.max_head_offpolicyness")),
    "rollout.enable_rollout_tracing": Rule(
        "refused", "per-request rollout traces are not recorded; use global_profiler.* for traces"
    ),
    "rollout.scheduling_spec": Rule("no-op", SCHED),
    "rollout.fileroot": Rule("translated", translate=_run_dir("rollout", "rollouts")),
    "rollout.tokenizer_path": Rule(
        "no-op",
        "the rollout uses the model's tokenizer",
        check=_same_as("tokenizer_path", "one tokenizer per run"),
    ),
    "rollout.dump_to_file": Rule(
        "no-op", "read with rollout.fileroot, which becomes trainer.rollout_data_dir when it is true"
    ),
    # ---- generation
    "gconfig.n_samples": Rule("translated", translate=_to(f"{ROLLOUT}.n")),
    "gconfig.max_new_tokens": Rule(
        "translated", translate=_to(f"{ROLLOUT}.response_length", "data.max_response_length")
    ),
    "gconfig.temperature": Rule("translated", translate=_to(f"{ROLLOUT}.temperature")),
    "gconfig.min_new_tokens": Rule(
        "refused", "the rollout engines are not given a minimum length", off=(0, None)
    ),
    "gconfig.greedy": Rule(
        "refused",
        "GRPO compares sampled answers; greedy decoding makes every answer of a group the same (greedy "
        "validation: actor_rollout_ref.rollout.val_kwargs.do_sample=false)",
    ),
    # ---- actor
    **_named("actor"),
    "actor.path": Rule("translated", translate=_to(f"{ARR}.model.path")),
    "actor.init_from_scratch": Rule("translated", translate=_to(f"{ARR}.model.init_from_scratch")),
    "actor.disable_dropout": Rule(
        "translated",  # the attention dropout of Llama / Qwen-style configs (their only dropout)
        translate=lambda v, _: [f"+{ARR}.model.override_config.attention_dropout=0.0"] if v else [],
    ),
    "actor.gradient_checkpointing": Rule(
        "translated", translate=_to(f"{ARR}.model.enable_gradient_checkpointing")
    ),
    "actor.dtype": Rule("translated", translate=_actor_dtype),
    "actor.mb_spec.max_tokens_per_mb": Rule("translated", translate=_tokens_per_mb("actor")),
    "actor.optimizer.type": Rule(
        "no-op",
        "hybridrl's optimizer is AdamW, which AReaL's adam is",
        check=_one_of(("adam", "adamw"), "only AdamW is available"),
    ),
    "actor.optimizer.lr": Rule("translated", translate=_to(f"{ACTOR}.optim.lr")),
    "actor.optimizer.weight_decay": Rule("translated", translate=_to(f"{ACTOR}.optim.weight_decay")),
    "actor.optimizer.beta1": Rule("translated", translate=_betas),
    "actor.optimizer.beta2": Rule("translated", translate=_betas),
    "actor.optimizer.eps": Rule("translated", translate=_to(f"{ACTOR}.optim.eps")),
    "actor.optimizer.lr_scheduler_type": Rule(
        "translated", translate=_to(f"{ACTOR}.optim.lr_scheduler_type")
    ),
    "actor.optimizer.gradient_clipping": Rule("translated", translate=_to(f"{ACTOR}.grad_clip")),
    "actor.optimizer.warmup_steps_proportion": Rule(
        "translated", translate=_to(f"{ACTOR}.optim.lr_warmup_steps_ratio")
    ),
    "actor.eps_clip": Rule("translated", translate=_to(f"{ACTOR}.clip_ratio")),
    "actor.temperature": Rule(
        "no-op",
        "log-probs are computed at the rollout temperature",
        check=_same_as("gconfig.temperature", "one temperature for sampling and training"),
    ),
    "actor.reward_scaling": Rule(
        "no-op", "undone by the group mean / std normalisation", check=_affine_reward
    ),
    "actor.reward_bias": Rule("no-op", "undone by the group mean / std normalisation", check=_affine_reward),
    "actor.kl_ctl": Rule("translated", translate=_kl),
    "actor.ppo_n_minibatches": Rule("translated", translate=_minibatches),
    "actor.recompute_logprob": Rule("translated", translate=_to(f"{AT}.recompute_logprob")),
    "actor.use_decoupled_loss": Rule("translated", translate=_to(f"{AT}.use_decoupled_loss")),
    "actor.behave_imp_weight_cap": Rule("translated", translate=_to(f"{AT}.behave_imp_weight_cap")),
    "actor.reward_norm.mean_level": Rule("translated", translate=_estimator),
    "actor.reward_norm.std_level": Rule("translated", translate=_estimator),
    "actor.reward_norm.group_size": Rule(
        "no-op",
        "the group is the prompt's n samples",
        check=_same_as("gconfig.n_samples", "the group size is n_samples"),
    ),
    "actor.adv_norm.mean_level": Rule("translated", translate=_estimator),
    "actor.adv_norm.std_level": Rule("translated", translate=_estimator),
    "actor.weight_update_mode": Rule("translated", translate=lambda v, _: weight_update_overrides(str(v))),
    "actor.max_new_tokens": Rule(
        "no-op",
        "read from gconfig.max_new_tokens",
        check=_same_as("gconfig.max_new_tokens", "one response length"),
    ),
    "actor.scheduling_spec": Rule("no-op", SCHED),
    # ---- reference model
    **_named("ref"),
    "ref.path": Rule(
        "no-op",
        "the reference is the actor's initial weights",
        check=_same_as("actor.path", "the reference model is the actor's starting point"),
    ),
    "ref.init_from_scratch": Rule(
        "no-op",
        "the reference loads what the actor loads",
        check=_same_as("actor.init_from_scratch", "one model"),
    ),
    "ref.disable_dropout": Rule("no-op", "the reference only runs forward passes in eval mode (no dropout)"),
    "ref.dtype": Rule("translated", translate=_ref_dtype),
    "ref.mb_spec.max_tokens_per_mb": Rule("translated", translate=_tokens_per_mb("ref")),
    "ref.optimizer": Rule(
        "no-op",
        "the reference is never trained",
        check=_one_of((None,), "the reference model is never trained"),
    ),
    "ref.scheduling_strategy.type": Rule(
        "no-op",
        "the reference always shares the actor's workers",
        check=_one_of(("colocation",), "the reference always shares the actor's workers"),
    ),
    "ref.scheduling_strategy.target": Rule(
        "no-op",
        "the reference always shares the actor's workers",
        check=_one_of(("actor",), "the reference always shares the actor's workers"),
    ),
    "ref.scheduling_spec": Rule("no-op", SCHED),
    # ---- inference engines (the one allocation_mode names acts; the other is read and left)
    "sglang.model_path": Rule("no-op", "the engine serves actor.path", check=_engine_same_path("sglang")),
    "sglang.random_seed": Rule("translated", translate=_engine_key("sglang", _to(f"{ROLLOUT}.seed"))),
    "sglang.skip_tokenizer_init": Rule("no-op", "hybridrl sends token ids either way", check=_skip_tokenizer),
    "sglang.dtype": Rule("translated", translate=_engine_key("sglang", _to(f"{ROLLOUT}.dtype"))),
    "sglang.max_running_requests": Rule(
        "translated",
        translate=_engine_key("sglang", lambda v, _: [] if v is None else [f"{ROLLOUT}.max_num_seqs={v}"]),
    ),
    "sglang.context_length": Rule(
        "translated", translate=_engine_key("sglang", _to(f"{ROLLOUT}.max_model_len"))
    ),
    "sglang.mem_fraction_static": Rule(
        "translated", translate=_engine_key("sglang", _to(f"{ROLLOUT}.gpu_memory_utilization"))
    ),
    "vllm.model": Rule("no-op", "the engine serves actor.path", check=_engine_same_path("vllm")),
    "vllm.seed": Rule("translated", translate=_engine_key("vllm", _to(f"{ROLLOUT}.seed"))),
    "vllm.skip_tokenizer_init": Rule("no-op", "hybridrl sends token ids either way", check=_skip_tokenizer),
    "vllm.dtype": Rule("translated", translate=_engine_key("vllm", _to(f"{ROLLOUT}.dtype"))),
    "vllm.max_model_len": Rule("translated", translate=_engine_key("vllm", _to(f"{ROLLOUT}.max_model_len"))),
    "vllm.gpu_memory_utilization": Rule(
        "translated", translate=_engine_key("vllm", _to(f"{ROLLOUT}.gpu_memory_utilization"))
    ),
    # ---- data
    "train_dataset.batch_size": Rule("translated", translate=_to("data.train_batch_size")),
    "train_dataset.shuffle": Rule("translated", translate=_to("data.shuffle")),
    "train_dataset.pin_memory": Rule(
        "no-op", "batches reach the workers through Ray's object store, not pinned host memory"
    ),
    "train_dataset.num_workers": Rule("translated", translate=_to("data.dataloader_num_workers")),
    "train_dataset.path": Rule("translated", translate=_to("data.train_files")),
    "train_dataset.type": Rule("no-op", "main_async reads RL prompts", check=_dataset_type),
    "train_dataset.max_length": Rule("translated", translate=_max_length),
    "valid_dataset.batch_size": Rule("translated", translate=_to("data.val_batch_size")),
    "valid_dataset.shuffle": Rule("no-op", "validation reads the whole set in order"),
    "valid_dataset.pin_memory": Rule(
        "no-op", "batches reach the workers through Ray's object store, not pinned host memory"
    ),
    "valid_dataset.num_workers": Rule("no-op", "validation batches are read by the same loader settings"),
    "valid_dataset.path": Rule("translated", translate=_to("data.val_files")),
    "valid_dataset.type": Rule("no-op", "main_async reads RL prompts", check=_dataset_type),
    "valid_dataset.max_length": Rule("no-op", "validation prompts use train_dataset.max_length"),
    # ---- checkpoints, recovery, evaluation, logging, tracing
    **_named("saver"),
    "saver.fileroot": Rule("translated", translate=_run_dir("saver", "checkpoints")),
    "saver.freq_epochs": Rule("translated", translate=_freq("saver")),
    "saver.freq_steps": Rule("translated", translate=_freq("saver")),
    "saver.freq_secs": Rule("translated", translate=lambda v, _: [f"trainer.save_freq_secs={float(v or 0)}"]),
    **_named("recover"),
    "recover.mode": Rule("translated", translate=_recover),
    "recover.fileroot": Rule(
        "no-op", "a run resumes from the saver's checkpoints (trainer.default_local_dir)"
    ),
    "recover.freq_epochs": Rule("no-op", "recovery uses the saver's checkpoints", check=_recover_freq),
    "recover.freq_steps": Rule("no-op", "recovery uses the saver's checkpoints", check=_recover_freq),
    "recover.freq_secs": Rule("no-op", "recovery uses the saver's checkpoints", check=_recover_freq),
    **_named("evaluator"),
    **_files("evaluator"),
    "evaluator.freq_epochs": Rule("translated", translate=_freq("evaluator")),
    "evaluator.freq_steps": Rule("translated", translate=_freq("evaluator")),
    "evaluator.freq_secs": Rule(
        "refused", "validation runs every N steps (trainer.test_freq), not on a timer"
    ),
    **_named("stats_logger"),
    **_files("stats_logger"),
    "stats_logger.wandb.mode": Rule("translated", translate=_wandb),
    **_named("perf_tracer"),
    **_files("perf_tracer"),
    "perf_tracer.enabled": Rule(
        "refused", "AReaL's perf tracer is not available; use global_profiler.tool=torch"
    ),
    "perf_tracer.session_tracer.enabled": Rule(
        "refused", "AReaL's session tracer is not available; use global_profiler.tool=torch"
    ),
}


def rule_for(key: str) -> list[tuple[str, Rule]]:
    """The table entries that cover the leaf `key` (itself, or a section above it)."""
    parts = key.split(".")
    return [(p, RULES[p]) for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in RULES]
