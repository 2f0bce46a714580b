"""How the driver answers SIGTERM and SIGUSR1: clean up, and (during training) save first.

Python's default for SIGTERM ends the process at once: no ``finally`` runs, so the tracker is
not closed and Ray actors, placement groups and vLLM engines of a local Ray are left to die with
their raylet (or linger on a cluster). ``sigterm_raises()`` turns SIGTERM into ``SystemExit(143)``
(128 + 15, what a shell reports for a SIGTERM'ed process) raised in the main thread, so every
``finally`` (tracker.finish, workers.shutdown) runs on the way out. A second SIGTERM during that
cleanup gets the default action, so a stuck cleanup can still be ended.

``preemption_saves(grace_s)`` is the training loop's version, for schedulers that announce the end
of a job: Slurm, Kubernetes and spot instances send SIGTERM and kill the job a grace period later;
Slurm's ``--signal=USR1@<s>`` sends SIGUSR1 ahead of the time limit. While a training loop has
called ``PREEMPTION.arm()``, either signal only records the request (``PREEMPTION.requested``): the
loop finishes or abandons its current step at the next consistent point, saves, and calls
``PREEMPTION.exit()`` (``SystemExit(128 + signal)``: 143 for SIGTERM, 138 for SIGUSR1). If that has
not happened ``grace_s`` seconds after the signal, an alarm raises the ``SystemExit`` anyway (a save
in progress is abandoned; it writes into a temporary folder, so the previous checkpoint stays the
newest one). Outside the armed loop (start-up, validation-only runs) or with ``grace_s=0`` the
signal exits at once, as ``sigterm_raises`` does. A second signal always exits at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["PREEMPTION", "Preemption", "preemption_saves", "sigterm_raises"]


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


class Preemption:
    """The driver's record of a preemption request (one per process: ``PREEMPTION``)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.grace_s = 0.0
        self.signum: int | None = None  # the signal received, once one was
        self.received_at: float | None = None  # time.monotonic() of it
        self._armed = False
        self._installed = False  # inside preemption_saves
        self._last_good: Callable[[], str | None] = lambda: None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def remaining_s(self) -> float:
        """Seconds left of the grace period (inf before a signal)."""
        if self.received_at is None:
            return float("inf")
        return self.grace_s - (time.monotonic() - self.received_at)

    def arm(self, last_good: Callable[[], str | None]) -> None:
        """From now on a signal asks the loop to save; ``last_good()`` names the newest checkpoint.

        The handlers are installed again: ``ray.init`` in the driver replaces the SIGTERM handler
        with Ray's own (which exits with status 1, saving nothing and skipping the cleanup).
        """
        self._armed = self.grace_s > 0
        self._last_good = last_good
        if self._installed and threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                signal.signal(s, self._on_signal)

    def disarm(self) -> None:
        self._armed = False

    def exit(self, saved: str | None) -> None:
        """Leave after the save: SystemExit(128 + signal), the cleanup runs on the way out."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        took = time.monotonic() - (self.received_at or time.monotonic())
        where = f"saved {saved}" if saved else f"newest checkpoint: {self._last_good() or 'none'}"
        print(
            f"[hybridrl] {self.name}: {where} {took:.1f} s after the signal (grace {self.grace_s:g} s); "
            "exiting. The same command resumes from it.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + int(self.signum or signal.SIGTERM))

    # ---------------------------------------------------------------- handlers
    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested or not self._armed:
            for s in self.SIGNALS:  # a further signal ends a stuck cleanup
                signal.signal(s, signal.SIG_DFL)
            why = (
                "a second signal"
                if self.requested
                else "no save on preemption: outside the training loop, a run that writes no checkpoints, "
                "or trainer.preemption_grace_s=0"
            )
            print(
                f"[hybridrl] {name}: stopping; closing the tracker and the workers ({why})",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)
        print(
            f"[hybridrl] {name}: ending the current step and saving a checkpoint within "
            f"trainer.preemption_grace_s={self.grace_s:g} s",
            file=sys.stderr,
            flush=True,
        )

    def _on_alarm(self, signum: int, frame) -> None:
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        print(
            f"[hybridrl] {self.name}: the grace period (trainer.preemption_grace_s={self.grace_s:g} s) ended "
            f"before the checkpoint was written; exiting without it. Newest checkpoint: "
            f"{self._last_good() or 'none'} (raise trainer.preemption_grace_s, or the scheduler's grace "
            "period, to save on preemption)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + int(self.signum or signal.SIGTERM))


PREEMPTION = Preemption()


@contextlib.contextmanager
def preemption_saves(grace_s: float) -> Iterator[Preemption]:
    """SIGTERM / SIGUSR1 handled by ``PREEMPTION`` within the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield PREEMPTION
        return
    PREEMPTION.__init__()
    PREEMPTION.grace_s = float(grace_s)
    previous = {s: signal.signal(s, PREEMPTION._on_signal) for s in Preemption.SIGNALS}
    previous_alarm = signal.signal(signal.SIGALRM, PREEMPTION._on_alarm)
    PREEMPTION._installed = True
    try:
        yield PREEMPTION
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.signal(signal.SIGALRM, previous_alarm)
        PREEMPTION.disarm()
        PREEMPTION._installed = False
        PREEMPTION.signum = PREEMPTION.received_at = None  # a later loop in this process starts afresh
