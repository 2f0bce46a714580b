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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "DeadlineError",
    "call_with_deadline",
    "check_keys",
    "configure",
    "reward_timeout",
    "set_step_timeout",
    "step_timeout",
]

STEP_KEY = "trainer.step_timeout_s"
REWARD_KEY = "trainer.reward_timeout_s"
_DEFAULT_STEP_S = 3600.0
_settings = {"step": _DEFAULT_STEP_S, "reward": 600.0}


class DeadlineError(TimeoutError):
    """A call or wait passed its deadline. ``key`` is the config key that sets it."""

    def __init__(self, message: str, *, key: str, waited_s: float) -> None:
        super().__init__(message)
        self.key, self.waited_s = key, waited_s


def check_timeout(value: Any, key: str, *, allow_zero: bool) -> float:
    """``value`` as seconds, or ValueError naming ``key`` (must be > 0, or >= 0 with allow_zero)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0 (0: off)" if allow_zero else "> 0"
        raise ValueError(f"{key}={value!r} must be a number of seconds {bound}; e.g. {key}=600")
    return float(value)


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
