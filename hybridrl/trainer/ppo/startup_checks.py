"""Start-up checks of values that would fail (or do nothing) only after Ray and the workers started.

Each raises a ConfigError naming the key and the fix, before Ray starts (the validation
sweep; more checks live in config.py, the dataset loader and the model resolver; the list of
what is covered is in docs/reliability.md). Two entry points:

* :func:`check_startup_values` (from ``validate_config``): the config alone;
* :func:`read_model_config` and :func:`check_model_inputs` (from ``prepare_run``, before Ray):
  the model's ``config.json``, then it against the tokenizer and the data lengths.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from hybridrl import algos
from hybridrl.config.roles import LR_SCHEDULER_TYPES
from hybridrl.utils.config_loader import ConfigError

__all__ = [
    "at_least_one",
    "check_data_lengths",
    "check_dtypes",
    "check_first_rows",
    "check_model_inputs",
    "check_startup_values",
    "in_range",
    "read_model_config",
    "read_model_json",
]

_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")
_CKPT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at_least_one(key: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r} must be an integer >= 1 ({what}); e.g. {key}=1")


def in_range(
    key: str, value: Any, lo: float | None, hi: float | None, what: str, *, allow_none=False
) -> None:
    """ConfigError unless lo <= value <= hi (either bound None: open)."""
    if value is None and allow_none:
        return
    ok = _number(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        bounds = (
            f"in [{lo}, {hi}]"
            if lo is not None and hi is not None
            else (f">= {lo}" if hi is None else f"<= {hi}")
        )
        raise ConfigError(f"{key}={value!r} must be a number {bounds} ({what})")


def _choice(key: str, value: Any, choices, what: str = "") -> None:
    if value not in choices:
        extra = f" ({what})" if what else ""
        raise ConfigError(f"{key}={value!r} is not one of {sorted(choices)}{extra}; pick one of them")


def _optional_count(key: str, value: Any, what: str) -> None:
    if value is not None:
        at_least_one(key, value, what)


def check_data_lengths(d: Any) -> None:
    """data.max_prompt_length / max_response_length / train_batch_size >= 1 (before the rollout's
    lengths are derived from them, so the error names the key the user typed)."""
    at_least_one("data.max_prompt_length", d.max_prompt_length, "prompt tokens")
    at_least_one("data.max_response_length", d.max_response_length, "response tokens")
    at_least_one("data.train_batch_size", d.train_batch_size, "prompts per step")


def _check_batches(section: Any, key: str) -> None:
    at_least_one(f"{key}.ppo_mini_batch_size", section.ppo_mini_batch_size, "prompts per optimizer step")
    _optional_count(
        f"{key}.ppo_micro_batch_size_per_gpu", section.ppo_micro_batch_size_per_gpu, "rows per forward"
    )


def check_startup_values(config: Any) -> None:
    """Every check of the config alone (counts, ranges, names) not already made elsewhere."""
    arr = config.actor_rollout_ref
    check_data_lengths(config.data)
    _check_batches(arr.actor, "actor_rollout_ref.actor")
    at_least_one(
        "actor_rollout_ref.actor.ppo_epochs", arr.actor.ppo_epochs, "passes over each batch per step"
    )
    critic = algos.estimator_needs_critic(config.algorithm.adv_estimator)
    if critic:
        at_least_one("critic.ppo_epochs", config.critic.ppo_epochs, "passes over each batch per step")
    steps = config.trainer.total_training_steps
    epochs = config.trainer.total_epochs
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigError(
            f"trainer.total_epochs={epochs!r} must be an integer >= 1 (passes over the training data; "
            "trainer.total_training_steps, when set, gives the step count); e.g. trainer.total_epochs=1, or "
            "trainer.val_only=true for a run that only validates"
        )
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(
            f"trainer.total_training_steps={steps!r} must be an integer >= 1; set it to null to train "
            "trainer.total_epochs passes over the data instead (a value <= 0 would be replaced silently)"
        )
    _check_actor(arr.actor, "actor_rollout_ref.actor")
    in_range("trainer.preemption_grace_s", config.trainer.preemption_grace_s, 0, None, "seconds; 0: no save")
    in_range("trainer.esi_redundant_time", config.trainer.esi_redundant_time, 0, None, "seconds of margin")
    if critic:
        _check_batches(config.critic, "critic")
        _check_optim(config.critic.optim, "critic.optim")
        in_range("critic.cliprange_value", config.critic.cliprange_value, 0, None, "value clip range")
        in_range("critic.grad_clip", config.critic.grad_clip, 0, None, "gradient norm clip", allow_none=True)
        check_dtypes(config.critic.model.fsdp_config, "critic.model.fsdp_config")
    _optional_count(
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        arr.ref.log_prob_micro_batch_size_per_gpu,
        "rows per reference forward",
    )
    _check_model(arr.model, "actor_rollout_ref.model")
    _check_rollout(arr.rollout)
    _check_algorithm(config.algorithm)
    _check_trainer(config.trainer)
    _check_data(config.data)
    _check_reward(config)


def _check_optim(optim: Any, key: str) -> None:
    in_range(f"{key}.lr", optim.lr, 0, None, "learning rate")
    in_range(f"{key}.weight_decay", optim.weight_decay, 0, None, "AdamW weight decay")
    in_range(f"{key}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0, 1, "fraction of the steps")
    in_range(f"{key}.min_lr_ratio", optim.min_lr_ratio, 0, 1, "floor of the cosine schedule", allow_none=True)
    in_range(f"{key}.eps", optim.eps, 0, None, "AdamW epsilon")
    in_range(f"{key}.clip_grad", optim.clip_grad, 0, None, "gradient norm clip")
    warm = optim.lr_warmup_steps
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < -1:
        raise ConfigError(
            f"{key}.lr_warmup_steps={warm!r} must be an integer >= 0, or -1 to use {key}.lr_warmup_steps_ratio"
        )
    betas = list(optim.betas) if optim.betas is not None else []
    if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        raise ConfigError(
            f"{key}.betas={betas!r} must be two numbers in [0, 1), e.g. {key}.betas=[0.9,0.999]"
        )
    _choice(f"{key}.lr_scheduler_type (or warmup_style)", optim.scheduler_type, LR_SCHEDULER_TYPES)


def check_dtypes(fsdp: Any, key: str) -> None:
    mp = fsdp.mixed_precision
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        _choice(f"{key}.mixed_precision.{name}", getattr(mp, name), _DTYPES, "a torch dtype")
    if getattr(fsdp, "model_dtype", None) is not None:
        _choice(f"{key}.model_dtype", fsdp.model_dtype, _DTYPES, "a torch dtype")


def _check_actor(actor: Any, key: str) -> None:
    _check_optim(actor.optim, f"{key}.optim")
    in_range(f"{key}.grad_clip", actor.grad_clip, 0, None, "gradient norm clip", allow_none=True)
    if actor.policy_loss.loss_mode not in ("dppo_tv", "dppo_kl"):  # those check them as divergence bounds
        in_range(f"{key}.clip_ratio", actor.clip_ratio, 0, None, "PPO clip range")
        in_range(f"{key}.clip_ratio_low", actor.clip_ratio_low, 0, None, "lower PPO clip", allow_none=True)
        in_range(f"{key}.clip_ratio_high", actor.clip_ratio_high, 0, None, "upper PPO clip", allow_none=True)
    if not (_number(actor.clip_ratio_c) and actor.clip_ratio_c > 1):
        raise ConfigError(
            f"{key}.clip_ratio_c={actor.clip_ratio_c!r} must be > 1 (the dual-clip bound of negative "
            f"advantages, Ye et al. 2020); e.g. {key}.clip_ratio_c=3.0"
        )
    _choice(f"{key}.loss_agg_mode", actor.loss_agg_mode, algos.list_loss_agg_modes())
    if actor.use_kl_loss:
        _choice(f"{key}.kl_loss_type", actor.kl_loss_type, algos.list_kl_estimators(), "the KL estimator")
        in_range(f"{key}.kl_loss_coef", actor.kl_loss_coef, 0, None, "weight of the KL loss")
    if actor.use_dynamic_bsz:
        at_least_one(
            f"{key}.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, "tokens per micro-batch"
        )
    check_dtypes(actor.fsdp_config, f"{key}.fsdp_config")
    ck = actor.checkpoint
    for name in ("save_contents", "load_contents"):
        bad = [c for c in getattr(ck, name) if c not in _CKPT_CONTENTS]
        if bad:
            raise ConfigError(f"{key}.checkpoint.{name} has {bad}: use a subset of {list(_CKPT_CONTENTS)}")


def _check_model(model: Any, key: str) -> None:
    if isinstance(model.lora_rank, bool) or not isinstance(model.lora_rank, int) or model.lora_rank < 0:
        raise ConfigError(f"{key}.lora_rank={model.lora_rank!r} must be an integer >= 0 (0: no LoRA)")
    if model.lora_rank > 0 and not (_number(model.lora_alpha) and model.lora_alpha > 0):
        raise ConfigError(f"{key}.lora_alpha={model.lora_alpha!r} must be > 0 with lora_rank>0; e.g. 16")
    if getattr(model, "exclude_modules", None) is not None:
        from hybridrl.config.roles import check_exclude_modules

        try:
            check_exclude_modules(model, key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def _check_rollout(r: Any) -> None:
    key = "actor_rollout_ref.rollout"
    for name in ("prompt_length", "response_length"):
        value = getattr(r, name)
        if value is not None and (not _number(value) or value < 0):
            raise ConfigError(
                f"{key}.{name}={value!r} must be >= 1 (or 0 / null for data.max_{name.split('_')[0]}_length); "
                "a negative value would be replaced silently"
            )
    if not (isinstance(r.top_k, int) and r.top_k >= -1):
        raise ConfigError(f"{key}.top_k={r.top_k!r} must be an integer >= 1, or -1 / 0 for no top-k")
    vk = r.val_kwargs
    in_range(f"{key}.val_kwargs.temperature", vk.temperature, 0, None, "sampling temperature")
    if not (_number(vk.top_p) and 0 < vk.top_p <= 1):
        raise ConfigError(f"{key}.val_kwargs.top_p={vk.top_p!r} must be in (0, 1]")
    at_least_one(f"{key}.val_kwargs.n", vk.n, "responses per validation prompt")


def _check_algorithm(a: Any) -> None:
    in_range("algorithm.gamma", a.gamma, 0, 1, "discount factor")
    in_range("algorithm.lam", a.lam, 0, 1, "GAE lambda")
    if a.use_kl_in_reward:
        _choice("algorithm.kl_penalty", a.kl_penalty, algos.list_kl_estimators(), "the KL estimator")
        _choice("algorithm.kl_ctrl.type", a.kl_ctrl.type, ("fixed", "adaptive"))
        in_range("algorithm.kl_ctrl.kl_coef", a.kl_ctrl.kl_coef, 0, None, "weight of the KL penalty")
        if a.kl_ctrl.type == "adaptive":
            at_least_one("algorithm.kl_ctrl.horizon", a.kl_ctrl.horizon, "steps of the adaptive controller")
            in_range("algorithm.kl_ctrl.target_kl", a.kl_ctrl.target_kl, 0, None, "target KL")
    fg = a.filter_groups
    if fg.enable:
        _choice(
            "algorithm.filter_groups.metric", fg.metric, ("acc", "score", "seq_reward", "seq_final_reward")
        )


def _check_trainer(tr: Any) -> None:
    at_least_one("trainer.log_freq", tr.log_freq, "steps between console lines")
    for name in ("save_freq", "test_freq"):
        value = getattr(tr, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ConfigError(
                f"trainer.{name}={value!r} must be an integer: N > 0 (every N steps) or -1 (never)"
            )
    in_range("trainer.save_freq_secs", tr.save_freq_secs, 0, None, "seconds between saves, 0: off")
    for name in ("critic_warmup", "log_val_generations"):
        value = getattr(tr, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"trainer.{name}={value!r} must be an integer >= 0")
    for name in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        value = getattr(tr, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(
                f"trainer.{name}={value!r} must be null or an integer >= 0 (null / 0: keep all)"
            )
    from hybridrl.utils.tracking import SUPPORTED_BACKENDS

    loggers = [tr.logger] if isinstance(tr.logger, str) else list(tr.logger or [])
    bad = [name for name in loggers if name not in SUPPORTED_BACKENDS]
    if bad:
        raise ConfigError(f"trainer.logger has {bad}: use names from {list(SUPPORTED_BACKENDS)}")


def _check_data(d: Any) -> None:
    _optional_count("data.val_batch_size", d.val_batch_size, "rows per validation batch (null: all)")
    if (
        isinstance(d.dataloader_num_workers, bool)
        or not isinstance(d.dataloader_num_workers, int)
        or (d.dataloader_num_workers < 0)
    ):
        raise ConfigError(f"data.dataloader_num_workers={d.dataloader_num_workers!r} must be an integer >= 0")


def _check_reward(config: Any) -> None:
    rm = config.reward_model  # the manager's name is checked when it is built (prepare_run, before Ray)
    if rm.enable:
        _optional_count(
            "reward_model.micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu, "rows per forward"
        )
        if rm.use_reward_loop:
            in_range(
                "reward_model.rollout.request_timeout_s", rm.rollout.request_timeout_s, 1e-9, None, "seconds"
            )
    sf = rm.sandbox_fusion
    if sf.url:
        if urlsplit(str(sf.url)).scheme.lower() not in ("http", "https"):
            raise ConfigError(
                f"reward_model.sandbox_fusion.url={sf.url!r} must be an http:// or https:// URL of the "
                "SandboxFusion run_code endpoint (e.g. http://localhost:8080/run_code)"
            )
        at_least_one("reward_model.sandbox_fusion.max_concurrent", sf.max_concurrent, "requests in flight")


def read_model_config(config: Any) -> dict | None:
    """The actor model's config.json (None for a path that is not a local folder: the model
    resolver reports those), read before the tokenizer so that a broken file names the key.

    Raises:
        ConfigError: config.json missing or not JSON.
    """
    return read_model_json(config.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")


def read_model_json(path: str, key: str) -> dict | None:
    """The config.json of the model folder `path` (config key `key`); None when `path` is not a
    local folder (a hub id, or missing: the model resolver names those).

    Raises:
        ConfigError: config.json missing, not JSON, or not an object.
    """
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return None
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"{key}={path!r} has no config.json: point it at a Hugging Face model folder")
    try:
        with open(cfg_file) as f:
            model_cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{key}={path!r}: config.json cannot be read ({e}); fix or replace the file"
        ) from None
    if not isinstance(model_cfg, dict):
        raise ConfigError(f"{key}={path!r}: config.json must hold a JSON object")
    return model_cfg


def check_model_inputs(config: Any, tokenizer: Any, model_cfg: dict | None) -> None:
    """The actor model's config.json (`read_model_config`) against the tokenizer and the data lengths.

    Raises:
        ConfigError: the tokenizer has ids the model's embedding lacks. Prompt + response longer
            than the model's positions: see `check_positions`.
    """
    if model_cfg is None:
        return
    cfg_file = os.path.join(config.actor_rollout_ref.model.path, "config.json")
    text = model_cfg.get("text_config", model_cfg)
    vocab = text.get("vocab_size")
    if isinstance(vocab, int) and config.data.tokenizer is None and len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer ({config.actor_rollout_ref.model.tokenizer_path or config.actor_rollout_ref.model.path}) "
            f"has {len(tokenizer)} tokens, more than the model's vocab_size={vocab} ({cfg_file}): ids past it "
            "would index outside the embedding; set actor_rollout_ref.model.tokenizer_path to the model's own tokenizer"
        )
    check_positions(config, {**text, **dict(config.actor_rollout_ref.model.override_config or {})}, cfg_file)


_WARNED_POSITIONS: set[tuple] = set()
_EXTENDING_ROPE = {"linear", "dynamic", "yarn", "longrope", "llama3", "ntk"}


def check_positions(config: Any, text: dict, cfg_file: str) -> None:
    """Prompt + response must fit the model's positions: refused when it does not, warned once when
    the model's RoPE scaling (`rope_scaling`, also from `model.override_config`) extends them far enough.

    Raises:
        ConfigError: data.max_prompt_length + data.max_response_length > max_position_embeddings and no
            RoPE scaling covers the difference.
    """
    positions = text.get("max_position_embeddings")
    d = config.data
    needed = d.max_prompt_length + d.max_response_length
    if not isinstance(positions, int) or needed <= positions:
        return
    numbers = (
        f"data.max_prompt_length={d.max_prompt_length} + data.max_response_length={d.max_response_length} = "
        f"{needed} tokens exceed the model's max_position_embeddings={positions} ({cfg_file})"
    )
    scaling = text.get("rope_scaling")
    scaling = dict(scaling) if isinstance(scaling, Mapping) else {}
    kind = str(scaling.get("rope_type", scaling.get("type", "")))
    factor = scaling.get("factor")
    if kind in _EXTENDING_ROPE and isinstance(factor, (int, float)):
        base = scaling.get("original_max_position_embeddings") or positions
        extended = float("inf") if kind == "dynamic" else base * factor
        if needed <= extended:
            key = (cfg_file, needed, positions, kind, factor)
            if key not in _WARNED_POSITIONS:
                _WARNED_POSITIONS.add(key)
                print(
                    f"[hybridrl] warning: {numbers}; the model's rope_scaling ({kind}, factor {factor:g}) "
                    f"extends them to {extended:g}: positions past {positions} rely on that extension"
                )
            return
    raise ConfigError(
        f"{numbers}: positions past {positions} were never trained and give garbage for most models. Lower "
        "data.max_prompt_length / data.max_response_length to fit, use a model with a longer context, or, "
        "for a RoPE model meant to be extended, set actor_rollout_ref.model.override_config.rope_scaling "
        f"(e.g. {{rope_type: yarn, factor: {-(-needed // positions)}, original_max_position_embeddings: "
        f"{positions}}})"
    )


def check_first_rows(train_loader: Any, val_loader: Any) -> None:
    """Build the first row of the training and the validation set (before Ray): a prompt column
    of the wrong type, a chat message without role/content or a prompt over the length limit
    fails here, naming the file key, the file and the row, not in the first step."""
    for loader in (train_loader, getattr(val_loader, "loader", val_loader)):
        dataset = getattr(loader, "dataset", None)
        if dataset is not None and len(dataset) > 0:
            dataset[0]
