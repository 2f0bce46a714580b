"""scripts/readme_numbers.py: its list of results is what README.md and docs/ quote (no learning run)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a learning claim in README.md: "31.5% -> 65%", "0% (steps 0, 5) -> 100%", "from 31.5% to 65%"
CLAIM = re.compile(r"\d+(?:\.\d+)?% (?:\([^)\n]*\) )?-> \d|from \d+(?:\.\d+)?% to \d")


@pytest.fixture(scope="module")
def rn():
    spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "scripts" / "readme_numbers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _quoted(part) -> dict:
    return {m: {s: v for s, v in q.items() if v is not None} for m, q in part.quoted.items()}


def test_every_part_quotes_what_its_files_say(rn, tmp_path):
    parts = rn.parts(tmp_path)
    assert len({p.name for p in parts}) == len(parts)
    for part in parts:
        found, _ = rn.cited(part, ROOT)
        want = {m: q for m, q in _quoted(part).items() if q}
        assert found == want, f"{part.name}: the files quote {found}, readme_numbers.py {want}"
        assert part.cites or not want, f"{part.name} quotes numbers but names no file that says them"


def test_every_learning_claim_of_the_readme_has_a_part(rn, tmp_path):
    text = (ROOT / "README.md").read_text()
    spans = [s for p in rn.parts(tmp_path) for s in rn.cited(p, ROOT)[1] if s[0] == "README.md"]
    claims = [m for m in CLAIM.finditer(text)]
    assert len(claims) >= 5, "the claim pattern no longer finds the README's results"
    orphans = [m.group(0) for m in claims if not any(a <= m.start() < b for _, a, b in spans)]
    assert not orphans, f"README.md quotes results no part of scripts/readme_numbers.py re-runs: {orphans}"


def test_a_changed_number_is_caught(rn, tmp_path):
    (tmp_path / "docs").mkdir()
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    gae = next(p for p in rn.parts(tmp_path) if p.name == "gae")
    # changed in one file only: the two files disagree
    (tmp_path / "README.md").write_text(readme.replace("peak 73%", "peak 71%"))
    (tmp_path / "docs" / "benchmarks.md").write_text(bench)
    with pytest.raises(
        ValueError, match="gae: docs/benchmarks.md quotes acc at peak as 0.73, another file as 0.71"
    ):
        rn.cited(gae, tmp_path)
    # changed in both: they agree with each other, not with what readme_numbers.py re-runs
    (tmp_path / "docs" / "benchmarks.md").write_text(bench.replace("peak 73%", "peak 71%"))
    assert rn.cited(gae, tmp_path)[0]["acc"]["peak"] == pytest.approx(0.71) != gae.quoted["acc"]["peak"]
    (tmp_path / "README.md").write_text("no numbers here")
    with pytest.raises(ValueError, match="gae: the quote pattern matches README.md 0 times"):
        rn.cited(gae, tmp_path)


def test_measured_steps(rn):
    rows = [{"step": s, "a": v} for s, v in [(0, 0.1), (5, 0.0), (10, 1.0), (15, 0.9), (20, 1.0)]]
    rows.append({"step": 25, "b": 3})
    assert rn.measured(rows, "a", 10) == 1.0 and rn.measured(rows, "a", 7) is None
    assert rn.measured(rows, "a", "peak") == 1.0 and rn.measured(rows, "a", "last") == 1.0
    assert rn.measured(rows, "a", "min10") == 0.9 and rn.measured(rows, "a", "min21") is None
    assert rn.parse_number("63.5%") == pytest.approx(0.635) and rn.parse_number("297") == 297


def test_compare_reads_the_metrics_and_the_warm_start(rn, tmp_path):
    agent = next(p for p in rn.parts(tmp_path) if p.name == "agent")
    logs = tmp_path / "agent" / "logs" / "main_ppo"
    logs.mkdir(parents=True)
    acc = rn.AGENT_ACC
    logs.joinpath("metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, acc: v}) for s, v in [(0, 0.0), (5, 0.0), (10, 0.99), (15, 1.0)])
    )
    (tmp_path / "agent" / "warm_start").mkdir()
    (tmp_path / "agent" / "warm_start" / "warm_start.json").write_text(json.dumps({"stop_step": 350}))
    table = {(k, s): (q, m) for _, k, s, q, m, _ in rn.compare(agent, tmp_path)}
    assert table[(acc, 10)] == (0.88, 0.99) and table[(acc, 15)] == (0.905, 1.0)
    assert table[("warm_start/stop_step", "last")] == (424, 350)


def test_list_and_only():
    run = lambda *a: subprocess.run(  # noqa: E731
        ["bash", str(ROOT / "scripts" / "readme_numbers.sh"), *a], capture_output=True, text=True, timeout=60
    )
    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    for name in ("quickstart", "gae", "sft", "async", "agent", "agent_server", "megatron", "tp", "vlm"):
        assert re.search(rf"^{name}\s", listed.stdout, re.M), name
    bad = run("--only", "sft,nope")
    assert bad.returncode != 0 and "unknown part(s) ['nope']" in bad.stderr and "quickstart" in bad.stderr


def test_agent_parts_read_the_metrics_where_their_recipe_writes_them(rn, tmp_path):
    # recipes/agent/run.sh logs to $AGENT_OUT/logs/<trainer>/, recipes/agent_server/run.sh to $AGENT_OUT/logs/
    for part in rn.parts(tmp_path):
        if "AGENT_OUT" not in part.env:
            continue
        logs = Path(part.env["AGENT_OUT"]) / "logs"
        if "recipes/agent/run.sh" in part.cmd:
            logs = logs / part.env.get("AGENT_TRAINER", "main_ppo")
        where = (tmp_path / part.name / part.metrics).resolve()
        assert where == (logs / "metrics.jsonl").resolve(), (
            f"{part.name} reads {where}, its recipe writes {logs}"
        )
