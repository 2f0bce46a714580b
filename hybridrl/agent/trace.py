"""Rollout tracing (veRL's `actor_rollout_ref.rollout.trace.*`): each agent-loop trajectory becomes
one MLflow trace, with a child span per generation turn and per tool call.

* `trace.backend`: `mlflow` (needs the `mlflow-skinny` or `mlflow` package: `pip install
  hybridrl[trackers]`), or null (off). veRL's `weave` is refused at start-up.
* The MLflow experiment is `trace.project_name` (default `trainer.project_name`); each trace is
  tagged `step`, `sample_index` (the row's `extra_info.index`, else its row number), `rollout_n`
  (its position among the rows of that sample), `validate` and `experiment_name` (default
  `trainer.experiment_name`), so `tags.step = '3'` finds a step's trajectories, as in veRL.
* `trace.token2text`: the trajectory span's outputs also carry `prompt_text` / `response_text`
  (and each turn's span its decoded text).
* `trace.max_samples_per_step_per_worker`: trace only N random samples (all rollouts of each) per
  call of this replica; null traces all.
* Where traces go is MLflow's own setting: `MLFLOW_TRACKING_URI` (a server, `sqlite:///...`, or a
  `file:` store with `MLFLOW_ALLOW_FILE_STORE=true` on MLflow 3).
"""

from __future__ import annotations

import contextlib
import contextvars
import random
from typing import Any

__all__ = ["RolloutTracer", "set_span_outputs", "span"]

_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("hybridrl_rollout_tracing", default=False)
_MLFLOW: Any = None


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as e:
        raise ImportError(
            "actor_rollout_ref.rollout.trace.backend=mlflow needs the 'mlflow-skinny' (or 'mlflow') "
            "package: pip install mlflow-skinny (or hybridrl[trackers]), or set trace.backend=null"
        ) from e
    return mlflow


def span(name: str, **inputs: Any):
    """A child span of the current trajectory's trace (a no-op context when not tracing)."""
    if not _TRACING.get() or _MLFLOW is None:
        return contextlib.nullcontext()
    return _span(name, inputs)


@contextlib.contextmanager
def _span(name: str, inputs: dict[str, Any]):
    with _MLFLOW.start_span(name=name) as s:
        s.set_inputs(inputs)
        yield s


def set_span_outputs(s: Any, **outputs: Any) -> None:
    if s is not None:
        s.set_outputs(outputs)


class RolloutTracer:
    """Traces the trajectories of one rollout replica.

    Args:
        config: the rollout's TraceConfig.
        tokenizer: for token2text.
        seed: seeds the sample selection of max_samples_per_step_per_worker.
    """

    def __init__(self, config: Any, tokenizer: Any, seed: int = 0) -> None:
        global _MLFLOW
        self.config, self.tokenizer, self.seed = config, tokenizer, int(seed)
        self.enabled = config.backend == "mlflow"
        if self.enabled:
            _MLFLOW = _import_mlflow()
            _MLFLOW.set_experiment(config.project_name or "hybridrl")

    def selected_rows(self, sample_ids: list[str], call: int) -> set[int]:
        """Rows to trace: all, or every row of N randomly chosen samples."""
        limit = self.config.max_samples_per_step_per_worker
        if not self.enabled:
            return set()
        if limit is None:
            return set(range(len(sample_ids)))
        unique = list(dict.fromkeys(sample_ids))
        chosen = set(random.Random(self.seed * 1_000_003 + call).sample(unique, min(limit, len(unique))))
        return {i for i, s in enumerate(sample_ids) if s in chosen}

    @staticmethod
    def sample_ids(rows: list[dict[str, Any]]) -> list[str]:
        out = []
        for i, row in enumerate(rows):
            extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
            out.append(str(extra.get("index", row.get("index", i))))
        return out

    @contextlib.contextmanager
    def trajectory(self, tags: dict[str, Any], prompt_ids: list[int]):
        """Context of one traced trajectory; yields a callback taking the AgentLoopOutput."""
        token = _TRACING.set(True)
        try:
            with _MLFLOW.start_span(name="agent_loop", span_type="AGENT") as root:
                root.set_inputs({"prompt_ids": list(prompt_ids), **self._text("prompt_text", prompt_ids)})
                all_tags = {"experiment_name": self.config.experiment_name or "", **tags}
                _MLFLOW.update_current_trace(tags={k: str(v) for k, v in all_tags.items()})

                def finish(out: Any) -> None:
                    root.set_outputs(
                        {
                            "response_ids": list(out.response_ids),
                            "response_mask": list(out.response_mask),
                            "num_turns": out.num_turns,
                            "reward_score": out.reward_score,
                            "metrics": dict(out.metrics),
                            **self._text("response_text", out.response_ids),
                        }
                    )

                yield finish
        finally:
            _TRACING.reset(token)

    def _text(self, key: str, ids: list[int]) -> dict[str, str]:
        if not self.config.token2text:
            return {}
        return {key: self.tokenizer.decode(list(ids), skip_special_tokens=False)}

    def text(self, ids: list[int]) -> dict[str, str]:
        """{"text": decoded ids} under token2text, else {} (for child spans)."""
        return {"text": self.tokenizer.decode(list(ids))} if self.enabled and self.config.token2text else {}
