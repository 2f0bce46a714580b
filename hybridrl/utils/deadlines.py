"""Deadlines: no remote wait and no user callback of the driver waits forever.

Two settings of the run (set once on the driver by ``configure(config)``, read by every wait):

* ``trainer.step_timeout_s``: the longest a remote wait on workers may go without progress. In a
  worker group call (``gather_refs``) progress is a rank finishing; when no rank has finished for
  that long, the call fails with :class:`~hybridrl.single_controller.worker_group.WorkerHungError`
  naming the group, the first unfinished rank, the method and how long it waited. The same limit
  bounds a chunk of the async rollout manager and a reward loop worker.
* ``trainer.reward_timeout_s``: the longest one call of the reward manager (``naive``, ``batch``,
  ``dapo``, an importlib one) may take in the driver; 0 turns it off (then the call runs in the
  driver's own thread, as before, e.g. for a reward function that installs signal handlers).

A call with a deadline runs in a private daemon thread that nobody joins: after the deadline the
caller raises :class:`DeadlineError` and goes on; the thread is left to finish on its own (Python
cannot stop a thread), and never keeps the process from exiting.

Worker processes get both settings from the driver: a Ray worker group starts its actors with
``worker_env()`` (``HYBRIDRL_STEP_TIMEOUT_S`` / ``HYBRIDRL_REWARD_TIMEOUT_S``), read when this
module is imported there. A wait inside a worker on another group's result (a future handed to a
worker method) gets ``nested_timeout()``: ``NESTED_FRACTION`` of the step deadline, so that the
worker's error, which names the group and rank it waits on, arrives before the driver's own
deadline on the waiting worker fires.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DeadlineError",
    "call_with_deadline",
    "check_keys",
    "configure",
    "get_refs",
    "nested_timeout",
    "reward_timeout",
    "set_step_timeout",
    "step_timeout",
    "wait_refs",
    "worker_env",
]

STEP_KEY = "trainer.step_timeout_s"
RESOURCES_KEY = "trainer.resources_timeout_s"
REWARD_KEY = "trainer.reward_timeout_s"
_DEFAULT_STEP_S = 3600.0
STEP_ENV, REWARD_ENV = "HYBRIDRL_STEP_TIMEOUT_S", "HYBRIDRL_REWARD_TIMEOUT_S"
NESTED_FRACTION = 0.8


class DeadlineError(TimeoutError):
    """A call or wait passed its deadline. ``key`` is the config key that sets it."""

    def __init__(self, message: str, *, key: str, waited_s: float) -> None:
        super().__init__(message)
        self.key, self.waited_s = key, waited_s

    def __reduce__(self) -> tuple:  # picklable: raised in a worker, it travels to the driver
        return _rebuild_deadline_error, (str(self), self.key, self.waited_s)


def _rebuild_deadline_error(message: str, key: str, waited_s: float) -> DeadlineError:
    return DeadlineError(message, key=key, waited_s=waited_s)


def check_timeout(value: Any, key: str, *, allow_zero: bool) -> float:
    """``value`` as seconds, or ValueError naming ``key`` (must be > 0, or >= 0 with allow_zero)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0 (0: off)" if allow_zero else "> 0"
        raise ValueError(f"{key}={value!r} must be a number of seconds {bound}; e.g. {key}=600")
    return float(value)


def _from_env(name: str, default: float, *, allow_zero: bool) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return check_timeout(float(raw), name, allow_zero=allow_zero)
    except ValueError:
        raise ValueError(
            f"env var {name}={raw!r} must be a number of seconds; the worker group sets it from "
            f"{STEP_KEY if name == STEP_ENV else REWARD_KEY}, do not set it by hand"
        ) from None


# this process's settings: the driver's (configure), or in a worker the values its group passed
_settings = {
    "step": _from_env(STEP_ENV, _DEFAULT_STEP_S, allow_zero=False),
    "reward": _from_env(REWARD_ENV, 600.0, allow_zero=True),
}


def worker_env() -> dict[str, str]:
    """The env vars that hand this process's deadlines to a worker process it starts."""
    return {STEP_ENV: repr(_settings["step"]), REWARD_ENV: repr(_settings["reward"])}


def nested_timeout(step_s: float | None = None) -> float:
    """The deadline of a wait inside a worker on another group's result: NESTED_FRACTION of
    ``step_s`` (default: this process's ``trainer.step_timeout_s``)."""
    return NESTED_FRACTION * (step_timeout() if step_s is None else float(step_s))


def set_step_timeout(seconds: float) -> None:
    """Set ``trainer.step_timeout_s`` for this process (seconds > 0)."""
    _settings["step"] = check_timeout(seconds, STEP_KEY, allow_zero=False)


def step_timeout() -> float:
    """The current ``trainer.step_timeout_s`` (seconds)."""
    return _settings["step"]


def reward_timeout() -> float:
    """The current ``trainer.reward_timeout_s`` (seconds; 0: off)."""
    return _settings["reward"]


def check_max_restarts(value: Any) -> int:
    """``trainer.max_restarts`` as an int >= 0, or a ValueError naming the key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"trainer.max_restarts={value!r} must be an integer >= 0 (0: a dead or hung worker ends the run; "
            "N: start the workers again and resume from the last checkpoint up to N times)"
        )
    return value


def check_keys(trainer_config: Any) -> tuple[float, float]:
    """(step, reward) seconds of the ``trainer`` section (``max_restarts`` is checked too), or a
    ConfigError naming the key."""
    from hybridrl.utils.config_loader import ConfigError

    try:
        step = check_timeout(trainer_config.step_timeout_s, STEP_KEY, allow_zero=False)
        reward = check_timeout(trainer_config.reward_timeout_s, REWARD_KEY, allow_zero=True)
        check_max_restarts(getattr(trainer_config, "max_restarts", 0))
        check_timeout(getattr(trainer_config, "resources_timeout_s", 1.0), RESOURCES_KEY, allow_zero=False)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return step, reward


def configure(trainer_config: Any) -> None:
    """Validate and apply ``trainer.step_timeout_s`` and ``trainer.reward_timeout_s`` (this process)."""
    _settings["step"], _settings["reward"] = check_keys(trainer_config)


def call_with_deadline(
    fn: Callable[..., Any], *args: Any, timeout_s: float, key: str, what: str, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` in a private daemon thread; its value, or its exception re-raised.

    Args:
        fn: the callback (a reward manager, a tool's sync method, ...).
        timeout_s: deadline in seconds; <= 0 calls ``fn`` directly in this thread.
        key: the config key that sets the deadline (named in the error).
        what: the call, as the error names it (e.g. "reward manager naive").

    Raises:
        DeadlineError: ``fn`` did not return within ``timeout_s``; the thread is abandoned.
    """
    if timeout_s <= 0:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the caller
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name=f"hybridrl-deadline:{what}"[:60], daemon=True).start()
    if not done.wait(timeout_s):
        raise DeadlineError(
            f"{what} did not return within {timeout_s:g} s ({key}={timeout_s:g}); it is left running in "
            f"the background. Fix what it waits on, or raise {key}.",
            key=key,
            waited_s=timeout_s,
        )
    if "error" in box:
        err = box["error"]
        if isinstance(err, ValueError) and "main thread" in str(err):
            raise RuntimeError(
                f"{what} needs the main thread ({err}); it runs in a thread to enforce {key}: set {key}=0 "
                "to run it in the driver's thread (without a deadline)"
            ) from err
        raise err
    return box.get("value")


def wait_refs(refs: Sequence[Any], *, what: str, timeout_s: float | None = None, key: str = STEP_KEY) -> None:
    """Wait until every Ray object of ``refs`` exists (not fetched), or raise DeadlineError.

    Args:
        refs: Ray ObjectRefs.
        what: the wait, as the error names it (e.g. "rollout worker 1 abort_generation: the weights").
        timeout_s: seconds; default ``nested_timeout()`` (a wait inside a worker).
        key: the config key that sets the deadline.
    """
    import ray

    refs = list(refs)
    if not refs:
        return
    limit = nested_timeout() if timeout_s is None else float(timeout_s)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=limit, fetch_local=False)
    if pending:
        raise _wait_error(what, len(pending), len(refs), limit, key, nested=timeout_s is None)


def get_refs(refs: Any, *, what: str, timeout_s: float | None = None, key: str = STEP_KEY) -> Any:
    """``ray.get(refs)`` that raises DeadlineError naming ``what`` and ``key`` after ``timeout_s``
    (default ``nested_timeout()``) instead of waiting forever. ``refs``: one ObjectRef or a list."""
    import ray
    from ray.exceptions import GetTimeoutError

    limit = nested_timeout() if timeout_s is None else float(timeout_s)
    try:
        return ray.get(refs, timeout=limit)
    except GetTimeoutError:
        n = len(refs) if isinstance(refs, (list, tuple)) else 1
        raise _wait_error(what, None, n, limit, key, nested=timeout_s is None) from None


def _wait_error(
    what: str, pending: int | None, total: int, limit: float, key: str, *, nested: bool
) -> DeadlineError:
    missing = f"{pending} of {total}" if pending is not None else f"some of {total}"
    setting = (
        f"{key}={step_timeout():g}; a wait inside a worker gets {NESTED_FRACTION:g} of it"
        if nested
        else f"{key}={limit:g}"
    )
    return DeadlineError(
        f"{what}: {missing} Ray object(s) did not exist within {limit:g} s ({setting}). Find the task that "
        f"should produce them (a hung or dead worker), or raise {key}.",
        key=key,
        waited_s=limit,
    )


class RewardWithDeadline:
    """A reward manager whose every call has the deadline ``trainer.reward_timeout_s``.

    ``reward(data, return_dict=...)`` runs the wrapped manager through :func:`call_with_deadline`;
    every other attribute is the manager's own, read and written (the reward loop sets
    ``reward_kwargs`` to hand a GenRM client to the manager).
    """

    def __init__(self, inner: Callable[..., Any]) -> None:
        object.__setattr__(self, "_inner", inner)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner
        name = getattr(inner, "name", "") or type(inner).__name__
        fn = getattr(inner, "compute_score", None)
        what = f"reward manager {name!r}" + (f" ({getattr(fn, '__name__', fn)})" if fn is not None else "")
        return call_with_deadline(
            inner, *args, timeout_s=reward_timeout(), key=REWARD_KEY, what=what, **kwargs
        )

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # during unpickling, before __init__ state is set
            raise AttributeError(name)
        return getattr(self._inner, name)
