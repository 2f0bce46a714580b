"""Load a user's reward function from a Python file (`custom_reward_function.*` config keys).

    fn = load_custom_reward_fn("my_reward.py", "compute_score", {"format_bonus": 0.1})
    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)  # + format_bonus=0.1

The file is imported as a fresh module (it need not be on `sys.path`) and registered in
`sys.modules` under a private name, so dataclasses and pickling inside it work; cloudpickle is told
to send its functions by value, so pool workers and Ray tasks that cannot import the file still
receive them.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hybridrl.utils.import_utils import import_user_file

__all__ = ["load_custom_reward_fn"]


def _register_by_value(module: Any) -> None:
    """Let cloudpickle (standalone, and Ray's copy when Ray is loaded) pickle this module's functions by value."""
    picklers = []
    try:
        import cloudpickle

        picklers.append(cloudpickle)
    except ImportError:
        pass
    if "ray" in sys.modules:
        try:
            from ray import cloudpickle as ray_cloudpickle

            picklers.append(ray_cloudpickle)
        except ImportError:
            pass
    for pickler in picklers:
        register = getattr(pickler, "register_pickle_by_value", None)
        if register is not None:
            register(module)


def _callables(module: Any) -> list[str]:
    return sorted(
        name
        for name, value in vars(module).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", None) == module.__name__
    )


def load_custom_reward_fn(
    path: str | os.PathLike | None,
    name: str = "compute_score",
    reward_kwargs: Mapping[str, Any] | None = None,
) -> Callable | None:
    """Import `name` from the file `path` and bind `reward_kwargs` to it.

    Args:
        path: the .py file (`custom_reward_function.path`); None or "" returns None (no custom fn).
        name: the function's name in that file (`custom_reward_function.name`).
        reward_kwargs: keyword arguments bound with functools.partial
            (`custom_reward_function.reward_kwargs`).

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: importing the file failed (chained from the error inside it).
        AttributeError: the file has no `name` (the message lists its functions).
        TypeError: `name` is not callable, or does not accept one of `reward_kwargs`.
    """
    if not path:
        return None
    path = os.path.abspath(os.fspath(path))
    module = import_user_file(path, "custom_reward_function.path", prefix="hybridrl_custom_reward")
    if not hasattr(module, name):
        raise AttributeError(
            f"custom_reward_function.name={name!r} is not defined in {path}; callables defined there: "
            f"{_callables(module) or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"custom_reward_function.name={name!r} in {path} is a {type(fn).__name__}, not a function"
        )
    _register_by_value(module)
    kwargs = dict(reward_kwargs or {})
    if not kwargs:
        return fn
    try:
        inspect.signature(fn).bind_partial(**kwargs)
    except TypeError as e:
        raise TypeError(
            f"custom_reward_function.reward_kwargs {sorted(kwargs)} do not fit {name}{inspect.signature(fn)} "
            f"in {path}: {e}"
        ) from None
    except ValueError:  # no signature available (builtins): bind at call time
        pass
    wrapped = functools.partial(fn, **kwargs)
    functools.update_wrapper(wrapped, fn)
    return wrapped
