"""The import graph of hybridrl/: no cycles (function-level imports included), no private names across modules.

The graph is read from the source (ast), so it also sees the imports inside functions: a cycle
hidden behind a function-level import fails here just like a module-level one. Imports under
`if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hybridrl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported from, names imported, line) for every import of a hybridrl module in `path`."""
    out = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, [], child.lineno) for a in child.names if a.name.startswith("hybridrl"))
            elif isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:
                    base = name.split(".")[
                        : len(name.split(".")) - child.level + (path.name == "__init__.py")
                    ]
                    module = ".".join([*base, module] if module else base)
                if module.startswith("hybridrl"):
                    out.append((module, [a.name for a in child.names], child.lineno))
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _edges(name: str, path: Path) -> set[str]:
    """The hybridrl modules `name` imports. `from pkg import sub` counts as an edge to pkg.sub only."""
    targets = set()
    for module, names, _ in _imports(name, path):
        subs = [n for n in names if f"{module}.{n}" in MODULES]
        targets.update(f"{module}.{n}" for n in subs)
        if len(subs) < len(names) or not names:
            targets.add(module)
    return {t for t in targets if t in MODULES and t != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_finds_one_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_is_read_from_the_tree():
    assert len(MODULES) > 50
    graph = {name: _edges(name, path) for name, path in MODULES.items()}
    assert "hybridrl.trainer.ppo.config" in graph["hybridrl.trainer.main_ppo"]


def test_no_import_cycles():
    graph = {name: _edges(name, path) for name, path in MODULES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_imported_from_another_module():
    bad = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {n} from {module}"
        for name, path in sorted(MODULES.items())
        for module, names, line in _imports(name, path)
        for n in names
        if n.startswith("_") and not n.startswith("__") and module != name
    ]
    assert not bad, "; ".join(bad)
