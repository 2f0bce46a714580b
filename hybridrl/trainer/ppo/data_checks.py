"""Start-up check of every row of the train and validation files, before Ray and the datasets.

The dataset builds a row when the sampler draws it, so a bad row in the middle of a file used to
fail hours into a run. ``check_data_files`` reads only the columns a run needs (pyarrow column
reads for parquet, the lines for jsonl; nothing is tokenised) and checks each row that the run
will use (``data.train_max_samples`` / ``val_max_samples`` respected):

* ``data.prompt_key``: a string, or a non-empty list of ``{role, content}`` messages (role a
  string, content set); for parquet the column's type is checked first;
* with a rule-based reward (a built-in reward manager decodes every row: ``reward_model.enable``
  off, or a GenRM; not an ``importlib`` or user-registered manager): the ``data.reward_fn_key`` column and
  ``reward_model`` holding a ``ground_truth`` key; with the built-in scorers (no
  ``custom_reward_function.path``, no SandboxFusion URL) also a ground truth that is set and a
  data source that has a registered scorer. Rows whose reward the external agents report
  (``rollout.mode=server`` with ``agent_server.reward_source=agent``) need neither.

Images (``data.image_key``) are checked for every row by the dataset itself when the model has a
processor (placeholders against images, each image decoded), before Ray as well. A custom dataset
class (``data.custom_cls.path``) reads its own columns and is not checked here. Files that are
missing, unreadable or of another type are left to the dataset loader, which names them.
Each error names the files key, the file, the row index (0-based, in the file), the column and
the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.utils.config_loader import ConfigError

__all__ = [
    "RowSpec",
    "check_data_files",
    "check_file",
    "check_messages",
    "parquet_table",
    "read_columns",
    "row_spec",
]

_PREPROCESS = "regenerate the file (hybridrl/data/preprocess writes these columns)"
# the reward managers that decode every row (reward/manager.py decode_samples); a manager
# registered by user code may read other columns and is not assumed to
BUILTIN_MANAGERS = ("naive", "batch", "dapo", "prime")


@dataclass(frozen=True)
class RowSpec:
    """What every row must hold.

    Attributes:
        prompt_key: the prompt column (`data.prompt_key`).
        source_key: the data-source column the reward manager reads (`data.reward_fn_key`); None:
            no rule-based reward, not needed.
        ground_truth: `reward_model.ground_truth` is read for every row (rule-based reward).
        known_sources: the data sources the built-in scorers know; None: any (a custom function).
    """

    prompt_key: str
    source_key: str | None = None
    ground_truth: bool = False
    known_sources: tuple[str, ...] | None = None


def row_spec(config: Any) -> RowSpec:
    """The RowSpec of a PPO config (see the module docstring for when each column is needed)."""
    from hybridrl.trainer.ppo.genrm_config import is_genrm

    rm = config.reward_model
    builtin_manager = config.reward_manager.source != "importlib" and rm.reward_manager in BUILTIN_MANAGERS
    rule = (not rm.enable or is_genrm(config)) and builtin_manager
    rollout = config.actor_rollout_ref.rollout
    if rollout.mode == "server" and rollout.agent_server.reward_source == "agent":
        rule = False  # the external agents report every trajectory's reward
    if not rule:
        return RowSpec(config.data.prompt_key)
    known = None
    if not config.custom_reward_function.path and not rm.sandbox_fusion.url:
        from hybridrl.reward.scorers import registered_data_sources

        known = tuple(registered_data_sources())
    return RowSpec(config.data.prompt_key, config.data.reward_fn_key, True, known)


def check_data_files(config: Any) -> None:
    """Check every used row of `data.train_files` and `data.val_files` (ConfigError naming the
    key, file, row, column and fix)."""
    d = config.data
    if d.custom_cls.path:
        return
    spec = row_spec(config)
    for key, files, limit in (
        ("data.train_files", d.train_files, d.train_max_samples),
        ("data.val_files", d.val_files, d.val_max_samples),
    ):
        left = limit if isinstance(limit, int) and limit > 0 else None
        for path in [files] if isinstance(files, (str, os.PathLike)) else list(files or []):
            if left is not None and left <= 0:
                break  # the rows past data.*_max_samples are never used
            n = check_file(os.path.expanduser(os.fspath(path)), key, spec, left)
            left = None if left is None else left - n


def check_file(path: str, key: str, spec: RowSpec, limit: int | None = None) -> int:
    """Check the first `limit` rows (all: None) of one parquet / jsonl file; returns the rows checked."""
    needed, fixes = _needed(spec), _fixes(spec)
    table = parquet_table(path, key, needed, fixes, lambda schema, where: _check_types(schema, where, spec))
    if table is not None:
        n = table.num_rows if limit is None else min(table.num_rows, limit)
        table = table.slice(0, n)
        if _arrow_rows_ok(table, spec):
            return n  # every row passes: checked on the arrow columns, no Python objects built
        columns = {c: table.column(c).to_pylist() for c in needed}  # find the row, say what is wrong
    else:
        columns = read_columns(path, key, needed, fixes)
        if columns is None:
            return 0
        n = len(next(iter(columns.values()))) if columns else 0
        n = n if limit is None else min(n, limit)
    where = f"{key}: file {path!r}"
    check_messages(columns[spec.prompt_key][:n], where, spec.prompt_key, "data.prompt_key", allow_str=True)
    if spec.source_key is not None:
        _check_sources(columns[spec.source_key][:n], where, spec)
    if spec.ground_truth:
        _check_ground_truths(columns["reward_model"][:n], where, spec.known_sources is not None)
    return n


def _needed(spec: RowSpec) -> list[str]:
    cols = [spec.prompt_key]
    if spec.source_key is not None:
        cols.append(spec.source_key)
    if spec.ground_truth:
        cols.append("reward_model")
    return list(dict.fromkeys(cols))


def _fixes(spec: RowSpec) -> dict[str, str]:
    return {
        spec.prompt_key: "set data.prompt_key to the prompt column",
        str(spec.source_key): "set data.reward_fn_key to the column naming each row's data source",
        "reward_model": "give each row reward_model={'ground_truth': ...}, or score with reward_model.enable",
    }


def read_columns(
    path: str, key: str, needed: list[str], fixes: dict[str, str], check_schema: Callable | None = None
) -> dict[str, list] | None:
    """{column: values of every row} of the `needed` columns of one parquet / jsonl file.

    Args:
        path: the file; key: its config key (named in errors).
        fixes: column -> what to do when the file lacks it (named in the error).
        check_schema: `check_schema(pyarrow schema, where)` for parquet files (column types).

    Returns:
        None for a file that is missing, unreadable or of another type: the dataset loader names it.
    """
    if not os.path.isfile(path):
        return None
    suffix = os.path.splitext(path)[1].lower()
    where = f"{key}: file {path!r}"
    if suffix == ".parquet":
        table = parquet_table(path, key, needed, fixes, check_schema)
        return None if table is None else {c: table.column(c).to_pylist() for c in needed}
    if suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path)
        if rows is None:
            return None
        _require(where, needed, list(dict.fromkeys(k for r in rows for k in r)), fixes)
        return {c: [r.get(c) for r in rows] for c in needed}  # a row without it fails its row check
    return None


def parquet_table(
    path: str, key: str, needed: list[str], fixes: dict[str, str], check_schema: Callable | None = None
) -> Any:
    """The `needed` columns of a parquet file as a pyarrow Table (missing columns and, with
    `check_schema`, column types checked first); None for anything the dataset loader must report
    (missing, unreadable, not parquet)."""
    if not (os.path.isfile(path) and os.path.splitext(path)[1].lower() == ".parquet"):
        return None
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except Exception:  # noqa: BLE001  (empty / corrupt: the loader's message names it)
        return None
    where = f"{key}: file {path!r}"
    _require(where, needed, list(schema.names), fixes)
    if check_schema is not None:
        check_schema(schema, where)
    return pf.read(columns=list(dict.fromkeys(needed)))


def _arrow_rows_ok(table: Any, spec: RowSpec) -> bool:
    """Whether every row passes, computed on the arrow columns (False: look row by row).

    Uses arrow's buffers and plain Python, not `pyarrow.compute`: the first compute call imports
    pandas (a noticeable part of the default run's start-up, bench/startup.py), for checks this cheap.
    """
    import numpy as np
    import pyarrow as pa

    try:
        prompt = table.column(spec.prompt_key).combine_chunks()
        if prompt.null_count:
            return False
        if pa.types.is_list(prompt.type) or pa.types.is_large_list(prompt.type):
            offsets = prompt.offsets  # len(prompt) + 1 row boundaries into the flattened messages
            width = np.int64 if pa.types.is_large_list(prompt.type) else np.int32
            bounds = np.frombuffer(offsets.buffers()[1], dtype=width)[
                offsets.offset : offsets.offset + len(offsets)
            ]
            if len(bounds) > 1 and bool((np.diff(bounds) == 0).any()):  # a row with no message
                return False
            messages = prompt.flatten()
            role = messages.type.field("role").type
            if messages.null_count or not (pa.types.is_string(role) or pa.types.is_large_string(role)):
                return False
            if any(messages.field(f).null_count for f in ("role", "content")):
                return False
        if spec.known_sources is not None:
            sources = table.column(str(spec.source_key)).combine_chunks()
            if sources.null_count or not set(sources.to_pylist()) <= set(spec.known_sources):
                return False
        if spec.ground_truth:
            rm = table.column("reward_model").combine_chunks()
            if rm.null_count or (spec.known_sources is not None and rm.field("ground_truth").null_count):
                return False
    except (pa.ArrowException, KeyError, TypeError, ValueError):
        return False
    return True


def _require(where: str, needed: list[str], present: list[str], fixes: dict[str, str]) -> None:
    for col in needed:
        if col not in present:
            raise ConfigError(
                f"{where} has no column {col!r} (columns: {present}), which every row needs; "
                f"{fixes.get(col, 'add it')}, or {_PREPROCESS}"
            )


def _jsonl_rows(path: str) -> list[dict] | None:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return None  # the loader names the line
                rows.append(row if isinstance(row, dict) else {})
    return rows


def _check_types(schema: Any, where: str, spec: RowSpec) -> None:
    """Column types that no row can get right (parquet: one type per column)."""
    import pyarrow as pa

    t = schema.field(spec.prompt_key).type
    ok = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        v = t.value_type
        ok = pa.types.is_struct(v) and v.get_field_index("role") >= 0 and v.get_field_index("content") >= 0
    if not ok:
        raise ConfigError(
            f"{where}: column {spec.prompt_key!r} (data.prompt_key) has type {t} in every row; a prompt is "
            f"a string or a list of {{'role', 'content'}} messages: {_PREPROCESS}, or point data.prompt_key "
            "at the prompt column"
        )
    if spec.ground_truth:
        t = schema.field("reward_model").type
        if not (pa.types.is_struct(t) and t.get_field_index("ground_truth") >= 0):
            raise ConfigError(
                f"{where}: column 'reward_model' has type {t} in every row; the reward manager reads "
                f"reward_model['ground_truth'] of each row: store a struct/dict with a ground_truth key, or {_PREPROCESS}"
            )


def check_messages(values: list, where: str, col: str, col_key: str, *, allow_str: bool) -> None:
    """Each value a non-empty list of {role: str, content} messages (or a string with
    `allow_str`); ConfigError naming the row, the column and its key `col_key`."""
    for i, p in enumerate(values):
        if allow_str and isinstance(p, str):
            continue
        problem = None
        if not isinstance(p, (list, tuple)) or not p:
            want = "a string or a non-empty message list" if allow_str else "a non-empty message list"
            problem = f"is {type(p).__name__} {p!r:.80}, not {want}"
        else:
            bad = next((m for m in p if not _is_message(m)), None)
            if bad is not None:
                problem = f"has a message {bad!r:.120} without a string 'role' and a 'content'"
        if problem is not None:
            raise ConfigError(
                f"{where} row {i}: column {col!r} ({col_key}) {problem}; fix or drop the row, or {_PREPROCESS}"
            )


def _is_message(m: Any) -> bool:
    return isinstance(m, Mapping) and isinstance(m.get("role"), str) and m.get("content") is not None


def _check_sources(values: list, where: str, spec: RowSpec) -> None:
    if spec.known_sources is None:
        return  # a custom reward function decides what a data source means
    known = set(spec.known_sources)
    for i, s in enumerate(values):
        if s not in known:
            raise ConfigError(
                f"{where} row {i}: column {spec.source_key!r} (data.reward_fn_key) is {s!r}, which no built-in "
                f"scorer handles (known: {sorted(known)}); set custom_reward_function.path to a file with "
                "compute_score(data_source, solution_str, ground_truth, extra_info), register a scorer "
                "(hybridrl.reward.scorers.register_scorer), or fix the row"
            )


def _check_ground_truths(values: list, where: str, need_value: bool) -> None:
    for i, rm in enumerate(values):
        if not isinstance(rm, Mapping) or "ground_truth" not in rm:
            raise ConfigError(
                f"{where} row {i}: column 'reward_model' is {rm!r:.80}; the reward manager reads "
                "reward_model['ground_truth'] of every row: give the row reward_model={'ground_truth': ...} "
                f"or drop it ({_PREPROCESS})"
            )
        if need_value and rm["ground_truth"] is None:
            raise ConfigError(
                f"{where} row {i}: column 'reward_model' has ground_truth=None; the built-in scorers compare "
                "the response with it: set it, drop the row, or score with custom_reward_function.path"
            )
