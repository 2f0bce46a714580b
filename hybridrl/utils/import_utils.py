"""Import a user's Python file as a module (custom reward functions, custom dataset classes).

The file need not be on `sys.path`. It is imported as a fresh module registered in `sys.modules`
under a private name derived from its absolute path (so dataclasses and pickling inside it work,
and two files with the same name do not collide); a file that fails to import leaves nothing
behind in `sys.modules`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from types import ModuleType


def user_module_name(path: str, prefix: str = "hybridrl_user") -> str:
    """`{prefix}_{file stem}_{8 hex digits of the absolute path}` (a valid module name)."""
    path = os.path.abspath(os.fspath(path))
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return f"{prefix}_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def import_user_file(path: str | os.PathLike, key: str, prefix: str = "hybridrl_user") -> ModuleType:
    """Import the Python file `path`; `key` is the config key that named it (used in every message).

    Raises:
        FileNotFoundError: `path` is not a file.
        ImportError: it cannot be imported as a module, or importing it raised (chained).
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{key}={path!r} does not exist (or is not a file); point it at your .py file"
        )
    module_name = user_module_name(path, prefix)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}={path!r} cannot be imported as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing {key}={path!r} failed: {type(e).__name__}: {e}") from e
    return module
