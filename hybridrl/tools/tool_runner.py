"""Tool callbacks off the generation loop, each with a deadline.

The agent loop's event loop also drives generation, so a tool must never hold it. Every tool
callback (`create`, `execute`, `calc_reward`, `release`) runs on a private event loop in a daemon
thread of its own (one per process, shared by all tools, so loop-bound state such as an HTTP
session keeps working from call to call); the agent loop only awaits the result, for at most
`multi_turn.tool_timeout_s`:

* an `async def execute` that blocks (``time.sleep``, a blocking socket read) freezes the tool loop,
  not generation. When a call passes its deadline while the tool loop has not run for that long, the
  tool loop is abandoned (a warning names the tool and the method) and the next call starts a fresh
  one; the blocked thread is a daemon and never keeps the process from exiting;
* a sync `@function_tool` runs in a daemon thread of its own (:func:`run_sync_detached`): nobody waits
  for it after the deadline, so neither the step's ``asyncio.run`` nor the process exit waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["ToolLoop", "run_sync_detached", "tool_loop"]

logger = logging.getLogger(__name__)
_BEAT_S = 0.05


class ToolLoop:
    """A private event loop in a daemon thread, replaced when a tool blocks it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat = 0.0
        self._thread: threading.Thread | None = None
        self.abandoned = 0  # loops given up because a tool blocked them

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = self._start()
            return self._loop

    def _after_fork_in_child(self) -> None:
        """A forked process has none of its parent's threads: the parent's loop would never run
        a call (every first tool call in the child would time out), so the child starts its own."""
        self._lock = threading.Lock()
        self._loop = None
        self._beat = 0.0
        self._thread = None

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.call_soon(self._heartbeat, loop)
            try:
                loop.run_forever()
            finally:
                _finish_loop(loop)

        self._thread = threading.Thread(target=run, name="hybridrl-tool-loop", daemon=True)
        self._thread.start()
        ready.wait()  # cannot hang: the loop's first callback sets it (nothing runs before it)
        self._beat = time.monotonic()
        return loop

    def _heartbeat(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is self._loop:
            self._beat = time.monotonic()
            loop.call_later(_BEAT_S, self._heartbeat, loop)

    def close(self, wait_s: float = 1.0) -> None:
        """Stop the tool loop: its unfinished calls are cancelled and awaited, not left pending."""
        with self._lock:
            loop, self._loop = self._loop, None
        thread = getattr(self, "_thread", None)
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)  # a tool blocking the loop keeps it: the daemon thread dies with the process

    def stalled_s(self) -> float:
        """Seconds since the tool loop last ran its heartbeat."""
        return time.monotonic() - self._beat

    def _abandon(self, loop: asyncio.AbstractEventLoop, what: str, timeout_s: float) -> None:
        with self._lock:
            if self._loop is not loop:
                return
            self._loop = None
            self.abandoned += 1
        loop.call_soon_threadsafe(loop.stop)  # runs once the blocking call returns, if ever
        logger.warning(
            "%s blocked the tools' event loop for more than %.3g s (a blocking call inside an async "
            "tool method: use `await asyncio.to_thread(...)` for blocking work); that loop is abandoned "
            "and the next tool call starts a new one (multi_turn.tool_timeout_s=%g)",
            what,
            self.stalled_s(),
            timeout_s,
        )

    async def run(self, make: Callable[[], Awaitable[Any]], *, timeout_s: float, what: str) -> Any:
        """Await ``make()`` run on the tool loop, for at most ``timeout_s``.

        Args:
            make: builds the awaitable (called on the tool loop, so nothing of the tool runs here).
            timeout_s: the deadline (multi_turn.tool_timeout_s).
            what: the call, as a warning names it (e.g. "tool 'search' execute").

        Raises:
            asyncio.TimeoutError: past the deadline (the call is cancelled; a blocked loop is abandoned).
        """
        loop = self._ensure()

        async def call() -> Any:
            return await make()

        fut = asyncio.run_coroutine_threadsafe(call(), loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and loop is not self._loop and not (task and task.cancelling()):
                raise RuntimeError(
                    f"{what} was stopped: the tools' event loop it ran on was abandoned because another "
                    "tool call blocked it"
                ) from None
            raise
        except asyncio.TimeoutError:
            fut.cancel()
            if self.stalled_s() >= min(timeout_s, 1.0):
                self._abandon(loop, what, timeout_s)
            raise


def _finish_loop(loop: asyncio.AbstractEventLoop) -> None:
    """After a tool loop stopped (abandoned, or at exit): cancel the calls still on it and let them
    end, so that no task is destroyed pending; their callers get the cancellation."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


tool_loop = ToolLoop()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=tool_loop._after_fork_in_child)


async def run_sync_detached(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread of its own; await its value or its exception.

    Unlike ``asyncio.to_thread`` (the loop's default executor, which ``asyncio.run`` joins at the end
    and the interpreter joins at exit), nobody waits for the thread once the awaiting task is
    cancelled, e.g. by a deadline.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if fut.done():
            return
        fut.set_result(value) if ok else fut.set_exception(value)

    def work() -> None:
        try:
            result: tuple[bool, Any] = (True, fn(*args, **kwargs))
        except BaseException as err:  # handed to the awaiting task
            result = (False, err)
        try:
            loop.call_soon_threadsafe(deliver, *result)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name=f"hybridrl-tool:{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await fut
