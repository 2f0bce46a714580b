"""Driver-side checkpoint layout: `default_local_dir/global_step_N/{actor,critic,data.pt}`.

A checkpoint is written into `global_step_N.tmp` and renamed into place only when every part is
on disk, then `latest_checkpointed_iteration.txt` is replaced atomically. A crash while saving
therefore leaves the previous checkpoint (and the pointer to it) loadable.
"""

from __future__ import annotations

import os
import re
import shutil

LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def tmp_step_dir(root: str, step: int) -> str:
    return step_dir(root, step) + ".tmp"


def list_checkpoints(root: str) -> list[int]:
    """Completed checkpoint steps under `root`, ascending (ignores `.tmp` leftovers)."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def finalize(root: str, step: int) -> str:
    """Move a fully written `global_step_N.tmp` into place and point the latest file at it."""
    tmp, final = tmp_step_dir(root, step), step_dir(root, step)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = os.path.join(root, LATEST_FILE + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST_FILE))
    return final


def prune(root: str, keep: int | None) -> list[int]:
    """Delete the oldest completed checkpoints so that at most `keep` remain; returns deleted steps."""
    if keep is None or keep <= 0:
        return []
    steps = list_checkpoints(root)
    doomed = steps[:-keep] if len(steps) > keep else []
    for s in doomed:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return doomed


def prune_part(root: str, part: str, keep: int | None) -> list[int]:
    """Delete `part` (e.g. 'critic') of all but the newest `keep` completed checkpoints
    (`trainer.max_critic_ckpt_to_keep`); the rest of those checkpoints stays."""
    if keep is None or keep <= 0:
        return []
    steps = list_checkpoints(root)
    doomed = [
        s
        for s in (steps[:-keep] if len(steps) > keep else [])
        if os.path.isdir(os.path.join(step_dir(root, s), part))
    ]
    for s in doomed:
        shutil.rmtree(os.path.join(step_dir(root, s), part), ignore_errors=True)
    return doomed


def find_latest(root: str) -> str | None:
    """Path of the checkpoint named by the latest file, else the newest complete one, else None."""
    latest = os.path.join(root, LATEST_FILE)
    if os.path.exists(latest):
        with open(latest) as f:
            text = f.read().strip()
        if text.isdigit() and os.path.isdir(step_dir(root, int(text))):
            return step_dir(root, int(text))
    steps = list_checkpoints(root)
    return step_dir(root, steps[-1]) if steps else None


def step_of(path: str) -> int:
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if not m:
        raise ValueError(
            f"trainer.resume_from_path={path!r} is not a checkpoint folder: expected a path ending in "
            "global_step_<N> (see trainer.default_local_dir)"
        )
    return int(m.group(1))
