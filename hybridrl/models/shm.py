"""veRL's `model.use_shm`: load a model from a copy in shared memory (/dev/shm, a RAM disk).

Every worker on the node then reads the weights from RAM instead of the (network) disk. The
copy is made once per source folder and reused while the source is unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil

SHM_ROOT = os.environ.get("HYBRIDRL_SHM_DIR", "/dev/shm/hybridrl_models")


def copy_to_shm(path: str, key: str, root: str = SHM_ROOT) -> str:
    """Copy the local model folder `path` under `root` (once); returns the copy's path.

    Raises:
        ValueError: `path` is not a local folder (download it first, or set `<key>=False`).
    """
    if not os.path.isdir(path):
        raise ValueError(f"{key}=True copies a local model folder to {root}, but {path!r} is not one; "
                         f"download the model to a folder first, or set {key}=False")  # fmt: skip
    stamp = max(os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files or ["."])
    digest = hashlib.sha1(f"{os.path.abspath(path)}:{stamp}".encode()).hexdigest()[:12]
    dst = os.path.join(root, f"{os.path.basename(os.path.normpath(path))}-{digest}")
    if not os.path.isdir(dst):
        tmp = dst + f".tmp{os.getpid()}"
        shutil.copytree(path, tmp, dirs_exist_ok=True)
        os.replace(tmp, dst)
    return dst
