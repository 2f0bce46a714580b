"""veRL's `model.use_shm`: load a model from a copy in shared memory (/dev/shm, a RAM disk).

Every worker on the node then reads the weights from RAM instead of the (network) disk. The
copy is made once per source folder and reused while the source is unchanged.

/dev/shm is shared by every user of the machine, so a copy is trusted only after a check
never by its path alone:

* the root folder (``HYBRIDRL_SHM_DIR``, default ``/dev/shm/hybridrl_models``) must belong to this
  user and be writable by nobody else (it is created with mode 0700);
* a copy carries a manifest (every file's size and SHA-256, written when the copy is made); before
  a copy is used, the folder and every file in it must belong to this user, be writable by nobody
  else and not be symlinks, the files must be exactly those of the manifest, with the sizes of the
  source folder's files and the manifest's hashes.

A copy of this user that fails the check (a truncated or changed file, a file added) is removed
and made again, with a warning; one that belongs to another user is refused, naming the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat

SHM_ROOT = os.environ.get("HYBRIDRL_SHM_DIR", "/dev/shm/hybridrl_models")
MANIFEST = ".hybridrl_manifest.json"

logger = logging.getLogger(__name__)


class ShmCopyError(ValueError):
    """The shared-memory copy (or its folder) cannot be trusted and cannot be replaced by us."""


def copy_to_shm(path: str, key: str, root: str = SHM_ROOT) -> str:
    """Copy the local model folder `path` under `root` (once, checked before each use); returns
    the copy's path.

    Raises:
        ValueError: `path` is not a local folder (download it first, or set `<key>=False`).
        ShmCopyError: `root` or the copy belongs to another user or is writable by others.
    """
    if not os.path.isdir(path):
        raise ValueError(f"{key}=True copies a local model folder to {root}, but {path!r} is not one; "
                         f"download the model to a folder first, or set {key}=False")  # fmt: skip
    _private_root(root, key)
    stamp = max(os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files or ["."])
    digest = hashlib.sha1(f"{os.path.abspath(path)}:{stamp}".encode()).hexdigest()[:12]
    dst = os.path.join(root, f"{os.path.basename(os.path.normpath(path))}-{digest}")
    if os.path.lexists(dst):
        problem = verify_copy(dst, path)
        if problem is None:
            return dst
        if os.lstat(dst).st_uid != os.getuid():
            raise ShmCopyError(
                f"{key}=True: {dst} belongs to another user ({problem}); it is not used. Remove it, or point "
                f"HYBRIDRL_SHM_DIR at a folder of your own, or set {key}=False"
            )
        logger.warning(
            "%s: the shared-memory copy %s cannot be used (%s); copying the model again", key, dst, problem
        )
        _remove(dst)
    tmp = dst + f".tmp{os.getpid()}"
    _remove(tmp)
    shutil.copytree(path, tmp, symlinks=False)
    _tighten(tmp)
    _write_manifest(tmp)
    os.replace(tmp, dst)
    problem = verify_copy(dst, path)
    if problem is not None:
        raise ShmCopyError(
            f"{key}=True: the fresh copy {dst} fails its own check ({problem}); set {key}=False"
        )
    return dst


def _private_root(root: str, key: str) -> None:
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ShmCopyError(
            f"{key}=True: the shared-memory folder {root} is not a folder of this user (owner uid {st.st_uid}, "
            f"this user {os.getuid()}); point HYBRIDRL_SHM_DIR at a folder of your own, or set {key}=False"
        )
    if st.st_mode & 0o022:
        os.chmod(root, 0o700)  # ours: make it private


def _tighten(folder: str) -> None:
    """Nobody but this user may write the copy (copytree keeps the source's modes)."""
    for d, _, files in os.walk(folder):
        for p in [d] + [os.path.join(d, f) for f in files]:
            os.chmod(p, stat.S_IMODE(os.lstat(p).st_mode) & ~0o022)


def _files(folder: str) -> dict[str, str]:
    """{relative path: absolute path} of every entry below `folder` but the manifest (folders
    excluded; symlinks included, so that the check can refuse them)."""
    out = {}
    for d, dirs, files in os.walk(folder):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            full = os.path.join(d, name)
            rel = os.path.relpath(full, folder)
            if rel != MANIFEST:
                out[rel] = full
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: str) -> None:
    entries = {rel: {"size": os.path.getsize(p), "sha256": _sha256(p)} for rel, p in _files(folder).items()}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(entries, f)
        f.flush()
        os.fsync(f.fileno())


def _private(path: str) -> str | None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def verify_copy(dst: str, src: str) -> str | None:
    """Why the copy `dst` of the model folder `src` must not be used, or None when it may.

    Checks owner and permissions of the folder, its sub-folders and files, the manifest's file list
    against the folder's and the source's, every size against the source and every SHA-256 against
    the manifest.
    """
    reason = _private(dst)
    if reason is not None:
        return reason
    try:
        with open(os.path.join(dst, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"no readable manifest ({type(e).__name__})"
    files, source = _files(dst), _files(src)
    if set(files) != set(manifest) or set(files) != set(source):
        extra = sorted(set(files) - set(source))[:3]
        missing = sorted(set(source) - set(files))[:3]
        return f"its files differ from the source (extra {extra}, missing {missing})"
    for d, dirs, _ in os.walk(dst):
        for name in dirs:
            reason = _private(os.path.join(d, name))
            if reason is not None:
                return reason
    for rel, full in sorted(files.items()):
        reason = _private(full)
        if reason is not None:
            return reason
        size = os.path.getsize(full)
        if size != manifest[rel].get("size") or size != os.path.getsize(source[rel]):
            return f"{rel} has {size} bytes, the source {os.path.getsize(source[rel])}"
        if _sha256(full) != manifest[rel].get("sha256"):
            return f"{rel}: SHA-256 differs from the manifest"
    return None


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
