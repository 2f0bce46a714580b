"""Colocated workers: several roles (actor/rollout, critic, reward model, ...) in ONE process.

``create_colocated_worker_cls({"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, cfg),
"critic": RayClassWithInitArgs(CriticWorker, cfg)})`` builds one Worker class whose actor
constructs every role object and exposes each role's methods under ``<role>_<method>``
(``actor_rollout_compute_log_prob``, ``critic_compute_values``), keeping their @register
records. One RayWorkerGroup of it places all roles on the same slots; ``wg.spawn(roles)`` gives
per-role views whose methods drop the prefix again.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from hybridrl.single_controller.base import Worker, get_register_spec
from hybridrl.single_controller.ray.base import RayClassWithInitArgs

__all__ = ["ColocatedWorker", "create_colocated_worker_cls"]


class ColocatedWorker(Worker):
    """Base of generated colocated classes: builds one object per role in this process."""

    _hybridrl_role_classes: dict[str, type] = {}

    def __init__(self, role_init: dict[str, tuple[type, tuple, dict[str, Any]]]) -> None:
        super().__init__()
        self._hybridrl_roles: dict[str, Worker] = {}
        for role, (cls, args, kwargs) in role_init.items():
            self._hybridrl_roles[role] = cls(*args, **kwargs)

    def _hybridrl_mesh_info(self, name: str, role: str | None = None) -> Any:
        """Mesh coordinates as the role's object declared them (the process's own without role)."""
        if role is None:
            return super()._hybridrl_mesh_info(name)
        return self._hybridrl_roles[role]._hybridrl_mesh_info(name)

    def close(self) -> None:
        """Close every role's object (see `Worker.close`)."""
        for worker in self._hybridrl_roles.values():
            worker.close()

    def get_role(self, role: str) -> Worker:
        """The object of one role inside this process."""
        return self._hybridrl_roles[role]


def _public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """Public functions of ``cls`` (inherited too), excluding Worker's own members."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") or hasattr(Worker, name):
            continue
        attr = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(attr):
            out[name] = attr
    return out


def _forwarder(role: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: ColocatedWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._hybridrl_roles[role], name)(*args, **kwargs)

    functools.update_wrapper(forward, fn)  # keeps the @register record, signature, docstring
    forward.__name__ = forward.__qualname__ = f"{role}_{name}"
    try:  # drop the `_ray_trace_ctx` keyword Ray's tracing hook may have added to `fn` already
        sig = inspect.signature(fn)
        forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=[p for p in sig.parameters.values() if p.name != "_ray_trace_ctx"]
        )
    except (TypeError, ValueError):
        pass
    return forward


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One actor class running every role of ``class_dict`` in the same process.

    Args:
        class_dict: role prefix -> worker class with its init args, e.g.
            ``{"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg)}``.

    Returns:
        RayClassWithInitArgs of the generated class; give it to one RayWorkerGroup and call
        ``wg.spawn(class_dict.keys())`` for per-role views. The actor options of the roles
        (``update_options``) are merged.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_cls: class_dict is empty; give at least one role")
    attrs: dict[str, Any] = {}
    role_classes: dict[str, type] = {}
    role_init: dict[str, tuple[type, tuple, dict[str, Any]]] = {}
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or role.startswith("_"):
            raise ValueError(f"role name {role!r} must be a public identifier such as 'actor_rollout'")
        if not isinstance(spec, RayClassWithInitArgs):
            raise TypeError(f"class_dict[{role!r}] must be a RayClassWithInitArgs, got {type(spec).__name__}")
        role_classes[role] = spec.cls
        role_init[role] = (spec.cls, spec.args, spec.kwargs)
        for name, fn in _public_methods(spec.cls).items():
            prefixed = f"{role}_{name}"
            if prefixed in attrs or hasattr(ColocatedWorker, prefixed):
                raise ValueError(
                    f"colocated method name clash: {prefixed!r} comes from two roles; rename a role or a method"
                )
            attrs[prefixed] = _forwarder(role, name, fn)
    attrs["_hybridrl_role_classes"] = role_classes
    groups = {}  # the roles' Ray concurrency groups (a forwarded method keeps its group)
    for cls in role_classes.values():
        groups.update(getattr(cls, "ray_concurrency_groups", None) or {})
    if groups:
        attrs["ray_concurrency_groups"] = groups
    attrs["__doc__"] = "Colocated worker with roles: " + ", ".join(
        f"{r} ({c.__name__})" for r, c in role_classes.items()
    )
    cls_name = "Colocated_" + "_".join(role_classes)
    colocated = type(cls_name, (ColocatedWorker,), attrs)
    result = RayClassWithInitArgs(colocated, role_init)
    for spec in class_dict.values():
        result.update_options(spec.options)
    return result


def colocated_registered_names(cls: type) -> list[str]:
    """Prefixed names of the registered methods of a colocated class (for inspection)."""
    return sorted(n for n in dir(cls) if get_register_spec(getattr(cls, n, None)) is not None)
