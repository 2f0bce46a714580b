"""Start-up checks of `main_sft` beyond `validate_sft_config`: ranges of the remaining keys, and the
input files before the process group and the model are built (the SFT trainer used to load the
model first and read the data after it). Each problem raises a ConfigError naming the key and the fix.

* :func:`check_sft_values` (from ``validate_sft_config``): the config alone;
* :func:`hybridrl.trainer.sft.input_checks.check_sft_inputs` (from ``run_sft_config``, before
  ``init_distributed``): the model folder and its config.json, the tokenizer folder, and every row
  of the train/val files (its own module: it reads the data module, which imports the config).
"""

from __future__ import annotations

from typing import Any

from hybridrl.trainer.ppo.startup_checks import at_least_one, check_dtypes, in_range
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_sft_values"]


def _int_at_least(key: str, value: Any, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r} must be an integer >= {low} ({what})")


def check_sft_values(config: Any) -> None:
    """Ranges and names of the SFT keys `validate_sft_config` does not cover."""
    d, m, o, t, g = config.data, config.model, config.optim, config.trainer, config.generation_eval
    in_range("optim.weight_decay", o.weight_decay, 0, None, "AdamW weight decay")
    in_range("optim.eps", o.eps, 0, None, "AdamW epsilon")
    in_range("optim.clip_grad", o.clip_grad, 0, None, "gradient norm clip")
    in_range("optim.min_lr_ratio", o.min_lr_ratio, 0, 1, "floor of the schedule")
    in_range("optim.num_cycles", o.num_cycles, 0, None, "cosine cycles")
    _int_at_least("optim.lr_warmup_steps", o.lr_warmup_steps, -1, "-1: use optim.lr_warmup_steps_ratio")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)!r} must be two numbers in [0, 1), e.g. [0.9,0.95]")
    for name in ("save_freq", "test_freq"):
        _int_at_least(f"trainer.{name}", getattr(t, name), -1, "N > 0: every N steps, -1: never")
    if t.max_ckpt_to_keep is not None:
        _int_at_least("trainer.max_ckpt_to_keep", t.max_ckpt_to_keep, 0, "null / 0: keep all")
    if t.n_gpus_per_node is not None:
        at_least_one("trainer.n_gpus_per_node", t.n_gpus_per_node, "processes per node")
    _int_at_least("trainer.seed", t.seed, 0, "the random seed")
    in_range("trainer.preemption_grace_s", t.preemption_grace_s, 0, None, "seconds; 0: no save")
    from hybridrl.utils.tracking import SUPPORTED_BACKENDS

    loggers = [t.logger] if isinstance(t.logger, str) else list(t.logger or [])
    bad = [name for name in loggers if name not in SUPPORTED_BACKENDS]
    if bad:
        raise ConfigError(f"trainer.logger has {bad}: use names from {list(SUPPORTED_BACKENDS)}")
    for name in ("train_max_samples", "val_max_samples"):
        _int_at_least(f"data.{name}", getattr(d, name), -1, "-1: all rows, N > 0: the first N")
    if m.lora_rank > 0 and not (isinstance(m.lora_alpha, (int, float)) and m.lora_alpha > 0):
        raise ConfigError(f"model.lora_alpha={m.lora_alpha!r} must be > 0 with model.lora_rank > 0; e.g. 16")
    check_dtypes(m.fsdp_config, "model.fsdp_config")
    if g.enable:
        for name, what in (
            ("max_samples", "prompts"),
            ("max_new_tokens", "tokens"),
            ("batch_size", "prompts"),
        ):
            at_least_one(f"generation_eval.{name}", getattr(g, name), what)
