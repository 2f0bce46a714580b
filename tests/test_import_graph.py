"""The import graph of hybridrl/: no cycles (function-level imports included), no private names across modules.

The graph is read from the source (ast), so it also sees the imports inside functions: a cycle
hidden behind a function-level import fails here just like a module-level one. Imports under
`if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
import re
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


# ----------------------------------------------------------------------------------------------
# the layer order
# ----------------------------------------------------------------------------------------------
# The packages of hybridrl/, top to bottom. A module may import its own package and the packages
# of the layers below its own, never one above (function-level imports count too). A package of
# hybridrl/ that is not listed here fails the test, so a new one is placed on purpose.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "hybridrl",
        "model_merger",
        "console",
    ),  # the package root, `python -m hybridrl.model_merger`, the console commands
    ("trainer",),  # the entry modules and the loops behind them
    ("async_rollout",),  # the asynchronous rollout manager (AReaL-style), over the workers
    ("workers",),  # the Ray worker classes that compose the packages below
    ("env",),  # environments (reset / step), their episode processes and their agent loop
    ("agent",),  # agent loops, interactions and their HTTP server
    ("tools",),  # tool classes, their loading and veRL's tool API
    ("reward",),  # reward managers, scorers, judges, reward models
    ("rollout",),  # rollout engines (hf, vllm, sglang)
    ("engine",),  # training engines (FSDP2, Megatron)
    ("weight_sync",),  # every weight movement from a training engine to a rollout engine
    ("models",),  # model / tokenizer loading, the built-in model, weight-name maps
    ("data",),  # datasets, samplers, tasks
    ("config",),  # the typed config dataclasses every layer above reads
    ("compat",),  # foreign config spellings translated to hybridrl's
    ("single_controller",),  # Worker, WorkerGroup, dispatch, meshes
    ("protocol",),  # DataProto
    ("algos",),  # pure tensor functions and their registries
    ("report",),  # plots of a run's metrics file (`python -m hybridrl.report`)
    ("utils",),  # helpers: config loading, io, devices, tracking, FLOPs, floors
    ("cpu", "sandbox"),  # CPU-only speed paths (torch only); the local code sandbox (stdlib only)
)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _rank() -> dict[str, int]:
    return {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def upward_imports(graph: dict[str, set[str]] | None = None) -> list[tuple[str, str]]:
    """Every (importer, imported) pair of hybridrl modules whose import runs up the LAYERS
    (`graph`: module -> the modules it imports; the tree's own by default)."""
    if graph is None:
        graph = {name: _edges(name, path) for name, path in MODULES.items()}
    rank = _rank()
    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if _package(name) != _package(target) and rank[_package(target)] < rank[_package(name)]
    )


def test_every_package_has_a_layer():
    rank = _rank()
    missing = sorted({_package(m) for m in MODULES} - set(rank))
    assert not missing, f"packages of hybridrl/ with no place in LAYERS: {missing}; add each to its layer"


def test_the_layer_check_flags_an_upward_import_and_only_that():
    rank = _rank()
    assert rank["trainer"] < rank["workers"] < rank["engine"] < rank["models"] < rank["utils"]
    graph = {
        "hybridrl.utils.torch_utils": {"hybridrl.workers.actor"},  # up: flagged
        "hybridrl.workers.actor": {"hybridrl.engine.base", "hybridrl.workers.critic"},  # down, same package
        "hybridrl.engine.base": {"hybridrl.models.hf"},  # down
    }
    assert upward_imports(graph) == [("hybridrl.utils.torch_utils", "hybridrl.workers.actor")]


def test_no_import_runs_up_the_layers():
    bad = [f"{a} imports {b} ({_package(a)} is below {_package(b)})" for a, b in upward_imports()]
    assert not bad, f"{len(bad)} imports run up the layers:\n" + "\n".join(bad)


def test_every_hybridrl_import_names_a_module_that_exists():
    """A moved module leaves no import of its old path behind (in the library, its tests, bench/ and
    recipes/): every `import hybridrl.x` / `from hybridrl.x import y` names a module or package of the
    tree, and `y` is a module, or a name the module defines or imports."""
    repo = ROOT.parent
    files = [
        p for d in ("hybridrl", "tests", "bench", "recipes", "scripts") for p in (repo / d).rglob("*.py")
    ]
    bad = []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names if a.name.startswith("hybridrl")]
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").startswith("hybridrl")
            ):
                targets = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in targets:
                if module not in MODULES:
                    bad.append(
                        f"{path.relative_to(repo)}:{node.lineno} imports {module}, which does not exist"
                    )
                elif name and name != "*" and f"{module}.{name}" not in MODULES:
                    source = MODULES[module].read_text()
                    if not re.search(rf"\b{re.escape(name)}\b", source):
                        bad.append(
                            f"{path.relative_to(repo)}:{node.lineno} imports {name} from {module}, which has no such name"
                        )
    assert not bad, "\n".join(bad)
