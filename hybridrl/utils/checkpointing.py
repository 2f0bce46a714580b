"""Checkpoint folders on disk: `default_local_dir/global_step_N/{actor,critic,data.pt,meta.json}`.

What is promised (docs/reliability.md):

* Atomic and durable: a checkpoint is written into `global_step_N.tmp`; every file and folder
  in it is fsynced, then it is renamed into place (:func:`replace_dir`: an existing folder of the
  same name is moved aside first and removed only once the new one is in place), the parent
  folder is fsynced, and only then is `latest_checkpointed_iteration.txt` replaced (also
  fsynced). A crash at any point leaves the previous checkpoint, and a pointer to a complete one.
* Self-describing: `meta.json` holds the run id, the config fingerprint (one short hash per
  config key, so a mismatch can name the keys), the step and a manifest (every file's size), so
  a truncated or missing file is found before anything is loaded (:func:`verify`).
* Pruning removes only folders of the current run, never the one just written nor the one the
  latest file names (:func:`prune`, :func:`prune_part`).

The engine checkpoints (hybridrl/engine/checkpoint.py, megatron/checkpoint.py) use
:func:`replace_dir` for their own `<path>.tmp -> <path>` step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from typing import Any

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def tmp_step_dir(root: str, step: int) -> str:
    return step_dir(root, step) + ".tmp"


def list_checkpoints(root: str) -> list[int]:
    """Completed checkpoint steps under `root`, ascending (ignores `.tmp` / `.old` leftovers)."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


# ---------------------------------------------------------------------------------- durability
def fsync_dir(path: str) -> None:
    """fsync a folder (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under `path` (and `path`), deepest first."""
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def replace_dir(tmp: str, final: str) -> None:
    """Make the fully written folder `tmp` durable and move it to `final`, atomically.

    An existing `final` is renamed to `final.old` first and removed only after `tmp` took its
    place, so at every instant one complete folder exists (`final`, or `final.old` after a crash
    between the two renames: :func:`restore_interrupted` puts it back).
    """
    if not os.path.isdir(tmp):
        raise FileNotFoundError(f"{tmp} does not exist: nothing to move to {final} (which is kept)")
    parent = os.path.dirname(os.path.abspath(final))
    fsync_tree(tmp)
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def write_file_atomic(path: str, text: str) -> None:
    """Replace `path` by `text` durably (temporary file, fsync, rename, fsync of the folder)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def restore_interrupted(root: str) -> list[str]:
    """Put back `global_step_N` from `global_step_N.old` where a save died between its renames."""
    restored = []
    if not os.path.isdir(root):
        return restored
    for name in os.listdir(root):
        if name.endswith(".old") and _STEP_DIR.match(name[:-4]):
            final = os.path.join(root, name[:-4])
            if not os.path.exists(final):
                os.rename(os.path.join(root, name), final)
                restored.append(final)
    return restored


# ---------------------------------------------------------------------------------- identity
# Keys that may change between a run and its resume (schedule, logging, resources, checkpoint
# housekeeping); every other key is part of the run's identity.
RESUMABLE_KEYS = (
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.logger",
    "trainer.log_freq",
    "trainer.log_val_generations",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.backend",
    "trainer.cpus_per_worker",
    "trainer.save_freq",
    "trainer.save_freq_secs",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.val_only",
    "trainer.default_hdfs_dir",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.remove_previous_ckpt_in_save",
    "trainer.del_local_ckpt_after_load",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
    "trainer.device",
    "trainer.ray_wait_register_center_timeout",
    "trainer.progress_bar",
    "trainer.make_report",
    "trainer.constant_reward_warn_steps",
    "trainer.step_timeout_s",
    "trainer.reward_timeout_s",
    "trainer.max_restarts",
    "trainer.preemption_grace_s",
    "trainer.esi_redundant_time",
    "actor_rollout_ref.nccl_timeout",
    "ray_kwargs",
    "global_profiler",
)
_RESUMABLE_SUFFIXES = (
    "micro_batch_size_per_gpu",
    "micro_batch_size",
    "max_token_len_per_gpu",
    "total_training_steps",  # derived from trainer.total_training_steps
    ".profiler",
)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS) or any(
        key.endswith(s) or f"{s}." in key for s in _RESUMABLE_SUFFIXES
    )


def config_digest(config: Any) -> dict[str, str]:
    """One short hash per identity key of `config` (a dataclass tree or a dict); no values leak."""
    flat: dict[str, Any] = {}
    _flatten(config, "", flat)
    return {
        k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:12]
        for k, v in sorted(flat.items())
        if not _resumable(k)
    }


def fingerprint(digest: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:16]


def differing_keys(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Identity keys both digests have, with different values. A key only one side has is a key
    another hybridrl version added or removed: not compared, so upgrading the library does not
    make a run's own checkpoints look like another run's."""
    return sorted(k for k in set(a) & set(b) if a[k] != b[k])


# ---------------------------------------------------------------------------------- meta, verify
def manifest(path: str) -> dict[str, int]:
    """Size of every file under `path`, by path relative to it (META_FILE itself excluded)."""
    out = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if rel != META_FILE:
                out[rel] = os.path.getsize(full)
    return out


def write_meta(path: str, meta: dict[str, Any]) -> None:
    """Write `meta` plus the manifest of `path` into `path/meta.json` (call when all is written)."""
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump({**meta, "manifest": manifest(path)}, f, indent=1, sort_keys=True)


def read_meta(path: str) -> dict[str, Any] | None:
    """`meta.json` of a checkpoint folder; None when absent or unreadable (older layouts)."""
    try:
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def verify(path: str) -> str | None:
    """None when every file of the manifest is there with its size, else what is wrong."""
    meta = read_meta(path)
    if meta is None:
        return f"{META_FILE} missing or unreadable"
    for rel, size in meta.get("manifest", {}).items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, {size} were written"
    return None


def finalize(root: str, step: int) -> str:
    """Move a fully written `global_step_N.tmp` into place and point the latest file at it."""
    tmp, final = tmp_step_dir(root, step), step_dir(root, step)
    replace_dir(tmp, final)
    write_file_atomic(os.path.join(root, LATEST_FILE), str(step))
    return final


# ---------------------------------------------------------------------------------- finding
def latest_pointer(root: str) -> int | None:
    try:
        with open(os.path.join(root, LATEST_FILE)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def find_latest(root: str) -> str | None:
    """Path of the checkpoint named by the latest file, else the newest complete one, else None."""
    found = candidates(root)
    return found[0] if found else None


def candidates(root: str) -> list[str]:
    """Checkpoints to try on resume, best first: the one the latest file names, then the others
    newest first."""
    steps = list_checkpoints(root)
    latest = latest_pointer(root)
    order = ([latest] if latest in steps else []) + [s for s in reversed(steps) if s != latest]
    return [step_dir(root, s) for s in order]


def run_ids(root: str) -> dict[str, list[int]]:
    """The runs whose checkpoints are under `root`: run id ('' for folders without one) -> steps."""
    out: dict[str, list[int]] = {}
    for s in list_checkpoints(root):
        meta = read_meta(step_dir(root, s)) or {}
        out.setdefault(str(meta.get("run_id") or ""), []).append(s)
    return out


# ---------------------------------------------------------------------------------- pruning
def _own_steps(root: str, run_id: str | None) -> list[int]:
    steps = list_checkpoints(root)
    if run_id is None:
        return steps
    return [s for s in steps if (read_meta(step_dir(root, s)) or {}).get("run_id") == run_id]


def _doomed(root: str, keep: int | None, run_id: str | None, protect: set[int]) -> list[int]:
    if keep is None or keep <= 0:
        return []
    steps = _own_steps(root, run_id)
    latest = latest_pointer(root)
    guarded = set(protect) | ({latest} if latest is not None else set())
    old = steps[:-keep] if len(steps) > keep else []
    return [s for s in old if s not in guarded]


def prune(
    root: str, keep: int | None, run_id: str | None = None, protect: set[int] = frozenset()
) -> list[int]:
    """Delete the oldest checkpoints of run `run_id` so that at most `keep` of its remain.

    Never deletes another run's folders (any run's when `run_id` is None), the steps in
    `protect` (the one just written) or the one the latest file names. Returns deleted steps.
    """
    doomed = _doomed(root, keep, run_id, set(protect))
    for s in doomed:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return doomed


def prune_part(
    root: str, part: str, keep: int | None, run_id: str | None = None, protect: set[int] = frozenset()
) -> list[int]:
    """Delete `part` (e.g. 'critic') of all but the newest `keep` checkpoints of run `run_id`
    (`trainer.max_critic_ckpt_to_keep`); the rest of those checkpoints stays."""
    doomed = [
        s
        for s in _doomed(root, keep, run_id, set(protect))
        if os.path.isdir(os.path.join(step_dir(root, s), part))
    ]
    for s in doomed:
        shutil.rmtree(os.path.join(step_dir(root, s), part), ignore_errors=True)
        meta = read_meta(step_dir(root, s))
        if meta is not None:  # the manifest no longer lists the removed part
            kept = {k: v for k, v in meta.get("manifest", {}).items() if not k.startswith(part + os.sep)}
            meta["manifest"] = kept
            meta.setdefault("pruned_parts", []).append(part)
            write_file_atomic(os.path.join(step_dir(root, s), META_FILE), json.dumps(meta, indent=1))
    return doomed


def step_of(path: str) -> int:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not m:
        raise ValueError(
            f"trainer.resume_from_path={path!r} is not a checkpoint folder: expected a path ending in "
            "global_step_<N> (see trainer.default_local_dir)"
        )
    return int(m.group(1))
