"""Offline scoring of generated responses: mean/best/maj@N per data source (`main_eval` runs it).

The command, its keys and what it prints are described in hybridrl/trainer/main_eval.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from hybridrl.data.rl_dataset import read_rows
from hybridrl.reward.custom import load_custom_reward_fn
from hybridrl.reward.scorers import default_compute_score
from hybridrl.trainer.offline.checks import check_eval_inputs
from hybridrl.trainer.offline.generation import generate_responses
from hybridrl.trainer.ppo.metrics import process_validation_metrics
from hybridrl.utils.config_loader import ConfigError, load_structured

CONFIG_DIR = Path(__file__).parent.parent / "config"


@dataclass
class EvalDataSection:
    path: Any = None
    # the prompt column: rows with the same prompt form one group for best@N / maj@N;
    # null -> the file has no prompt column and every row is its own group
    prompt_key: str | None = "prompt"
    response_key: str = "responses"
    data_source_key: str = "data_source"
    reward_model_key: str = "reward_model"
    ground_truth_key: str = "ground_truth"


@dataclass
class EvalRewardFunctionSection:
    path: str | None = None
    name: str = "compute_score"  # name of the score function in that file
    # extra keyword arguments passed to the score function
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalConfig:
    data: EvalDataSection = field(default_factory=EvalDataSection)
    custom_reward_function: EvalRewardFunctionSection = field(default_factory=EvalRewardFunctionSection)
    output_path: str | None = None


def load_eval_config(cfg: DictConfig | dict | list[str] | None = None) -> EvalConfig:
    """schema <- evaluation.yaml <- `cfg`; unknown keys fail naming the key."""
    config: EvalConfig = load_structured(
        EvalConfig, cfg, "hybridrl/trainer/config/evaluation.yaml", CONFIG_DIR / "evaluation.yaml"
    )
    if config.data.path is None:
        raise ConfigError("data.path is not set; point it at the parquet file written by main_generation")
    return config


def _responses(value: Any, where: str, key: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"{where}: column {key!r} must hold a non-empty list of response strings, got {value!r:.120}"
        )
    return list(value)


def _ground_truth(row: dict, config: EvalConfig, where: str) -> Any:
    d = config.data
    value = row.get(d.reward_model_key)
    if isinstance(value, dict):
        if d.ground_truth_key not in value:
            raise ValueError(
                f"{where}: column {d.reward_model_key!r} has no key {d.ground_truth_key!r} (keys: {sorted(value)}); "
                "set data.ground_truth_key"
            )
        return value[d.ground_truth_key]
    return value


def _prompt_id(value: Any) -> str:
    """A hashable identity of a prompt cell: a string, or chat messages (lists/dicts, numpy arrays)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return json.dumps([_plain(v) for v in value], sort_keys=True, default=str)
    return json.dumps(_plain(value), sort_keys=True, default=str)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def score_rows(
    rows: list[dict], config: EvalConfig, score_fn: Callable
) -> tuple[list, list, dict[str, list]]:
    """Score every response: (data_sources, uids, infos) for `process_validation_metrics`.

    infos holds "reward" (the score), "pred" (the scorer's extracted answer, else the response)
    and every other numeric key the scorer returns for all responses (e.g. "acc").
    """
    d = config.data
    sources, uids, rewards, preds, extras = [], [], [], [], []
    groups: dict[str, int] = {}
    for i, row in enumerate(rows):
        where = f"data.path row {i}"
        uid = i if d.prompt_key is None else groups.setdefault(_prompt_id(row[d.prompt_key]), len(groups))
        responses = _responses(row[d.response_key], where, d.response_key)
        source, truth = row[d.data_source_key], _ground_truth(row, config, where)
        for text in responses:
            result = score_fn(
                data_source=source, solution_str=text, ground_truth=truth, extra_info=row.get("extra_info")
            )
            info = dict(result) if isinstance(result, dict) else {"score": result}
            if "score" not in info:
                raise ValueError(
                    f"{where}: the reward function returned a dict without 'score': {sorted(info)}"
                )
            sources.append(source)
            uids.append(uid)
            rewards.append(float(info.pop("score")))
            preds.append(info.pop("pred", text))
            extras.append(info)
    infos: dict[str, list] = {"reward": rewards, "pred": preds}
    for key in extras[0] if extras else {}:
        values = [e.get(key) for e in extras]
        if all(isinstance(v, (bool, int, float, np.number)) for v in values):
            infos[key] = [float(v) for v in values]
    return sources, uids, infos


def summarize(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """{data_source: {"mean@N", "best@N", "maj@N"}} from the `val-core/{source}/reward/*` metrics.

    With one response per prompt best@1 and maj@1 equal mean@1.
    """
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if not key.startswith("val-core/"):
            continue
        source, sep, name = key[len("val-core/") :].rpartition("/reward/")
        if sep:
            out.setdefault(source, {})[name] = value
    for values in out.values():
        if list(values) == ["mean@1"]:
            values["best@1"] = values["maj@1"] = values["mean@1"]
    return out


def dig(row: dict, dotted: str) -> Any:
    """`row[a][b]` for the dotted key "a.b"; None when a part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


class GreedyEval:
    """Greedy accuracy of a model on prompts that carry a data source and a ground truth.

    The model lives in an HFRollout (a plain copy, built on first use with random weights) that
    receives the weights to evaluate through `update_weights`, as the hybrid engine does. The SFT
    trainer uses one on rank 0 to report `val/greedy_acc` each validation.

    Args:
        rows: data rows; `prompts`: their rendered prompt texts (same order).
        tokenizer: the model's tokenizer. model_path: HF folder with the model's config.
        data_source_key / ground_truth_key: dotted keys into each row.
        max_new_tokens, batch_size: generation budget and prompts per generate call.
        device: where the rollout model lives.
    """

    def __init__(
        self,
        rows,
        prompts,
        tokenizer,
        model_path,
        *,
        data_source_key="data_source",
        ground_truth_key="ground_truth",
        max_new_tokens=32,
        batch_size=64,
        device=None,
    ) -> None:
        if len(rows) != len(prompts) or not rows:
            raise ValueError(
                f"GreedyEval needs one prompt per row, got {len(rows)} rows, {len(prompts)} prompts"
            )
        self.rows, self.prompts, self.tokenizer, self.model_path = rows, prompts, tokenizer, model_path
        self.data_source_key, self.ground_truth_key = data_source_key, ground_truth_key
        self.max_new_tokens, self.batch_size, self.device = max_new_tokens, batch_size, device
        self.rollout = None

    def _build(self):
        from hybridrl.rollout import RolloutConfig, create_rollout

        longest = max(len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in self.prompts)
        config = RolloutConfig(
            name="hf",
            temperature=0.0,
            do_sample=False,
            response_length=self.max_new_tokens,
            prompt_length=longest,
            dtype="fp32",
            load_format="dummy",
            log_prob_micro_batch_size_per_gpu=self.batch_size,
        )
        return create_rollout(config, self.model_path, self.tokenizer, device=self.device)

    def update_weights(self, named_tensors) -> None:
        """Load (HF name, full tensor) pairs, e.g. `FSDPEngine.iter_full_params()`, into the model."""
        if self.rollout is None:
            self.rollout = self._build()
        self.rollout.update_weights(named_tensors)

    def score(self) -> dict[str, float]:
        """`val/greedy_acc` and `val-core/{data_source}/reward/mean@1` of the current weights."""

        if self.rollout is None:
            raise RuntimeError("GreedyEval.score before update_weights: load the weights to evaluate first")
        responses = generate_responses(self.rollout, self.tokenizer, self.prompts, batch_size=self.batch_size)
        scores, sources = [], []
        for row, (text,) in zip(self.rows, responses):
            source = dig(row, self.data_source_key)
            result = default_compute_score(
                source, text, dig(row, self.ground_truth_key), row.get("extra_info")
            )
            scores.append(float(result["score"] if isinstance(result, dict) else result))
            sources.append(source)
        metrics = process_validation_metrics(sources, None, {"reward": scores})
        metrics["val/greedy_acc"] = float(np.mean(scores))
        return metrics

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None


def run_eval(cfg: DictConfig | dict | list[str] | None = None) -> dict[str, Any]:
    """Score, print and return {"metrics": process_validation_metrics output, "summary": per source}."""

    config = load_eval_config(cfg)
    d, c = config.data, config.custom_reward_function
    columns = [d.response_key, d.data_source_key, d.reward_model_key]
    rows, _ = read_rows(d.path, "data.path", columns if d.prompt_key is None else [d.prompt_key, *columns])
    score_fn = load_custom_reward_fn(c.path, c.name, c.reward_kwargs) or default_compute_score
    check_eval_inputs(config, score_fn, rows)  # before any row is scored
    sources, uids, infos = score_rows(rows, config, score_fn)
    metrics = process_validation_metrics(sources, uids, infos)
    summary = summarize(metrics)
    for source, values in sorted(summary.items()):
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items()))
        print(
            f"[hybridrl eval] {source}: {shown} ({sum(s == source for s in sources)} responses)", flush=True
        )
    result = {"metrics": metrics, "summary": summary}
    if config.output_path:
        out = Path(config.output_path).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result
