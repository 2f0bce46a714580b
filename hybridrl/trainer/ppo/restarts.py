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

A node of the Ray cluster that leaves mid-step (``NodeLostError``, a ``WorkerDiedError`` naming the
node and every rank that was on it) is restarted the same way: the new attempt's resource pools
wait up to ``trainer.resources_timeout_s`` for the cluster to grant their slots again (the node
added back, or another one joining). When they are not granted the run stops with a
``ResourcesUnavailableError`` that names the lost node, the key and the newest checkpoint; the
attempt has removed its placement groups and killed its actors by then, so nothing is left running.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

from hybridrl.single_controller.ray.nodes import NodeLostError, ResourcesUnavailableError
from hybridrl.single_controller.worker_group import WorkerDiedError, WorkerHungError
from hybridrl.utils import checkpointing as ck
from hybridrl.utils.deadlines import check_max_restarts

__all__ = ["RESTARTABLE", "run_with_restarts"]

RESTARTABLE = (WorkerDiedError, WorkerHungError)


def run_with_restarts(
    config: Any,
    attempt: Callable[[Any], dict[str, float]],
    restartable: tuple[type[BaseException], ...] = RESTARTABLE,
) -> dict[str, float]:
    """``attempt(config)`` (build the trainer, fit, close); again after a dead or hung worker.

    Args:
        config: the run's config (not modified; each attempt gets a deep copy).
        attempt: runs one attempt on a config and returns the final metrics; it must tear down its
            workers when it raises (``fit_and_report`` does).
        restartable: the errors that start the workers again (an entry point may add its own, e.g.
            main_async's loss of every rollout worker).

    Returns:
        The metrics of the attempt that finished.
    """
    max_restarts = check_max_restarts(config.trainer.max_restarts)
    pristine = copy.deepcopy(config)
    restarts = 0
    current = config
    lost: NodeLostError | None = None  # the node loss that caused the restart under way
    while True:
        try:
            return attempt(current)
        except ResourcesUnavailableError as err:
            if lost is None:
                raise
            raise ResourcesUnavailableError(_not_back(lost, err, pristine)) from err
        except restartable as err:
            if restarts >= max_restarts:
                if max_restarts:
                    print(
                        f"[hybridrl] giving up after {restarts} restart(s) (trainer.max_restarts={max_restarts})",
                        file=sys.stderr,
                    )
                raise
            restarts += 1
            lost = err if isinstance(err, NodeLostError) else None
            print(
                f"[hybridrl] restart {restarts}/{max_restarts} (trainer.max_restarts): {_cause(err)}. The worker "
                "groups were torn down; starting them again and resuming from the latest checkpoint of "
                f"{pristine.trainer.default_local_dir}",
                file=sys.stderr,
                flush=True,
            )
            current = copy.deepcopy(pristine)
            current.trainer.resume_mode = "auto"


def _cause(err: BaseException) -> str:
    if not isinstance(err, (WorkerDiedError, WorkerHungError)):
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    where = f"{type(err).__name__} in group {err.group!r}, rank {err.rank}, method {err.method!r}"
    if isinstance(err, NodeLostError):
        ranks = "; ".join(f"group {g!r} ranks {r}" for g, r in err.lost.items())
        return f"{where}: node {err.node_id[:12]} ({err.node_ip}) left the cluster ({ranks})"
    return where


def _not_back(lost: NodeLostError, err: ResourcesUnavailableError, config: Any) -> str:
    root = config.trainer.default_local_dir
    step = ck.latest_pointer(root)
    newest = ck.step_dir(root, step) if step else "none"
    return (
        f"node {lost.node_id[:12]} ({lost.node_ip}) left the Ray cluster and the cluster did not grant the "
        f"workers' slots again within trainer.resources_timeout_s={config.trainer.resources_timeout_s:g} s, "
        f"so the run stops. Newest checkpoint: {newest}. Add the node back (or another with the same "
        f"resources) and run the same command to resume from it. {err}"
    )
