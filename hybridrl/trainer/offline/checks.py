"""Start-up checks of `main_generation` and `main_eval` beyond their loaders' own: ranges and names,
the model folder, and the output path (written at the very end, so a bad one used to fail only
after every response was generated or scored). Each problem raises a ConfigError naming the key.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from hybridrl.trainer.ppo.startup_checks import at_least_one, read_model_json
from hybridrl.utils.config_loader import ConfigError

__all__ = ["check_eval_inputs", "check_generation_values", "check_model_folder", "check_output_path"]

GEN_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def check_generation_values(config: Any) -> None:
    """The generation keys `load_generation_config` does not check."""
    r, d, t = config.rollout, config.data, config.trainer
    if isinstance(r.top_k, bool) or not isinstance(r.top_k, int) or r.top_k < -1:
        raise ConfigError(f"rollout.top_k={r.top_k!r} must be an integer >= 1, or -1 / 0 for no top-k")
    if not (isinstance(r.top_p, (int, float)) and 0 < r.top_p <= 1):
        raise ConfigError(f"rollout.top_p={r.top_p!r} must be in (0, 1]")
    if r.dtype not in GEN_DTYPES:
        raise ConfigError(f"rollout.dtype={r.dtype!r} is not one of {list(GEN_DTYPES)}")
    at_least_one(
        "rollout.tensor_model_parallel_size", r.tensor_model_parallel_size, "vLLM tensor-parallel ranks"
    )
    at_least_one("rollout.max_num_seqs", r.max_num_seqs, "sequences per vLLM step")
    at_least_one("rollout.max_num_batched_tokens", r.max_num_batched_tokens, "tokens per vLLM step")
    if not (isinstance(r.gpu_memory_utilization, (int, float)) and 0 < r.gpu_memory_utilization <= 1):
        raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization!r} must be in (0, 1]")
    if (
        isinstance(d.max_samples, bool)
        or not isinstance(d.max_samples, int)
        or d.max_samples < -1
        or d.max_samples == 0
    ):
        raise ConfigError(f"data.max_samples={d.max_samples!r} must be -1 (all prompts) or an integer >= 1")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device={t.device!r} is not one of ['auto', 'cpu', 'cuda']")
    if r.name == "hf" and r.tensor_model_parallel_size != 1:
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} needs rollout.name=vllm; "
            "the hf engine runs on one device"
        )


def check_model_folder(path: str, key: str) -> None:
    """A local model folder must hold a readable config.json (hub ids / `builtin:*` pass)."""
    from hybridrl.models.builtin import resolve_model_path

    try:
        read_model_json(resolve_model_path(path, key=key), key)
    except (FileNotFoundError, ValueError) as e:
        raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from None


def check_output_path(path: str | None, key: str) -> None:
    """`path` can be written: not a folder, and its folder exists (or can be made) and is writable."""
    if not path:
        return
    out = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(out):
        raise ConfigError(
            f"{key}={path!r} is a folder; give the file to write, e.g. {os.path.join(path, 'out')}"
        )
    parent = os.path.dirname(out)
    while parent and not os.path.exists(parent):  # the nearest folder that exists must be writable
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}={path!r} cannot be written ({parent!r} is not a writable folder); it is written at the "
            "end of the run: point it somewhere writable"
        )


def check_eval_inputs(config: Any, score_fn: Any, rows: list[dict]) -> None:
    """Before any row is scored: the output path, the score function's signature and, with the
    built-in scorers, every row's data source."""
    check_output_path(config.output_path, "output_path")
    c, d = config.custom_reward_function, config.data
    keys = ("data_source", "solution_str", "ground_truth", "extra_info")
    try:
        inspect.signature(score_fn).bind(**dict.fromkeys(keys))
    except TypeError as e:
        raise ConfigError(
            f"custom_reward_function.name={c.name!r} in custom_reward_function.path={c.path!r} cannot be "
            f"called with {list(keys)} ({e}); give it the signature ({', '.join(keys)}, **kwargs)"
        ) from None
    except ValueError:  # no signature (a builtin): checked when called
        pass
    if c.path:
        return
    from hybridrl.reward.scorers import registered_data_sources

    known = set(registered_data_sources())
    for i, row in enumerate(rows):
        if row.get(d.data_source_key) not in known:
            raise ConfigError(
                f"data.path row {i}: column {d.data_source_key!r} (data.data_source_key) is "
                f"{row.get(d.data_source_key)!r}, which no built-in scorer handles (known: {sorted(known)}); "
                "set custom_reward_function.path, or data.data_source_key"
            )
