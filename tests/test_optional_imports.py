"""Tests import optional packages only behind a skip, so the README's test command passes as written.

The README's test command installs hybridrl with its requirements and the `test` extra, nothing
else. A test file that imports vLLM, Megatron, MLflow, TensorBoard, ... unguarded breaks the
collection of that module there (module level) or fails the test (inside a function). The rule,
read from the source of every tests/**/*.py (ast):

- a module outside the standard library, the tests' own modules and what `requirements.txt` plus
  the `test` extra install (their distributions and everything those require, read from the
  installed metadata) is imported only after a `pytest.importorskip` of it, at module level or
  earlier in the same function (or inside a `try` that catches ImportError);
- a custom `reason=` of `pytest.importorskip` says "not installed": `.ci/run` reads the skip
  reasons of its first stage ("could not import ..." or "... not installed") to pick the tests its
  second stage, with every extra installed, runs.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SKIP_REASON_WORDS = "not installed"
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_requirements() -> list[str]:
    """The requirement strings of the README's install: requirements.txt + pyproject's `test` extra."""
    import tomllib

    lines = (ROOT / "requirements.txt").read_text().splitlines()
    reqs = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "test" in extras, "pyproject.toml defines no 'test' extra"
    return reqs + list(extras["test"])


def provided_modules(requirements: Iterable[str]) -> set[str]:
    """Top-level import names of the distributions `requirements` install, transitively.

    Read from the installed metadata (each distribution's `Requires-Dist`, markers evaluated for
    this interpreter and the requested extras), so a package that another extra brought into this
    environment does not count.
    """
    top: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            top.setdefault(_canon(dist), set()).add(module)
    modules: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [(Requirement(r), True) for r in requirements]
    while stack:
        req, direct = stack.pop()
        key = (_canon(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            if direct:
                raise AssertionError(f"{req.name} is not installed: pip install -e '.[test]'") from None
            continue
        modules |= top.get(key[0], set())
        for spec in dist.requires or []:
            sub = Requirement(spec)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                stack.append((sub, False))
    return modules


def local_modules() -> set[str]:
    """Names the tests import from their own tree: `tests`, helper modules beside them, packages."""
    names = {"tests", "hybridrl"} | {p.stem for p in TESTS.rglob("*.py") if p.stem != "__init__"}
    return names | {p.parent.name for p in TESTS.rglob("__init__.py")}


def _importorskip_target(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "importorskip") or (
        isinstance(func, ast.Name) and func.id == "importorskip"
    )
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _guarded(module: str, guards: set[str]) -> bool:
    return any(module == g or module.startswith(g + ".") or g.startswith(module + ".") for g in guards)


def _imported(stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [a.name for a in stmt.names]
    return [] if stmt.level or not stmt.module else [stmt.module]


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        if handler.type is None:
            return True
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(getattr(t, "id", None) in _IMPORT_ERRORS for t in types):
            return True
    return False


def _simple_guards(stmt: ast.stmt) -> set[str]:
    """importorskip targets in a simple statement (`x = pytest.importorskip("x")`, a bare call)."""
    if isinstance(stmt, ast.Expr | ast.Assign | ast.AnnAssign):
        return {t for n in ast.walk(stmt) if (t := _importorskip_target(n))}
    return set()


def _module_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements that run on import: into if/try/with/for/class bodies, not into functions."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for part in _blocks(stmt):
            yield from _module_level(part)


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [
        getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)
    ]
    return blocks + [h.body for h in getattr(stmt, "handlers", [])]


def _scan(body, guards, base, scope, optional, out, tolerated=False):
    """Walk `body` in execution order, adding importorskip targets to `guards` as they come.

    `base` holds the module-level skips, which guard every function body wherever they stand.
    """
    for stmt in body:
        guards |= _simple_guards(stmt)
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            for module in _imported(stmt):
                if optional(module) and not tolerated and not _guarded(module, guards):
                    out.append((stmt.lineno, module, scope))
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            _scan(stmt.body, guards | base, base, f"in {stmt.name}()", optional, out)
        elif isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            continue
        elif isinstance(stmt, ast.Try):
            _scan(stmt.body, guards, base, scope, optional, out, tolerated or _catches_import_error(stmt))
            for part in _blocks(stmt)[1:]:
                _scan(part, guards, base, scope, optional, out, tolerated)
        else:
            for part in _blocks(stmt):
                _scan(part, guards, base, scope, optional, out, tolerated)


def unguarded_imports(source: str, optional: Callable[[str], bool]) -> list[tuple[int, str, str]]:
    """(line, module, where) for each import of an optional module in `source` with no skip before it.

    Args:
        source: the text of a test module.
        optional: whether a dotted module name is optional (not in the README's install).
    """
    tree = ast.parse(source)
    # A module-level skip anywhere skips the whole module, so it guards every function body; at
    # module level itself only the skips above an import guard it.
    base = {g for stmt in _module_level(tree.body) for g in _simple_guards(stmt)}
    out: list[tuple[int, str, str]] = []
    _scan(tree.body, set(), base, "at module level", optional, out)
    return sorted(out)


def skip_reasons_off_pattern(source: str) -> list[tuple[int, str]]:
    """(line, reason) for each `importorskip(..., reason=...)` whose reason CI would not recognise."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if _importorskip_target(node):
            for kw in node.keywords:
                if kw.arg == "reason" and not (
                    isinstance(kw.value, ast.Constant) and SKIP_REASON_WORDS in str(kw.value.value)
                ):
                    bad.append((node.lineno, ast.unparse(kw.value)))
    return bad


@functools.cache
def optional_predicate() -> Callable[[str], bool]:
    """Whether a dotted module name is outside the README's install (stdlib and tests' own modules are in)."""
    allowed = provided_modules(base_requirements()) | local_modules() | set(sys.stdlib_module_names)
    return lambda module: module.split(".")[0] not in allowed


def _toy_optional(module: str) -> bool:
    return module.split(".")[0] in {"vllm", "megatron", "tensorboard"}


# ----------------------------------------------------------------------------------------------
# the checker itself
# ----------------------------------------------------------------------------------------------
def test_checker_flags_unguarded_module_level_and_function_imports():
    src = (
        "import os\nimport vllm\nfrom megatron.core import parallel_state\n"
        "def test_a():\n    from tensorboard.backend import x\n"
        "class TestB:\n    def test_b(self):\n        import vllm.inputs\n"
    )
    assert unguarded_imports(src, _toy_optional) == [
        (2, "vllm", "at module level"),
        (3, "megatron.core", "at module level"),
        (5, "tensorboard.backend", "in test_a()"),
        (8, "vllm.inputs", "in test_b()"),
    ]


def test_checker_accepts_imports_behind_a_skip():
    src = (
        "import pytest\nvllm = pytest.importorskip('vllm', reason='vllm is not installed')\n"
        "from vllm import SamplingParams\n"
        "pytest.importorskip('megatron.core')\nfrom megatron.core import parallel_state\n"
        "def test_a():\n    pytest.importorskip('tensorboard')\n    from tensorboard import x\n"
        "try:\n    import tensorboard\nexcept ImportError:\n    tensorboard = None\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tensorboard\n"
    )
    assert unguarded_imports(src, _toy_optional) == []


def test_checker_keeps_execution_order():
    # the skip comes after the import at module level, or after the import inside the function
    src = (
        "import vllm\nimport pytest\npytest.importorskip('vllm')\n"
        "def test_a():\n    import tensorboard\n    pytest.importorskip('tensorboard')\n"
    )
    assert unguarded_imports(src, _toy_optional) == [
        (1, "vllm", "at module level"),
        (5, "tensorboard", "in test_a()"),
    ]
    # ...but a module-level skip below a function still guards that function's body
    src = "import pytest\ndef test_a():\n    import vllm\npytest.importorskip('vllm')\n"
    assert unguarded_imports(src, _toy_optional) == []


def test_checker_flags_a_skip_reason_ci_would_miss():
    src = "import pytest\npytest.importorskip('vllm', reason='needs vLLM')\npytest.importorskip('x')\n"
    assert skip_reasons_off_pattern(src) == [(2, "'needs vLLM'")]


def test_the_base_install_is_read_from_the_metadata():
    provided = provided_modules(base_requirements())
    # requirements.txt, the test extra, and what they pull in (tensordict requires cloudpickle)
    assert {"torch", "ray", "transformers", "hydra", "pytest", "cloudpickle", "packaging"} <= provided
    # the optional extras are not part of it, whether this environment has them or not
    assert not provided & {"vllm", "megatron", "mlflow", "tensorboard", "wandb", "sglang", "math_verify"}
    optional = optional_predicate()
    assert optional("vllm.inputs") and optional("tensorboard") and not optional("json")
    assert not optional("fsdp_testkit") and not optional("tests.e2e.ppo_runs")


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------
def test_no_test_imports_an_optional_package_without_a_skip():
    optional = optional_predicate()
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module} {where}: add pytest.importorskip({module.split('.')[0]!r}) before it"
        for path in files
        for line, module, where in unguarded_imports(path.read_text(), optional)
    ]
    assert not bad, "\n".join(bad)


def test_every_custom_skip_reason_says_not_installed():
    bad = [
        f"{path.relative_to(ROOT)}:{line} reason={reason}: say '{SKIP_REASON_WORDS}' (CI reads it)"
        for path in sorted(TESTS.rglob("*.py"))
        for line, reason in skip_reasons_off_pattern(path.read_text())
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["vllm", "megatron.core", "tensorboard", "mlflow"])
def test_optional_packages_are_optional(module):
    """Each package the README's second command adds is outside the base install."""
    assert optional_predicate()(module)
