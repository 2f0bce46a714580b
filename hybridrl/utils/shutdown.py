"""SIGTERM runs the driver's cleanup.

Python's default for SIGTERM ends the process at once: no ``finally`` runs, so the tracker is
not closed and Ray actors, placement groups and vLLM engines of a local Ray are left to die with
their raylet (or linger on a cluster). ``sigterm_raises()`` turns SIGTERM into ``SystemExit(143)``
(128 + 15, what a shell reports for a SIGTERM'ed process) raised in the main thread, so every
``finally`` (tracker.finish, workers.shutdown) runs on the way out. A second SIGTERM during that
cleanup gets the default action, so a stuck cleanup can still be ended.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["sigterm_raises"]


def _on_sigterm(signum: int, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends a stuck cleanup
    print("[hybridrl] SIGTERM: stopping; closing the tracker and the workers", file=sys.stderr, flush=True)
    raise SystemExit(128 + signal.SIGTERM)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) in the main thread (no-op off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
