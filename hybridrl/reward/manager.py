"""Reward managers: turn a batch of generated responses into token-level rewards.

A reward manager decodes each response, asks a score function for a number and puts that number
on the response's last valid token:

    manager = load_reward_manager("naive", tokenizer, num_examine=1)
    reward_tensor = manager(data)                       # (B, T) float32
    out = manager(data, return_dict=True)               # {"reward_tensor", "reward_extra_info"}

`data` is a DataProto with batch keys `responses` (B, T) and `attention_mask` (B, P+T) (or
`response_mask` (B, T)), optionally `prompts` (B, P); and non-tensor keys `data_source` (the
`reward_fn_key`), `reward_model` (`{"ground_truth": ...}` per row) and optionally `extra_info`.

A score function returns a number, or a dict with a "score" key plus extra per-sample values
("acc", "pred", ...) that come back in `reward_extra_info` as lists aligned with the batch.

Registered managers (the `reward_model.reward_manager` config value):

* `naive`: one call per sample, `compute_score(data_source=, solution_str=, ground_truth=,
  extra_info=, **reward_kwargs)`.
* `batch`: one call per batch, `compute_score(data_sources=, solution_strs=, ground_truths=,
  extra_infos=, **reward_kwargs)` returning one result per sample.
* `prime`: like naive, scored in a pool of worker processes with a per-sample `timeout`; a
  sample that times out scores 0, is counted in `reward/timeout_count` and logged by index.
* `dapo`: like naive, plus the DAPO overlong penalty (Yu et al. 2025, "soft overlong
  punishment", `hybridrl.algos.apply_overlong_penalty`) from `overlong_buffer_cfg` and
  `max_resp_len`.

A score function that raises gives a RuntimeError, one that returns NaN/inf or a non-number a
ValueError; both name the data source, the sample index, the start of the response and the
ground truth. Nothing is silently scored 0 (except prime timeouts, which are counted and logged).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from tqdm import tqdm

from hybridrl.algos import apply_overlong_penalty
from hybridrl.protocol import DataProto
from hybridrl.reward.samples import RewardSample, decode_samples, describe_sample

__all__ = [
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "RewardManager",
    "RewardSample",
    "decode_samples",
    "describe_sample",
    "fn_name",
    "parse_score",
    "get_reward_manager_cls",
    "load_reward_manager",
    "register_reward_manager",
    "reward_fn_error",
    "reward_manager_names",
]

_SAMPLE_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
_BATCH_KEYS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")

# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------
_REGISTRY: dict[str, type[RewardManager]] = {}


def register_reward_manager(name: str) -> Callable[[type[RewardManager]], type[RewardManager]]:
    """Class decorator adding a reward manager under `name` (the `reward_model.reward_manager` value)."""

    def decorator(cls: type[RewardManager]) -> type[RewardManager]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(
                f"reward manager {name!r} is already registered (by {_REGISTRY[name].__qualname__}); "
                "register yours under another name"
            )
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return decorator


def get_reward_manager_cls(name: str) -> type[RewardManager]:
    """The class registered under `name`; unknown names raise ValueError listing the known ones."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward manager {name!r} (reward_model.reward_manager); "
            f"known: {', '.join(reward_manager_names())}"
        )
    return _REGISTRY[name]


def reward_manager_names() -> list[str]:
    return sorted(_REGISTRY)


def load_reward_manager(
    name: str,
    tokenizer: Any,
    num_examine: int,
    compute_score: Callable | None = None,
    **kwargs: Any,
) -> RewardManager:
    """Build the reward manager registered under `name`.

    Args:
        name: registry name (`naive`, `batch`, `prime`, `dapo`, or one you registered).
        tokenizer: decodes responses (a Hugging Face tokenizer).
        num_examine: decoded samples printed per data source and call.
        compute_score: the score function; None uses the built-in rule scorers.
        **kwargs: `reward_fn_key`, the manager's own options (prime: `num_workers`, `timeout`;
            dapo: `max_resp_len`, `overlong_buffer_cfg`); the rest go to `compute_score`.
    """
    return get_reward_manager_cls(name)(tokenizer, num_examine, compute_score=compute_score, **kwargs)


def fn_name(fn: Callable) -> str:
    """`module.qualname` of a function (or of the function inside a functools.partial)."""
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"


def _as_float(value: Any) -> float | None:
    """A finite-or-not float for numbers (bool, int, float, numpy, 1-element tensors); else None."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, np.ndarray):
        return float(value.item()) if value.size == 1 and value.dtype.kind in "biuf" else None
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    return None


def parse_score(result: Any, sample: RewardSample, fn: Callable) -> tuple[float, dict[str, Any]]:
    """(score, extras) from a score function's result; ValueError for NaN/inf or non-numbers."""
    extras: dict[str, Any] = {}
    raw = result
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(
                f"reward function {fn_name(fn)} returned a dict without a 'score' key "
                f"(keys {sorted(result)}) for {describe_sample(sample)}"
            )
        extras = dict(result)
        raw = result["score"]
    score = _as_float(raw)
    if score is None or not math.isfinite(score):
        raise ValueError(
            f"reward function {fn_name(fn)} returned {raw!r} ({type(raw).__name__}), not a finite number, "
            f"for {describe_sample(sample)}"
        )
    return score, extras


def _check_signature(fn: Callable, names: Sequence[str], reward_kwargs: dict, manager: str) -> None:
    """Fail at construction when `fn` cannot take the keywords the manager will pass."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**dict.fromkeys(names), **reward_kwargs)
    except TypeError as e:
        raise TypeError(
            f"reward manager {manager!r}: compute_score {fn_name(fn)}{sig} cannot be called with keywords "
            f"{list(names) + list(reward_kwargs)} ({e}). Give it the signature "
            f"({', '.join(names)}, **kwargs), or drop the extra reward_kwargs."
        ) from None


# ----------------------------------------------------------------------------------------------
# base class
# ----------------------------------------------------------------------------------------------
class RewardManager:
    """Shared machinery: decode, score (subclass hook), validate, place on the last token, print.

    Args:
        tokenizer: decodes prompts and responses.
        num_examine: decoded samples printed per data source and call.
        compute_score: the score function (see the module docstring for how each manager calls it).
        reward_fn_key: non-tensor column holding each row's data source.
        **reward_kwargs: forwarded to every `compute_score` call.
    """

    name: ClassVar[str] = ""
    call_keys: ClassVar[tuple[str, ...]] = _SAMPLE_KEYS

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        **reward_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_examine = int(num_examine)
        self.reward_fn_key = reward_fn_key
        self.compute_score = compute_score if compute_score is not None else self._default_compute_score()
        if not callable(self.compute_score):
            raise TypeError(f"compute_score must be callable, got {type(self.compute_score).__name__}")
        self.reward_kwargs = reward_kwargs
        _check_signature(self.compute_score, self.call_keys, reward_kwargs, self.name)

    def _default_compute_score(self) -> Callable:
        from hybridrl.reward.scorers import default_compute_score

        return default_compute_score

    # ---- hooks ----------------------------------------------------------------------------
    def score_samples(self, samples: list[RewardSample]) -> list[Any]:
        """Raw results (number or dict with "score"), one per sample, in order."""
        raise NotImplementedError

    def shape_rewards(
        self, samples: list[RewardSample], scores: list[float]
    ) -> tuple[list[float], list[dict[str, Any]]]:
        """(rewards placed in the tensor, extra values per sample); default: the scores themselves."""
        return scores, [{} for _ in samples]

    def batch_extra_info(self, n: int) -> dict[str, list]:
        """Per-call extras added after the per-sample ones (lists of length n)."""
        return {}

    # ---- main entry -----------------------------------------------------------------------
    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """Score `data`.

        Returns:
            reward_tensor (B, T) float32, zero except each sample's reward on its last valid
            token; with return_dict, {"reward_tensor": ..., "reward_extra_info": dict[str, list]}.
        """
        if data.batch is not None and "rm_scores" in data.batch.keys():
            rm = data.batch["rm_scores"]  # a reward model already scored this batch
            return {"reward_tensor": rm, "reward_extra_info": {}} if return_dict else rm
        samples = decode_samples(self.tokenizer, data, self.reward_fn_key)
        raw = self.score_samples(samples)
        if len(raw) != len(samples):
            raise ValueError(
                f"reward function {fn_name(self.compute_score)} returned {len(raw)} results for "
                f"{len(samples)} samples; it must return one per sample"
            )
        parsed = [parse_score(result, sample, self.compute_score) for sample, result in zip(samples, raw)]
        rewards, shaped = self.shape_rewards(samples, [score for score, _ in parsed])
        reward_tensor = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        rows: list[dict[str, Any]] = []
        for sample, reward, (_, extras), more in zip(samples, rewards, parsed, shaped):
            reward_tensor[sample.index, sample.last_index] = reward
            rows.append({**extras, **more})
        extra_info = _align(rows)
        extra_info.update(self.batch_extra_info(len(samples)))
        self._examine(samples, rewards, rows)
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": extra_info}
        return reward_tensor

    def _examine(self, samples: list[RewardSample], rewards: list[float], rows: list[dict]) -> None:
        if self.num_examine <= 0:
            return
        printed: dict[Any, int] = {}
        for sample, reward, extras in zip(samples, rewards, rows):
            key = sample.data_source
            if printed.get(key, 0) >= self.num_examine:
                continue
            printed[key] = printed.get(key, 0) + 1
            extra = "".join(f"\n[{k}] {v}" for k, v in extras.items() if k != "score")
            tqdm.write(  # above the trainer's progress bar, which is then redrawn
                f"[reward:{self.name}] data_source={key} sample {sample.index}\n[prompt] {sample.prompt}\n"
                f"[response] {sample.response}\n[ground_truth] {sample.ground_truth}\n[score] {reward}{extra}"
            )


def _align(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Per-sample dicts -> dict of lists of length len(rows); a key a sample lacks gives None."""
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return {k: [row.get(k) for row in rows] for k in keys}


def reward_fn_error(fn: Callable, error: Exception, sample: RewardSample) -> RuntimeError:
    """The RuntimeError raised (chained) when a score function raises on `sample`."""
    return RuntimeError(
        f"reward function {fn_name(fn)} raised {type(error).__name__}: {error} for {describe_sample(sample)}"
    )


def is_async_fn(fn: Callable) -> bool:
    """An `async def` score function (veRL allows one: its reward loop awaits it)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None))


def run_coroutine(make: Callable[[], Any]) -> Any:
    """Run the coroutine `make()` to its end: in this thread, or in a fresh one when this thread
    already runs an event loop."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


async def _await_all(fn: Callable, samples: list[RewardSample], reward_kwargs: dict) -> list[Any]:
    """An async score function on every sample at once (its judge requests overlap, as in veRL)."""
    import asyncio

    async def one(sample: RewardSample) -> Any:
        try:
            return await _call_one(fn, sample, reward_kwargs, wrap=False)
        except Exception as e:
            raise reward_fn_error(fn, e, sample) from e

    return list(await asyncio.gather(*(one(s) for s in samples)))


def _call_one(fn: Callable, sample: RewardSample, reward_kwargs: dict, wrap: bool = True) -> Any:
    if not wrap:
        return fn(
            data_source=sample.data_source,
            solution_str=sample.response,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
            **reward_kwargs,
        )
    try:
        return fn(
            data_source=sample.data_source,
            solution_str=sample.response,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
            **reward_kwargs,
        )
    except Exception as e:
        raise reward_fn_error(fn, e, sample) from e


# ----------------------------------------------------------------------------------------------
# naive, batch, dapo
# ----------------------------------------------------------------------------------------------
@register_reward_manager("naive")
class NaiveRewardManager(RewardManager):
    """One `compute_score` call per sample, in this process (an `async def` one: all samples at once)."""

    def score_samples(self, samples: list[RewardSample]) -> list[Any]:
        if is_async_fn(self.compute_score):
            return run_coroutine(lambda: _await_all(self.compute_score, samples, self.reward_kwargs))
        return [_call_one(self.compute_score, s, self.reward_kwargs) for s in samples]


@register_reward_manager("batch")
class BatchRewardManager(RewardManager):
    """One `compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=)` call per batch."""

    call_keys = _BATCH_KEYS

    def _default_compute_score(self) -> Callable:
        raise ValueError(
            "the 'batch' reward manager needs a batch score function taking (data_sources, solution_strs, "
            "ground_truths, extra_infos) and returning one result per sample: set "
            "custom_reward_function.path and custom_reward_function.name, or use reward_manager=naive"
        )

    def score_samples(self, samples: list[RewardSample]) -> list[Any]:
        def call():
            return self.compute_score(
                data_sources=[s.data_source for s in samples],
                solution_strs=[s.response for s in samples],
                ground_truths=[s.ground_truth for s in samples],
                extra_infos=[s.extra_info for s in samples],
                **self.reward_kwargs,
            )

        try:
            results = run_coroutine(call) if is_async_fn(self.compute_score) else call()
        except Exception as e:
            sources = sorted({str(s.data_source) for s in samples})
            raise RuntimeError(
                f"batch reward function {fn_name(self.compute_score)} raised {type(e).__name__}: {e} on a batch "
                f"of {len(samples)} samples (data sources {sources})"
            ) from e
        if isinstance(results, (torch.Tensor, np.ndarray)):
            results = results.tolist()
        if not isinstance(results, Sequence) or isinstance(results, (str, bytes)):
            raise ValueError(
                f"batch reward function {fn_name(self.compute_score)} returned a {type(results).__name__}; "
                "it must return a list with one score (or dict with 'score') per sample"
            )
        return list(results)


_OVERLONG_KEYS = ("enable", "len", "penalty_factor", "log")


def _cfg_get(cfg: Any, key: str, default: Any) -> Any:
    """Read a key from a dict / DictConfig / dataclass overlong_buffer_cfg."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        unknown = set(cfg) - set(_OVERLONG_KEYS)
        if unknown:
            raise ValueError(
                f"overlong_buffer_cfg has unknown keys {sorted(unknown)}; known: {list(_OVERLONG_KEYS)}"
            )
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@register_reward_manager("dapo")
class DAPORewardManager(NaiveRewardManager):
    """Naive scoring plus the DAPO overlong penalty on the reward (not on the logged "score").

    Args:
        max_resp_len: the rollout's max response length (data.max_response_length).
        overlong_buffer_cfg: {enable, len, penalty_factor, log} (dict or dataclass). With `log`,
            extras gain "overlong_reward" (the penalty) and "overlong" (penalty < 0).
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Any = None,
        **reward_kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **reward_kwargs)
        self.enable = bool(_cfg_get(overlong_buffer_cfg, "enable", False))
        self.buffer_len = int(_cfg_get(overlong_buffer_cfg, "len", 0))
        self.penalty_factor = float(_cfg_get(overlong_buffer_cfg, "penalty_factor", 1.0))
        self.log_overlong = bool(_cfg_get(overlong_buffer_cfg, "log", False))
        self.max_resp_len = max_resp_len
        if self.enable:
            if not max_resp_len or max_resp_len <= 0:
                raise ValueError(
                    "dapo reward manager: overlong_buffer_cfg.enable=True needs max_resp_len "
                    f"(data.max_response_length), got {max_resp_len!r}"
                )
            if not 0 < self.buffer_len <= max_resp_len:
                raise ValueError(
                    f"dapo reward manager: overlong_buffer_cfg.len={self.buffer_len} must be in "
                    f"(0, max_resp_len={max_resp_len}]"
                )
            if self.penalty_factor < 0:
                raise ValueError(
                    f"dapo reward manager: overlong_buffer_cfg.penalty_factor={self.penalty_factor} < 0"
                )

    def shape_rewards(
        self, samples: list[RewardSample], scores: list[float]
    ) -> tuple[list[float], list[dict[str, Any]]]:
        if not self.enable:
            return super().shape_rewards(samples, scores)
        penalties = apply_overlong_penalty(
            torch.zeros(len(samples), dtype=torch.float64),
            torch.tensor([s.response_length for s in samples]),
            max_response_length=self.max_resp_len,
            overlong_buffer_len=self.buffer_len,
            penalty_factor=self.penalty_factor,
        ).tolist()
        rewards = [score + penalty for score, penalty in zip(scores, penalties)]
        if not self.log_overlong:
            return rewards, [{} for _ in samples]
        return rewards, [{"overlong_reward": p, "overlong": p < 0} for p in penalties]
