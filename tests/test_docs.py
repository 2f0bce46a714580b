"""The user-facing docs: the README's limits, the generated configuration reference, the site's nav."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def test_readme_is_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md: at most ~200 lines (move detail to docs/)"
    assert len(text) <= 12_000, f"README.md has {len(text)} characters, at most 12,000"
    long = [f"line {i}: {len(line)} characters" for i, line in outside_code(text) if len(line) > 200]
    assert not long, "README.md lines over 200 characters outside code blocks: " + ", ".join(long)


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(links) > 10
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_capability_table_says_its_status():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| capability | status | docs |") :].split("\n\n")[0].splitlines()[2:]
    assert len(table) >= 10
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3 and all(cells), row
        assert "tested on CPU" in cells[1] or "untested" in cells[1], f"status not stated: {row}"
        assert "](docs/" in cells[2], f"no doc link: {row}"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location(
        "gen_config_reference", ROOT / "scripts" / "gen_config_reference.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_config_reference_is_current(gen):
    committed = (DOCS / "reference" / "config.md").read_text()
    assert committed == gen.render(), (
        "docs/reference/config.md is stale: run python scripts/gen_config_reference.py"
    )


def test_the_config_reference_covers_every_key_of_every_entry_point(gen):
    page = (DOCS / "reference" / "config.md").read_text()
    entries = gen.entry_points()
    mains = sorted(p.stem for p in (ROOT / "hybridrl" / "trainer").glob("main_*.py"))
    assert sorted(m.rsplit(".", 1)[-1] for m, _, _ in entries) == mains
    for module, _, _ in entries:
        assert f"## {module.rsplit('.', 1)[-1]}\n" in page

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            value = gen.default_of(f)
            if dataclasses.is_dataclass(value):
                yield from leaves(type(value), f"{prefix}{f.name}.")
            elif not f.name.startswith("_"):
                yield f"{prefix}{f.name}"

    for _, schema, _ in entries:
        keys = list(leaves(schema))
        assert len(keys) > 3
        missing = [k for k in keys if f"| `{k}` |" not in page]
        assert not missing, f"{schema.__name__}: keys missing from the reference: {missing[:10]}"


def test_the_config_reference_reads_the_comments(gen):
    @dataclasses.dataclass
    class Toy:
        # the comment above
        a: int = 1
        b: str = "x"  # the trailing comment
        c: float = 0.5

    comments = gen.field_comments(Toy)
    assert comments == {"a": "the comment above", "b": "the trailing comment", "c": ""}


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert len(pages) > 15
    missing = [p for p in pages if f": {p}\n" not in nav]
    assert not missing, f"add these pages to mkdocs.yml's nav: {missing}"


def test_the_algorithms_page_lists_every_registered_name():
    from hybridrl import algos

    page = (DOCS / "algorithms.md").read_text()
    for registry in (algos.ADV_ESTIMATORS, algos.POLICY_LOSSES, algos.KL_ESTIMATORS, algos.LOSS_AGG_MODES):
        names = registry.names()
        assert names
        missing = [n for n in names if f"`{n}`" not in page]
        assert not missing, f"docs/algorithms.md does not list {missing}"
