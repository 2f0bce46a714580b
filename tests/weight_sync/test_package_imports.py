"""hybridrl/weight_sync sits below the worker classes and the trainers: it imports none of
workers/, trainer/ or async_rollout/ (function-level imports included), nor the engine and rollout
packages it drives through their interfaces (the rollout engines may use its bucketing)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hybridrl" / "weight_sync"
ABOVE = (
    "hybridrl.workers",
    "hybridrl.trainer",
    "hybridrl.async_rollout",
    "hybridrl.engine",
    "hybridrl.rollout",
)


def _imported(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, node.lineno))
    return out


def test_weight_sync_imports_nothing_above_it():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 8
    bad = [
        f"{path.name}:{line} imports {module}"
        for path in files
        for module, line in _imported(path)
        if any(module == p or module.startswith(p + ".") for p in ABOVE)
    ]
    assert not bad, bad
