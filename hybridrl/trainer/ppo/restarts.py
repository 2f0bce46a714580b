"""`trainer.max_restarts`: start the workers again after a dead or hung worker and resume.

A worker whose process died (``WorkerDiedError``: killed, crashed, out of memory) or that made no
progress for ``trainer.step_timeout_s`` (``WorkerHungError``) ends ``fit()``. With
``trainer.max_restarts=N`` (default 0: the error ends the run, as before) the driver then, up to N
times: closes the tracker, tears down every worker group and its placement groups (the actors are
killed), builds the run again from the config as it was given (so the data order, the step count
and the run's checkpoint identity are the same), and resumes from the run's latest checkpoint
(``trainer.resume_mode=auto`` for the new attempt; without a checkpoint it starts at step 0). Each
restart is printed with its cause. Any other error (a bug, bad data, a reward function that raises)
is raised at once: starting again would only repeat it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerHungError
from hybridrl.utils.deadlines import check_max_restarts

__all__ = ["RESTARTABLE", "run_with_restarts"]

RESTARTABLE = (WorkerDiedError, WorkerHungError)


def run_with_restarts(config: Any, attempt: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """``attempt(config)`` (build the trainer, fit, close); again after a dead or hung worker.

    Args:
        config: the run's config (not modified; each attempt gets a deep copy).
        attempt: runs one attempt on a config and returns the final metrics; it must tear down its
            workers when it raises (``fit_and_report`` does).

    Returns:
        The metrics of the attempt that finished.
    """
    max_restarts = check_max_restarts(config.trainer.max_restarts)
    pristine = copy.deepcopy(config)
    restarts = 0
    current = config
    while True:
        try:
            return attempt(current)
        except RESTARTABLE as err:
            if restarts >= max_restarts:
                if max_restarts:
                    print(
                        f"[hybridrl] giving up after {restarts} restart(s) (trainer.max_restarts={max_restarts})",
                        file=sys.stderr,
                    )
                raise
            restarts += 1
            print(
                f"[hybridrl] restart {restarts}/{max_restarts} (trainer.max_restarts): {type(err).__name__} in "
                f"group {err.group!r}, rank {err.rank}, method {err.method!r}. The worker groups were torn down; "
                "starting them again and resuming from the latest checkpoint of "
                f"{pristine.trainer.default_local_dir}",
                file=sys.stderr,
                flush=True,
            )
            current = copy.deepcopy(pristine)
            current.trainer.resume_mode = "auto"
