"""Cost of a sandboxed run over a bare subprocess (hybridrl.sandbox).

N runs of a trivial program, alternating bare `subprocess.run` and `Sandbox.run` (A B A B, so
machine noise hits both alike), in a process that has torch loaded like a trainer. Two programs:
`/usr/bin/true` (the sandbox's own cost) and `python -I -c pass` (a typical code-reward run).
Prints median and mean milliseconds per run and the extra per run.

Run: python bench/sandbox_overhead.py [--runs 100] [--no-isolation]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _common import print_header

from hybridrl.sandbox import Sandbox, SandboxLimits


def _time(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--no-isolation", action="store_true")
    args = parser.parse_args()
    import torch  # noqa: F401 - the caller is a trainer-sized process

    box = Sandbox(SandboxLimits(), isolation=not args.no_isolation)
    print_header("sandbox overhead")
    print(f"isolation={not args.no_isolation}, {args.runs} runs each, alternating\n")
    print(
        "| program | bare median ms | sandbox median ms | extra median ms | bare mean | sandbox mean | extra mean |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, argv in (
        ("/usr/bin/true", ["/usr/bin/true"]),
        ("python -I -c pass", [sys.executable, "-I", "-c", "pass"]),
    ):
        box.run(argv)  # start the helper
        bare, boxed = [], []
        for _ in range(args.runs):
            bare.append(_time(subprocess.run, argv, capture_output=True))
            boxed.append(_time(box.run, argv))
        mb, ms = statistics.median(bare), statistics.median(boxed)
        ab, as_ = statistics.fmean(bare), statistics.fmean(boxed)
        print(f"| `{name}` | {mb:.1f} | {ms:.1f} | {ms - mb:+.1f} | {ab:.1f} | {as_:.1f} | {as_ - ab:+.1f} |")


if __name__ == "__main__":
    main()
