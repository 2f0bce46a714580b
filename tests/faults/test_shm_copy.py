"""`model.use_shm`: the shared-memory copy is checked (owner, size, hash) before each use.

Real copies of the built-in model folder under a real folder (in /dev/shm when it exists);
another user's files are made with a real `chown` (needs root; skipped otherwise).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import pytest

from hybridrl.models.builtin import get_builtin_model_path
from hybridrl.models.shm import MANIFEST, ShmCopyError, copy_to_shm, verify_copy

KEY = "actor_rollout_ref.model.use_shm"
NOBODY = 65534


@pytest.fixture
def shm_root():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix="hybridrl-test-shm-", dir=base)
    yield os.path.join(folder, "models")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def model(tmp_path):
    dst = tmp_path / "builtin_tiny"
    shutil.copytree(get_builtin_model_path(), dst)
    return str(dst)


def _same_tree(a: str, b: str) -> bool:
    names = sorted(n for n in os.listdir(b) if n != MANIFEST)
    return names == sorted(os.listdir(a)) and all(
        open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read() for n in names
    )


def test_a_good_copy_is_reused_and_matches_the_source(model, shm_root):
    first = copy_to_shm(model, KEY, shm_root)
    assert _same_tree(model, first) and verify_copy(first, model) is None
    assert oct(os.stat(shm_root).st_mode & 0o777) == "0o700"
    inode = os.stat(os.path.join(first, "model.safetensors")).st_ino
    assert copy_to_shm(model, KEY, shm_root) == first
    assert os.stat(os.path.join(first, "model.safetensors")).st_ino == inode  # not copied again


@pytest.mark.parametrize(
    "damage", ["same_size_other_bytes", "truncated", "extra_file", "group_writable", "symlink"]
)
def test_a_damaged_copy_is_detected_and_made_again(model, shm_root, damage, caplog):
    copy = copy_to_shm(model, KEY, shm_root)
    weights = os.path.join(copy, "model.safetensors")
    if damage == "same_size_other_bytes":
        with open(weights, "r+b") as f:
            f.seek(os.path.getsize(weights) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncated":
        os.truncate(weights, 100)
    elif damage == "extra_file":
        with open(os.path.join(copy, "evil.py"), "w") as f:
            f.write("import os\n")
    elif damage == "group_writable":
        os.chmod(weights, 0o666)
    else:
        os.unlink(weights)
        os.symlink(os.path.join(model, "model.safetensors"), weights)
    assert verify_copy(copy, model) is not None
    with caplog.at_level(logging.WARNING):
        again = copy_to_shm(model, KEY, shm_root)
    assert again == copy and verify_copy(again, model) is None and _same_tree(model, again)
    assert "cannot be used" in caplog.text and KEY in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_another_users_copy_or_folder_is_refused_naming_the_key(model, shm_root):
    copy = copy_to_shm(model, KEY, shm_root)
    os.chown(os.path.join(copy, "config.json"), NOBODY, NOBODY)
    assert "belongs to uid 65534" in verify_copy(copy, model)
    os.chown(copy, NOBODY, NOBODY)  # the whole copy is another user's: never used, never removed
    with pytest.raises(ShmCopyError, match=rf"{KEY}=True: .* belongs to another user"):
        copy_to_shm(model, KEY, shm_root)
    assert os.path.isdir(copy)
    os.chown(shm_root, NOBODY, NOBODY)  # and a root folder of another user
    with pytest.raises(ShmCopyError, match=rf"{KEY}=True: the shared-memory folder .* HYBRIDRL_SHM_DIR"):
        copy_to_shm(model, KEY, shm_root)
