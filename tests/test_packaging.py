"""The package as the Python ecosystem sees it: metadata, license, version, console commands, and
requirements that admit the newest vLLM and SGLang releases."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import hybridrl
from hybridrl.console import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
RECORDED = ROOT / "tests" / "data" / "index_requirements.json"
# the machine the GPU extras are for: Linux x86_64, this Python
ENV = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def requirements(extra: str | None = None) -> list[Requirement]:
    """hybridrl's base requirements (requirements.txt), plus one extra's."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    reqs = [Requirement(x.split("#")[0]) for x in lines if x.split("#")[0].strip()]
    return reqs + [Requirement(r) for r in PROJECT["optional-dependencies"].get(extra, [])]


def candidates(*specs: SpecifierSet) -> list[Version]:
    """Versions named in the specifiers, and just above/below each: where an intersection, if
    any, has a member (the bounds of a range, or the one version of `==`)."""
    out = set()
    for spec in specs:
        for s in spec:
            v = Version(s.version.replace(".*", ".0"))
            base = list(v.release) + [0] * (3 - len(v.release))
            out |= {
                v,
                Version(".".join(map(str, [*base[:2], base[2] + 1]))),
                Version(f"{base[0]}.{base[1] + 1}.0"),
            }
            if base[2] > 0:
                out.add(Version(".".join(map(str, [*base[:2], base[2] - 1]))))
    return sorted(out)


def admits(ours: SpecifierSet, theirs: SpecifierSet) -> bool:
    """Whether some release could satisfy both specifier sets."""
    if not str(ours) or not str(theirs):
        return True
    return any(
        ours.contains(v, prereleases=True) and theirs.contains(v, prereleases=True)
        for v in candidates(ours, theirs)
    )


def conflicts(package: str, release: dict, extra: str) -> list[str]:
    """The requirements of `package` (at `release`) that hybridrl[extra]'s requirements exclude."""
    ours = {canonicalize_name(r.name): r for r in requirements(extra)}
    bad = []
    own = ours.get(canonicalize_name(package))
    if own is None or not own.specifier.contains(release["version"], prereleases=True):
        bad.append(f"hybridrl[{extra}] requires {own}, which excludes {package} {release['version']}")
    for text in release["requires_dist"]:
        theirs = Requirement(text)
        if theirs.marker is not None and not theirs.marker.evaluate(ENV):
            continue
        mine = ours.get(canonicalize_name(theirs.name))
        if mine is not None and not admits(mine.specifier, theirs.specifier):
            bad.append(f"{package} {release['version']} requires {theirs}; hybridrl[{extra}] requires {mine}")
    return bad


def test_the_intersection_check_can_fail():
    assert admits(SpecifierSet(">=2.13.0"), SpecifierSet("==2.14.0"))
    assert admits(SpecifierSet(">=5.19.0"), SpecifierSet("<5.23.0,>=5.16.1"))
    assert not admits(SpecifierSet("==2.13.0"), SpecifierSet("==2.14.0"))
    assert not admits(SpecifierSet("<5.20"), SpecifierSet(">=5.20.0"))
    assert not admits(SpecifierSet(">=0.23.3"), SpecifierSet("==0.23.2"))
    old = {"version": "0.34.0", "requires_dist": ["torch==2.14.0", "transformers<5.23.0,>=5.16.1"]}
    assert conflicts("vllm", old, "vllm") == []
    pinned = {"version": "0.34.0", "requires_dist": ["torch==2.12.0", 'numpy<1; extra == "x"']}
    assert conflicts("vllm", pinned, "vllm") == [
        f"vllm 0.34.0 requires torch==2.12.0; hybridrl[vllm] requires {requirements()[0]}"
    ]


@pytest.mark.parametrize("package", ["vllm", "sglang"])
def test_requirements_admit_the_newest_release_recorded(package):
    """tests/data/index_requirements.json: the newest release's requirements, recorded from the
    index with `python scripts/index_requirements.py`."""
    release = json.loads(RECORDED.read_text())[package]
    assert Version(release["version"]) >= Version({"vllm": "0.34.0", "sglang": "0.5.23"}[package])
    assert any(Requirement(r).name == "torch" for r in release["requires_dist"])
    assert conflicts(package, release, package) == []


@pytest.mark.slow  # asks the package index: ~15-30 s each
@pytest.mark.parametrize("package", ["vllm", "sglang"])
def test_requirements_admit_the_newest_release_on_the_index(package):
    """The same check against what the package index says today (pip reads the wheel's metadata;
    nothing is downloaded or installed). Skips when the index cannot be reached."""
    spec = importlib.util.spec_from_file_location(
        "index_requirements", ROOT / "scripts" / "index_requirements.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        release = script.newest_requirements(package, timeout=60)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the package index cannot be reached: {str(e)[:200]}")
    assert conflicts(package, release, package) == []


def test_no_requirement_pins_torch():
    """The CPU pin of torch belongs to the README's install command, not to the library."""
    pins = [str(r) for r in requirements() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pins == []
    for extra, reqs in PROJECT["optional-dependencies"].items():
        assert not [r for r in reqs if Requirement(r).name == "torch"], extra
    assert "pip install torch==2.13.0 && pip install -e" in (ROOT / "README.md").read_text()


def test_metadata_lives_in_pyproject():
    assert not (ROOT / "setup.py").exists()
    assert PROJECT["name"] == "hybridrl" and PROJECT["license"] == "Apache-2.0"
    assert set(PROJECT["dynamic"]) == {"version", "dependencies"}
    dyn = PYPROJECT["tool"]["setuptools"]["dynamic"]
    assert dyn["version"] == {"attr": "hybridrl.__version__"}
    assert dyn["dependencies"] == {"file": ["requirements.txt"]}
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["hybridrl"]
    assert {"py.typed", "trainer/config/*.yaml", "models/assets/**/*"} <= set(data)
    assert (ROOT / "hybridrl" / "py.typed").exists()
    assert list((ROOT / "hybridrl" / "trainer" / "config").glob("*.yaml"))
    assert "test" in PROJECT["optional-dependencies"] and "docs" in PROJECT["optional-dependencies"]


def test_license_file_matches_the_declared_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


def test_version_and_changelog_agree():
    assert re.fullmatch(r"\d+\.\d+\.\d+", hybridrl.__version__)
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M
    )
    assert releases and releases[0] == hybridrl.__version__
    assert releases[-1] == "0.1.0"


def test_every_entry_module_has_a_console_command():
    scripts = PROJECT["scripts"]
    assert set(scripts) == set(COMMANDS)
    for name, target in scripts.items():
        module, func = target.split(":")
        assert module == "hybridrl.console" and callable(getattr(sys.modules[module], func)), name
    mains = {f"hybridrl.trainer.{p.stem}" for p in (ROOT / "hybridrl" / "trainer").glob("main_*.py")}
    missing = mains - set(COMMANDS.values())
    assert not missing, f"add a console command for {sorted(missing)} (hybridrl/console.py, pyproject.toml)"


HELP_ALL = """
import contextlib, io, sys, tomllib
from importlib import import_module
scripts = tomllib.load(open("pyproject.toml", "rb"))["project"]["scripts"]
for name, target in scripts.items():
    module, func = target.split(":")
    sys.argv = [name, "--help"]
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            code = getattr(import_module(module), func)()
        except SystemExit as e:
            code = e.code
    print(f"== {name} exit={code or 0} lines={len(out.getvalue().splitlines())}")
    print(out.getvalue()[:300])
"""


def test_every_console_command_prints_its_help():
    """Each command's function, called as the installed script calls it, with `--help` (one Python
    process for all of them: they share the imports)."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name, module in COMMANDS.items():
        m = re.search(rf"^== {name} exit=(\S+) lines=(\d+)\n(.*?)(?=^== |\Z)", done.stdout, re.M | re.S)
        assert m, f"{name}: no output\n{done.stdout[-2000:]}"
        assert m.group(1) == "0" and int(m.group(2)) >= 5, m.group(0)
        short = module.rsplit(".", 1)[-1]
        assert short in m.group(3) or "usage:" in m.group(3), m.group(0)
