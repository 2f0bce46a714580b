"""Record what the newest vLLM and SGLang releases require, for tests/test_packaging.py.

    python scripts/index_requirements.py            # rewrite tests/data/index_requirements.json
    python scripts/index_requirements.py --print    # print them, write nothing

Asks the package index through pip (`pip install --dry-run --no-deps --report`), which reads the
release's wheel metadata without downloading the wheel; nothing is installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ("vllm", "sglang")
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "index_requirements.json"


def newest_requirements(name: str, timeout: float = 120) -> dict:
    """{"version": ..., "requires_dist": [...]} of the newest release of `name` on the index.

    Raises:
        RuntimeError: pip could not reach the index or found no release.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
               "--quiet", "--report", str(report), name]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"pip could not resolve {name}: {done.stderr.strip()[-500:]}")
        meta = json.loads(report.read_text())["install"][0]["metadata"]
    return {"version": meta["version"], "requires_dist": meta.get("requires_dist", [])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--print", action="store_true", help="print, do not write")
    args = ap.parse_args()
    found = {name: newest_requirements(name) for name in PACKAGES}
    text = json.dumps(found, indent=1, sort_keys=True) + "\n"
    if args.print:
        print(text)
    else:
        OUT.write_text(text)
        print(f"wrote {OUT}: " + ", ".join(f"{n} {v['version']}" for n, v in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
