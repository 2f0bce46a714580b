"""Experiment tracking: one `Tracking` object fans metrics out to the backends in `trainer.logger`.

    tracker = Tracking("my_project", "run_1", ["console", "file"], config=cfg_dict)
    tracker.log({"critic/score/mean": 0.5, "actor/entropy": 1.2}, step=1)
    tracker.finish()

Backends:

* `console`: one compact line (step and a few key metrics) every `console_every` steps
  (`trainer.log_freq`) and at every step that carries validation metrics, written with
  `tqdm.write` so a progress bar on the terminal is redrawn below it instead of garbled; every
  metric at DEBUG level on the `hybridrl.utils.tracking` logger.
* `file`: JSON lines, one object per step with "step" and every metric, at
  `log_dir/metrics.jsonl` (plus `config.json` and `generations.jsonl`). Non-finite values are
  written as null so the file stays strict JSON. `python -m hybridrl.report log_dir` plots it.
* `tensorboard`: torch.utils.tensorboard SummaryWriter in `$TENSORBOARD_DIR` or `log_dir/tensorboard`.
* `wandb`: `wandb.init(project=, name=, config=)`; WANDB_MODE (e.g. offline) is honoured by wandb.
* `mlflow`: a run named after the experiment in an MLflow experiment named after the project;
  `$MLFLOW_TRACKING_URI` or `file:log_dir/mlruns`.

Every backend gets the config with its secrets redacted (`hybridrl.utils.redact`: env var values,
URL credentials, tokens and keys by name or shape).

`log_dir` is the argument, else `$HYBRIDRL_FILE_LOGGER_PATH` (a folder, or a `.jsonl` file path),
else `outputs/{project_name}/{experiment_name}`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridrl.utils.redact import redact_config
from hybridrl.utils.storage import named_storage_faults

__all__ = ["Tracking", "sanitize_metrics", "SUPPORTED_BACKENDS"]

logger = logging.getLogger(__name__)

SUPPORTED_BACKENDS = ("console", "file", "tensorboard", "wandb", "mlflow")
_PIP_HINT = "pip install 'hybridrl[trackers]'"

# (metric, short label) shown on the console line, in this order, when present.
_CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("critic/rewards/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "kl"),
    ("actor/kl_loss", "kl_loss"),
    ("actor/entropy", "entropy"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("perf/throughput", "tok/s"),
    ("timing_s/step", "step_s"),
)


def sanitize_metrics(data: Mapping[str, Any]) -> dict[str, float]:
    """Numbers (bool, int, float, numpy scalars, 1-element tensors/arrays) as floats; others dropped."""
    out: dict[str, float] = {}
    skipped = []
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[str(key)] = float(value.detach().cpu().item())
        elif isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "biuf":
            out[str(key)] = float(value.item())
        elif isinstance(value, (numbers.Real, np.bool_)):
            out[str(key)] = float(value)
        else:
            skipped.append(key)
    if skipped:
        logger.debug("tracking: skipped non-numeric metrics %s", skipped)
    return out


def _plain_config(config: Any) -> dict | None:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    return dict(config)


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _missing(package: str) -> ImportError:
    return ImportError(
        f"trainer.logger includes {package!r} but the {package} package is not installed: "
        f"pip install {package}   (or {_PIP_HINT} for every tracker)"
    )


# ----------------------------------------------------------------------------------------------
# backends
# ----------------------------------------------------------------------------------------------
def _console_write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)  # clears any active bar, prints, redraws it


class _Console:
    def __init__(self, every: int = 1) -> None:
        self.every = max(1, int(every))

    def log(self, metrics: dict[str, float], step: int) -> None:
        has_val = any(k.startswith("val-core/") for k in metrics)
        if step % self.every and not has_val:
            return
        parts = [f"step {step}"]
        parts += [f"{label} {_fmt(metrics[k])}" for k, label in _CONSOLE_KEYS if k in metrics]
        parts += [
            f"{_val_label(k)} {_fmt(v)}"
            for k, v in metrics.items()
            if k.startswith("val-core/") and "/mean@" in k
        ]
        if len(parts) == 1:  # none of the usual keys: show the first few
            parts += [f"{k} {_fmt(v)}" for k, v in list(metrics.items())[:6]]
        _console_write(" | ".join(parts))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %s", step, ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())))

    def log_generations(self, samples: list[dict], step: int) -> None:
        for s in samples[:1]:
            text = " ".join(f"[{k}] {str(v)[:200]!r}" for k, v in s.items())
            _console_write(f"step {step} | sample: {text}")

    def finish(self) -> None:
        pass


def _val_label(key: str) -> str:
    parts = key.split("/")  # val-core/{data_source}/{var}/mean@N (the data source may hold "/")
    return f"val[{'/'.join(parts[1:-2])}:{parts[-2]}@{parts[-1].split('@')[-1]}]"


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _File:
    def __init__(self, log_dir: str, metrics_file: str, config: dict | None) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, metrics_file)
        self.generations_path = os.path.join(log_dir, "generations.jsonl")
        if config is not None:
            with named_storage_faults("writing the file logger's config.json (trainer.logger=file)", log_dir):
                with open(os.path.join(log_dir, "config.json"), "w") as f:
                    json.dump(config, f, indent=1, default=str)

    def _append(self, path: str, row: dict) -> None:
        """One JSON line; on a full disk (or another storage fault) the file is cut back to its last
        whole line and a StorageError names the folder."""
        line = (json.dumps(row, default=str, allow_nan=False) + "\n").encode()
        what = f"writing the file logger's {os.path.basename(path)} (trainer.logger=file)"
        with named_storage_faults(what, os.path.dirname(path), needed=len(line)):
            # reopened each time: a crashed run keeps every finished line
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                try:
                    written = os.write(fd, line)
                    if written != len(line):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                except OSError:
                    os.ftruncate(fd, size)  # no half line: the file stays valid JSON lines
                    raise
            finally:
                os.close(fd)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._append(self.path, {"step": step, **{k: _json_value(v) for k, v in metrics.items()}})

    def log_generations(self, samples: list[dict], step: int) -> None:
        for s in samples:
            self._append(self.generations_path, {"step": step, **{k: _json_value(v) for k, v in s.items()}})

    def finish(self) -> None:
        pass


class _Tensorboard:
    def __init__(self, log_dir: str, config: dict | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("tensorboard") from e
        self.dir = os.environ.get("TENSORBOARD_DIR") or os.path.join(log_dir, "tensorboard")
        os.makedirs(self.dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.dir)
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        rows = [" | ".join(str(v).replace("\n", " ") for v in s.values()) for s in samples]
        header = " | ".join(samples[0]) if samples else ""
        self.writer.add_text("val/generations", "\n\n".join([header, *rows]), step)

    def finish(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, project: str, experiment: str, log_dir: str, config: dict | None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise _missing("wandb") from e
        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        if samples:
            columns = list(samples[0])
            table = self.wandb.Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])
            self.run.log({"val/generations": table}, step=step)

    def finish(self) -> None:
        self.run.finish()


def _mlflow_key(key: str) -> str:
    return re.sub(r"[^\w\-. /:]", "_", key.replace("@", "_at_"))


def _flatten(config: Mapping, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


class _Mlflow:
    def __init__(self, project: str, experiment: str, log_dir: str, config: dict | None) -> None:
        try:
            import mlflow
        except ImportError as e:
            raise _missing("mlflow") from e
        self.mlflow = mlflow
        uri = (
            os.environ.get("MLFLOW_TRACKING_URI")
            or f"file:{os.path.join(os.path.abspath(log_dir), 'mlruns')}"
        )
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=experiment)
        if config:
            mlflow.log_params({_mlflow_key(k): v for k, v in _flatten(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({_mlflow_key(k): v for k, v in metrics.items()}, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        self.mlflow.log_dict({"step": step, "samples": samples}, f"generations/step_{step}.json")

    def finish(self) -> None:
        self.mlflow.end_run()


# ----------------------------------------------------------------------------------------------
# the fan-out
# ----------------------------------------------------------------------------------------------
def _backend_list(default_backend: str | Sequence[str]) -> list[str]:
    names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
    unknown = [n for n in names if n not in SUPPORTED_BACKENDS]
    if unknown:
        raise ValueError(
            f"unknown tracking backend(s) {unknown} in trainer.logger; known: {list(SUPPORTED_BACKENDS)}"
        )
    return list(dict.fromkeys(names))


def _resolve_log_dir(project: str, experiment: str, log_dir: str | None) -> tuple[str, str]:
    """(folder, metrics file name)."""
    if log_dir:
        return str(log_dir), "metrics.jsonl"
    env = os.environ.get("HYBRIDRL_FILE_LOGGER_PATH")
    if env:
        if env.endswith(".jsonl"):
            return os.path.dirname(env) or ".", os.path.basename(env)
        return env, "metrics.jsonl"
    return os.path.join("outputs", project, experiment), "metrics.jsonl"


class Tracking:
    """Log metrics to every backend in `default_backend`.

    Args:
        project_name: project (wandb project, mlflow experiment, default folder).
        experiment_name: run name.
        default_backend: one name or a list (`trainer.logger`), from SUPPORTED_BACKENDS.
        config: the run's config (dict, DictConfig or dataclass), recorded by file/tensorboard/
            wandb/mlflow.
        log_dir: folder for `file`, `tensorboard` and the default mlflow store (see module doc).
        console_every: the console line is printed every this many steps (and with validation).

    Raises:
        ValueError: an unknown backend name.
        ImportError: a backend's package is missing (the message gives the pip command).
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | Sequence[str] = "console",
        config: Any = None,
        log_dir: str | None = None,
        console_every: int = 1,
    ) -> None:
        self.backends = _backend_list(default_backend)
        self.console_every = console_every
        self.project_name, self.experiment_name = project_name, experiment_name
        self.log_dir, metrics_file = _resolve_log_dir(project_name, experiment_name, log_dir)
        self.metrics_path = os.path.join(self.log_dir, metrics_file)
        plain = _plain_config(config)
        plain = redact_config(plain) if plain is not None else None  # no secret reaches a tracker
        self._loggers: dict[str, Any] = {}
        try:
            for name in self.backends:
                self._loggers[name] = self._make(name, plain, metrics_file)
        except BaseException:
            self.finish()
            raise
        self._closed = False

    def _make(self, name: str, config: dict | None, metrics_file: str) -> Any:
        if name == "console":
            return _Console(self.console_every)
        if name == "file":
            return _File(self.log_dir, metrics_file, config)
        if name == "tensorboard":
            return _Tensorboard(self.log_dir, config)
        if name == "wandb":
            return _Wandb(self.project_name, self.experiment_name, self.log_dir, config)
        return _Mlflow(self.project_name, self.experiment_name, self.log_dir, config)

    def log(self, data: Mapping[str, Any], step: int) -> dict[str, float]:
        """Log the numeric entries of `data` at `step`; returns what was logged."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"Tracking.log: step must be an int, got {type(step).__name__} {step!r}")
        if self._closed:
            raise RuntimeError("Tracking.log after finish(); create a new Tracking to log again")
        metrics = sanitize_metrics(data)
        for backend in self._loggers.values():
            backend.log(metrics, int(step))
        return metrics

    def log_generations(self, samples: list[dict], step: int) -> None:
        """Record decoded samples (dicts such as {"prompt", "response", "ground_truth", "score"})."""
        for backend in self._loggers.values():
            backend.log_generations(list(samples), int(step))

    def finish(self) -> None:
        """Flush and close every backend (safe to call twice)."""
        loggers, self._loggers = self._loggers, {}
        self._closed = True
        for name, backend in loggers.items():
            try:
                backend.finish()
            except Exception as e:  # one broken backend must not hide the others' data
                logger.warning("tracking: closing %s failed: %s", name, e)

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()
