"""A name -> implementation map, one per plug point.

The trainer picks an advantage estimator, a policy loss, a KL estimator and a loss-aggregation
mode by the name written in the config. Each plug point owns one `Registry`; all entries of a
registry share one call signature, so callers never special-case a name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Names mapped to functions that share one signature.

    Args:
        kind: what the entries are, used in error messages (e.g. "advantage estimator").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding `fn` under `name`; a name can be registered only once."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                taken_by = getattr(self._entries[name], "__qualname__", repr(self._entries[name]))
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {taken_by}); "
                    "register yours under another name"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered under `name`; unknown names raise with the known ones listed."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
