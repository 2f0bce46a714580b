"""reasoning-gym tasks as RL data: generated at start-up, scored by each task's own scorer.

`data.reasoning_gym.tasks` names procedural tasks of the `reasoning-gym` package (PyPI; the `envs`
extra): each entry is ``{name, size, seed, val_size, val_seed, config}``, where ``config`` holds the
task's own generator arguments (``reasoning_gym.create_dataset(name, size=, seed=, **config)``).
At start-up main_ppo writes the rows to ``train.parquet`` / ``val.parquet`` (veRL's schema, the
same rows it reads from ``data.train_files``) in ``data.reasoning_gym.data_dir``, and points the data
files at them.

A row: ``data_source`` ``reasoning_gym``, ``prompt`` (an optional system message, then the question
as the user message), ``reward_model`` ``{"style": "rule", "ground_truth": <the task's answer>}``,
``extra_info`` ``{"rg_task", "rg_size", "rg_seed", "rg_config" (JSON), "index"}``.

The scorer (data_source ``reasoning_gym``) rebuilds the row's entry from those fields (generation is
deterministic; datasets are cached per process) and calls the task's own ``score_answer(answer,
entry)``. The answer is the last ``<answer>...</answer>`` block of the response (reasoning-gym's
convention), else the text after the last ``####``, else the whole response, stripped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

RG_DATA_SOURCE = "reasoning_gym"
TASK_KEYS = {"name", "size", "seed", "val_size", "val_seed", "config"}
DEFAULT_VAL_SIZE = 50
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*(.*)", re.DOTALL)

__all__ = [
    "RG_DATA_SOURCE",
    "compute_score",
    "ensure_reasoning_gym_data",
    "extract_answer",
    "make_rows",
    "normalize_task",
]


def _import_rg():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "data.reasoning_gym.tasks needs the reasoning-gym package: pip install 'hybridrl[envs]' "
            "(or pip install reasoning-gym)"
        ) from e
    return reasoning_gym


def normalize_task(spec: Any, where: str = "data.reasoning_gym.tasks") -> dict[str, Any]:
    """One task entry with defaults filled in; ValueError naming the entry and the fix."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(
            f"{where}: each task is a mapping with a 'name' (a reasoning-gym task); got {spec!r}"
        )
    unknown = set(spec) - TASK_KEYS
    if unknown:
        raise ValueError(
            f"{where}: task {spec['name']!r} has unknown keys {sorted(unknown)}; known: {sorted(TASK_KEYS)}"
        )
    rg = _import_rg()
    from reasoning_gym.factory import DATASETS

    if spec["name"] not in DATASETS:
        raise ValueError(
            f"{where}: {spec['name']!r} is not a reasoning-gym task; known: {', '.join(sorted(DATASETS))}"
        )
    out = {
        "name": spec["name"],
        "size": int(spec.get("size", 1000)),
        "seed": int(spec.get("seed", 0)),
        "val_size": int(spec.get("val_size", DEFAULT_VAL_SIZE)),
        "config": dict(spec.get("config") or {}),
    }
    out["val_seed"] = int(spec["val_seed"]) if spec.get("val_seed") is not None else out["seed"] + 1
    if out["size"] < 1 or out["val_size"] < 0:
        raise ValueError(f"{where}: task {out['name']!r} needs size >= 1 and val_size >= 0; got {spec!r}")
    try:  # the task's own config class checks its arguments
        rg.create_dataset(out["name"], size=1, seed=out["seed"], **out["config"])
    except Exception as e:
        raise ValueError(
            f"{where}: reasoning-gym refused task {out['name']!r} with config {out['config']}: {e}"
        ) from e
    return out


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int, config_json: str):
    return _import_rg().create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def make_rows(task: dict[str, Any], split: str, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The rows of one normalised task's split ("train": size/seed, "val": val_size/val_seed)."""
    size, seed = (task["size"], task["seed"]) if split == "train" else (task["val_size"], task["val_seed"])
    if size == 0:
        return []
    config_json = json.dumps(task["config"], sort_keys=True)
    data = _dataset(task["name"], size, seed, config_json)
    rows = []
    for i in range(size):
        entry = data[i]
        prompt = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompt.append({"role": "user", "content": entry["question"]})
        rows.append(
            {
                "data_source": RG_DATA_SOURCE,
                "prompt": prompt,
                "ability": task["name"],
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "rg_task": task["name"],
                    "rg_size": size,
                    "rg_seed": seed,
                    "rg_config": config_json,
                },
            }
        )
    return rows


def ensure_reasoning_gym_data(
    tasks: list[Any], data_dir: str | None = None, system_prompt: str | None = None
) -> dict[str, str]:
    """Write train/val parquet files for `tasks` (once per distinct task list) and return their paths.

    The folder is ``data_dir`` (default ``$HYBRIDRL_DATA_DIR/reasoning_gym`` or
    ``~/.cache/hybridrl/reasoning_gym``) / a hash of the normalised tasks and the system prompt.
    """
    import pandas as pd

    if not tasks:
        raise ValueError("data.reasoning_gym.tasks is empty: name at least one reasoning-gym task")
    specs = [normalize_task(t, f"data.reasoning_gym.tasks[{i}]") for i, t in enumerate(tasks)]
    key = hashlib.sha256(json.dumps([specs, system_prompt], sort_keys=True).encode()).hexdigest()[:16]
    root = data_dir or os.path.join(
        os.environ.get("HYBRIDRL_DATA_DIR") or os.path.expanduser("~/.cache/hybridrl"), "reasoning_gym"
    )
    out = Path(root) / key
    paths = {split: str(out / f"{split}.parquet") for split in ("train", "val")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    for split, path in paths.items():
        rows = [row for spec in specs for row in make_rows(spec, split, system_prompt)]
        if not rows:
            raise ValueError(f"data.reasoning_gym: every task has {split} size 0; give one a val_size > 0")
        tmp = f"{path}.tmp{os.getpid()}"
        pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.replace(tmp, path)
    (out / "tasks.json").write_text(
        json.dumps({"tasks": specs, "system_prompt": system_prompt}, indent=1) + "\n"
    )
    return paths


def extract_answer(response: str) -> str:
    """The last <answer>...</answer> block, else the text after the last ####, else the response."""
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1].strip()
    parts = response.rsplit("####", 1)
    return parts[1].strip() if len(parts) == 2 else response.strip()


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The task's own score_answer on the row's entry (rebuilt from extra_info), in [0, 1]."""
    info = extra_info if isinstance(extra_info, dict) else {}
    missing = [k for k in ("rg_task", "rg_size", "rg_seed", "rg_config", "index") if k not in info]
    if missing:
        raise ValueError(
            f"a row with data_source 'reasoning_gym' lacks extra_info {missing}: generate the rows with "
            "data.reasoning_gym.tasks (hybridrl.data.reasoning_gym_task.make_rows)"
        )
    data = _dataset(info["rg_task"], int(info["rg_size"]), int(info["rg_seed"]), info["rg_config"])
    entry = data[int(info["index"])]
    if ground_truth is not None and str(entry["answer"]) != str(ground_truth):
        raise ValueError(
            f"reasoning_gym row {info['rg_task']}[{info['index']}] (seed {info['rg_seed']}) regenerates with "
            f"answer {entry['answer']!r}, not the row's ground truth {ground_truth!r}: the installed "
            "reasoning-gym generates other data than the one that wrote the file; regenerate the data"
        )
    score = data.score_answer(extract_answer(solution_str), entry)
    return float(score)
