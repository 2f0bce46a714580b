"""No file of the repository reads as a development diary.

The repository speaks to its users: what the code does, how to run it, what was measured (with the
command, machine and date). How it was developed stays in git history, not in files: no work
periods, no internal tracker numbers (say what the thing is instead), no references to notes that
are not part of the repository. Every text file that git tracks (and every new file it does not
ignore) is checked, so files added later are covered too.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

# (pattern, what to write instead); matched case-insensitively
HISTORY_WORDS = [
    (r"\bsessions? \d+", "say what changed, not when it was done"),
    (r"\b(?:this|previous|earlier|next|last|other|development|work) sessions?\b", "say what the thing is"),
    (r"\bissues? #?\d+", "name the feature or the check, not a tracker number"),
    (r"\bwork periods?\b", "say what changed, not when it was done"),
    (r"\bsprints? \d+", "say what changed, not when it was done"),
    (r"\blab notes?\b", "move measurements to docs/benchmarks.md (command, machine, date)"),
    (r"\bother engineers\b", "say 'other jobs' (what loaded the machine)"),
    (r"\b(?:ai|coding) assistants?\b", "leave out who or what wrote it"),
    (r"\bhelper agents?\b", "leave out who or what wrote it"),
    (r"\bclaude\b", "leave out who or what wrote it"),
    (r"\bfarm-(?:studio|bench)\b", "leave out the tools the project was built with"),
    (r"\bissues (?:show|note|resolve)\b", "leave out the tools the project was built with"),
    (r"\bshared/(?:DESIGN|NOTES)|\bNOTES-cpu\b|\bDESIGN\.md\b", "cite a file of the repository (or none)"),
]
PATTERN = re.compile("|".join(f"(?:{p})" for p, _ in HISTORY_WORDS), re.IGNORECASE)


def repository_files() -> list[Path]:
    """Tracked files plus new files git does not ignore; every file under the root without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout.decode()  # fmt: skip
        files = [ROOT / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [f for f in files if f.is_file() and f.resolve() != THIS]


def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (images, ...)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits(text: str) -> list[tuple[int, str]]:
    """(line number, matched words) for every match of the word list."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in PATTERN.finditer(text)]


def advice(word: str) -> str:
    return next(fix for p, fix in HISTORY_WORDS if re.fullmatch(p, word, re.IGNORECASE))


@pytest.mark.parametrize(
    "text",
    [
        "measured in " + "session 17 on main",  # split so that repository-wide greps do not match here
        "Start-up validation (" + "issue 30): mistakes",
        "refused: multimodal data is Issue #24",
        "overlapped a test run of this session",
        "loaded by other engineers' jobs",
        "see shared/NOTES-cpu.md",
        "(DESIGN.md principle 10)",
        "notes from work period 3",
    ],
)
def test_the_word_list_catches_history(text):
    assert hits(text), text


@pytest.mark.parametrize(
    "text",
    [
        "an aiohttp ClientSession per session of the agent",
        "sticky sessions route a trajectory to one replica",
        '{"role": "assistant", "content": "4"}',
        "the issue tracker of vLLM",
        "Topic :: Scientific/Engineering",
    ],
)
def test_the_word_list_leaves_ordinary_words(text):
    assert not hits(text), hits(text)


def test_no_repository_file_reads_as_a_development_diary():
    files = repository_files()
    assert len(files) > 100 and any(f.name == "README.md" for f in files)
    bad = []
    for path in files:
        text = text_of(path)
        for line, word in hits(text) if text else []:
            bad.append(f"{path.relative_to(ROOT)}:{line}: {word!r}: {advice(word)}")
    assert not bad, "development history in the repository:\n" + "\n".join(bad)
