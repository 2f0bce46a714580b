"""Environments out of the trainer's process: one process per episode, a deadline per call.

`EpisodeProcess.start(cls, kwargs, timeout_s)` forks a process from multiprocessing's fork server
(started once per rollout process, with the first environment's module imported, so an episode
starts in milliseconds and shares nothing with the trainer's threads or memory) that builds the environment and answers `reset` / `step` /
`close` calls over a pipe. Each call has a deadline: one that passes it kills the episode's
process. An exception in the environment comes back as `EnvironmentFault` with its traceback;
so does a reply of the wrong shape (`step` must give `(str, number, bool, dict)`). The agent loop
turns every fault into data for that sample (reward 0, the error in the log and the metrics).
"""

from __future__ import annotations

import asyncio
import importlib
import math
import multiprocessing
import sys
import threading
import traceback
import warnings
from typing import Any

__all__ = ["EnvironmentFault", "EpisodeProcess", "check_observation", "check_step", "is_token_ids"]

_CONTEXT = None
_CONTEXT_LOCK = threading.Lock()

# Every process from the fork server re-runs a `python -m` main module (as __mp_main__) that the
# server preloaded by name (see _main_module_name), and runpy warns that the module is already
# imported: once per episode, on the trainer's stderr. The preload is the intent; the fork server
# imports this module, so the filter holds in every episode process.
warnings.filterwarnings(
    "ignore", message=r"'[\w.]+' found in sys\.modules after import of package", category=RuntimeWarning
)


class EnvironmentFault(RuntimeError):
    """An environment call failed: `kind` is "error" (it raised), "timeout" or "malformed"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _context(env_module: str | None = None):
    """The forkserver context; its server preloads the module of the first environment started
    (`env_module`), so every episode of that environment starts with its imports done."""
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(
                ["__main__", *_main_module_name(), "hybridrl.env.host", "hybridrl.env.base"]
                + ([env_module] if env_module else [])
            )
            _CONTEXT = ctx
        return _CONTEXT


def _main_module_name() -> list[str]:
    """The main module's import name when it was started with `python -m` (e.g. main_ppo).

    Every process from the fork server runs the main module again (as `__mp_main__`). The server
    imports a main *script* once by itself ("__main__" above; a Ray worker's), but not a main module
    run with `-m`: preloading it by name puts its imports (torch, transformers) in the server, so an
    episode re-runs only the module's own lines instead of importing the whole stack again.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return [name] if name and name != "__main__" and not name.endswith(".__main__") else []


_SERVER_READY = threading.Event()
_SERVER_START_S = 600.0


def _ready() -> None:
    """The first process from the fork server: it exists once the server has imported its modules."""


def _ensure_server(env_module: str | None = None) -> None:
    """Start the fork server and wait until it forks (its first start imports torch and the first
    environment's module: slow, and not the environment's time)."""
    with _CONTEXT_LOCK:
        if _SERVER_READY.is_set():
            return
    ctx = _context(env_module)
    with _CONTEXT_LOCK:
        if not _SERVER_READY.is_set():
            proc = ctx.Process(target=_ready, daemon=True)
            proc.start()
            proc.join(_SERVER_START_S)
            if proc.exitcode != 0:
                raise EnvironmentFault(
                    "error",
                    f"the environments' fork server did not start (first process exit code {proc.exitcode})",
                )
            _SERVER_READY.set()


def _serve(conn, module: str, qualname: str, kwargs: dict[str, Any]) -> None:
    """The episode process: build the environment, then answer calls until `close` or EOF."""
    loop = asyncio.new_event_loop()
    env = None
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        env = obj(**kwargs)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer
        conn.send(("error", _describe(e)))
        return
    while True:
        try:
            method, arg = conn.recv()
        except EOFError:
            method, arg = "close", None
        try:
            coro = env.reset(arg) if method == "reset" else env.step(arg) if method == "step" else env.close()
            value = loop.run_until_complete(coro)
            try:
                conn.send(("ok", value))
            except Exception as e:  # noqa: BLE001 - a value that does not pickle
                conn.send(("malformed", f"{method} returned a value that cannot be sent back: {e}"))
        except BaseException as e:  # noqa: BLE001 - reported to the trainer
            try:
                conn.send(("error", _describe(e)))
            except OSError:
                return
        if method == "close":
            return


def _describe(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
    return f"{type(e).__name__}: {e}\n{tb}"


class EpisodeProcess:
    """One environment instance in its own process (see the module docstring)."""

    def __init__(self, proc, conn, name: str, timeout_s: float) -> None:
        self.proc, self.conn, self.name, self.timeout_s = proc, conn, name, timeout_s

    @classmethod
    async def start(
        cls,
        env_cls: type,
        kwargs: dict[str, Any],
        name: str,
        timeout_s: float,
        start_timeout_s: float = 120.0,
    ) -> EpisodeProcess:
        """A new episode process with `env_cls(**kwargs)` built in it (within `start_timeout_s`: a
        start competes for the CPU with the rollout); its calls then have `timeout_s` each."""
        await asyncio.to_thread(_ensure_server, env_cls.__module__)
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_serve, args=(child, env_cls.__module__, env_cls.__qualname__, dict(kwargs)), daemon=True
        )
        await asyncio.to_thread(proc.start)
        child.close()
        episode = cls(proc, parent, name, start_timeout_s)
        await episode._reply("start")
        episode.timeout_s = timeout_s
        return episode

    async def _reply(self, what: str) -> Any:
        """The process's answer to the last request, within the deadline."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, self.timeout_s)
        except asyncio.TimeoutError:
            self.kill()
            raise EnvironmentFault(
                "timeout", f"environment {self.name!r} {what} did not return within {self.timeout_s:g} s"
            ) from None
        finally:
            loop.remove_reader(fd)
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise EnvironmentFault(
                "error",
                f"environment {self.name!r} process ended during {what} (exit code {self.proc.exitcode})",
            ) from None
        if status != "ok":
            raise EnvironmentFault(status, f"environment {self.name!r} {what}: {value}")
        return value

    async def call(self, method: str, arg: Any = None) -> Any:
        try:
            self.conn.send((method, arg))
        except (OSError, ValueError) as e:
            self.kill()
            raise EnvironmentFault("error", f"environment {self.name!r} process is gone ({e})") from None
        return await self._reply(method)

    async def reset(self, row: dict[str, Any]) -> str | list[dict[str, Any]] | None:
        return check_observation(await self.call("reset", row), self.name)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return check_step(await self.call("step", action), self.name)

    async def close(self) -> None:
        """Ask the environment to close (bounded by the deadline), then end the process."""
        if self.proc.is_alive():
            try:
                await self.call("close")
            except EnvironmentFault:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def is_token_ids(obs: Any) -> bool:
    """A non-empty list of token ids (plain ints, not bools): an observation given as ids."""
    return (
        isinstance(obs, list)
        and bool(obs)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in obs)
    )


def check_observation(obs: Any, name: str) -> str | list[dict[str, Any]] | list[int] | None:
    if obs is None or isinstance(obs, str):
        return obs
    if is_token_ids(obs):
        return obs
    if isinstance(obs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in obs):
        return obs
    raise EnvironmentFault(
        "malformed",
        f"environment {name!r} reset returned {type(obs).__name__} {str(obs)[:100]!r}; it must return a user "
        "message (str), a list of chat messages ({'role', 'content'}), token ids (a non-empty list of int) or None",
    )


def check_step(result: Any, name: str) -> tuple[str | list[int], float, bool, dict[str, Any]]:
    ok = isinstance(result, tuple | list) and len(result) == 4
    if ok:
        obs, reward, done, info = result
        ok = (
            (obs is None or isinstance(obs, str) or obs == [] or is_token_ids(obs))
            and isinstance(reward, int | float)
            and not isinstance(reward, bool)
            and math.isfinite(float(reward))
            and isinstance(done, bool)
            and isinstance(info, dict)
        )
    if not ok:
        raise EnvironmentFault(
            "malformed",
            f"environment {name!r} step returned {str(result)[:120]!r}; it must return (observation: str or "
            "token ids, reward: finite number, done: bool, info: dict)",
        )
    return (obs or ""), float(reward), done, dict(info)
