"""A local code sandbox: run a program in a fresh temporary directory, with limits, without network.

    sandbox = Sandbox(SandboxLimits(wall_time_s=5))
    result = sandbox.run_python("print(input()[::-1])", stdin="abc")
    result.status, result.return_code, result.stdout     # ("Finished", 0, "cba\\n")

Each run gets a new directory (the program's working directory, `/sandbox` inside) that is deleted
afterwards. Limits (`SandboxLimits`): CPU seconds, wall-clock seconds, address space, processes,
file size, open files, size of a private /tmp and of the captured output. A run that passes its
wall-clock or CPU limit ends as "TimeLimitExceeded", one that writes more than `max_output_bytes`
as "OutputLimitExceeded"; in both cases every process of the run is killed.

Isolation (`isolation=True`, the default; `hybridrl.sandbox.jail` has the details): Linux user,
mount, network, PID, IPC and UTS namespaces. The program sees a read-only root holding only the
system directories and the Python installation, its own directory at /sandbox and a private /tmp;
it has no network; when it ends, every process it started ends with it. On a machine whose kernel
refuses these namespaces the sandbox does not start (`SandboxUnavailable`, with the reason) unless
isolation is turned off explicitly (`isolation=False`): then the limits still apply, but the
program can use the network and read what the calling user can read, and a process that leaves its
process group can outlive the run.

When the caller is root, an isolated program runs as a user id of its own (see jail.py), so the
host's file permissions apply to it and the process limit counts only its processes (the kernel
does not apply that limit to root: without isolation a root caller's programs have none).

`bench/sandbox_overhead.py` measures the cost of a run over a bare subprocess.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field

from hybridrl.sandbox import jail

logger = logging.getLogger(__name__)

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]

_UID_BASE = 1 << 30  # sandbox user ids (when the caller is root): far above any real account


class SandboxUnavailable(RuntimeError):
    """The kernel refuses the namespaces the sandbox needs (and isolation was not turned off)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Sizes in MiB unless named `_bytes`."""

    cpu_time_s: int = 10
    wall_time_s: float = 10.0
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    max_processes: int = 64  # processes and threads of the run (RLIMIT_NPROC)
    max_file_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    max_open_files: int = 256
    max_output_bytes: int = 1 << 20  # stdout + stderr kept; more ends the run
    tmp_mb: int = 64  # size of the private /tmp (isolated runs)

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "wall_time_s", "memory_mb", "max_processes", "max_file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_open_files", "max_output_bytes", "tmp_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """One run. `status`: "Finished" (the program ended by itself, any exit code),
    "TimeLimitExceeded" (wall or CPU time) or "OutputLimitExceeded"."""

    status: str
    return_code: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    wall_time_s: float
    cpu_time_s: float
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "Finished" and self.return_code == 0


_PROBED: dict[tuple, str | None] = {}
_PROBE_LOCK = threading.Lock()
_WARNED = False


class Sandbox:
    """Runs programs under `limits`; thread-safe, one directory per run.

    Args:
        limits: the per-run limits.
        isolation: True (namespaces; refuse to start without them) or False (limits only; say so).
        read_only: host directories visible (read-only) inside; default: the system's and Python's.
        python: the interpreter `run_python` uses (default: this one, so its packages are there).
        max_concurrent: runs at once through `arun`.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: bool = True,
        read_only: tuple[str, ...] | None = None,
        python: str | None = None,
        max_concurrent: int = 8,
    ) -> None:
        if not isinstance(isolation, bool):
            raise TypeError(f"Sandbox(isolation=...) must be True or False, got {isolation!r}")
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
        self.read_only = tuple(read_only) if read_only is not None else jail.default_read_only()
        for path in self.read_only:
            if not os.path.isabs(path) or path.rstrip("/") in ("", jail.INSIDE, "/tmp", "/dev"):
                raise ValueError(f"Sandbox(read_only=...) entries must be absolute host directories other than "
                                 f"/, /tmp, /dev and {jail.INSIDE}; got {path!r}")  # fmt: skip
        self.python = python or sys.executable
        self._slots = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self._max_concurrent = max_concurrent
        if isolation:
            self._check_isolation()
        else:
            _warn_not_isolated()

    # ------------------------------------------------------------------ start-up
    def _check_isolation(self) -> None:
        if not sys.platform.startswith("linux"):
            why = f"it needs Linux namespaces and this is {sys.platform}"
        else:
            key = (os.geteuid(), self.read_only)
            with _PROBE_LOCK:
                if key not in _PROBED:
                    base = tempfile.mkdtemp(prefix="hybridrl-sandbox-probe-")
                    try:
                        plan = dataclasses.asdict(self._plan(base, isolate=True))
                        _PROBED[key] = _helper().call({"probe": True, "plan": plan})
                    finally:
                        _remove(base)
                why = _PROBED[key]
            if why is not None:
                why = f"the kernel refused the sandbox's namespaces ({why})"
        if why is not None:
            raise SandboxUnavailable(
                f"The code sandbox cannot isolate programs on this machine: {why}. Allow unprivileged user "
                "namespaces (sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 where "
                "it exists), or turn isolation off explicitly (Sandbox(isolation=False), config "
                "`isolation: false`): the limits then still apply, but the program can reach the network and "
                "read every file the trainer's user can read."
            )

    def _plan(self, work: str, *, isolate: bool) -> jail.ChildPlan:
        lim = self.limits
        uid = None
        if os.geteuid() == 0 and isolate:
            uid = _UID_BASE + random.randrange(1 << 24)
            os.chown(work, uid, uid)
        # + the two waiting processes of an isolated run (jail._start_pid_namespace)
        nproc = (
            lim.max_processes + 2 + (0 if uid is not None or os.geteuid() == 0 else _tasks_of(os.getuid()))
        )
        rlimits = (
            (resource.RLIMIT_CPU, int(lim.cpu_time_s)),
            (resource.RLIMIT_AS, lim.memory_mb << 20),
            (resource.RLIMIT_FSIZE, lim.max_file_mb << 20),
            (resource.RLIMIT_NPROC, nproc),
            (resource.RLIMIT_NOFILE, lim.max_open_files),
            (resource.RLIMIT_CORE, 0),
        )
        return jail.ChildPlan(
            isolate=isolate,
            work_dir=work,
            new_root=_scratch("root"),
            read_only=self.read_only,
            uid=uid,
            rlimits=rlimits,
            tmp_mb=lim.tmp_mb,
            symlinks=jail.symlinks_in_root(),
        )

    # ------------------------------------------------------------------ runs
    def run_python(
        self,
        code: str,
        stdin: str | bytes = "",
        files: dict[str, str | bytes] | None = None,
        fetch_files: list[str] | tuple[str, ...] = (),
        args: list[str] | tuple[str, ...] = (),
    ) -> SandboxResult:
        """Run `code` as `main.py` in the run's directory with `self.python` (-I: no PYTHON* variables,
        no user site)."""
        files = dict(files or {})
        files["main.py"] = code
        return self.run(
            [self.python, "-I", "main.py", *args], stdin=stdin, files=files, fetch_files=fetch_files
        )

    async def arun_python(self, code: str, **kwargs) -> SandboxResult:
        """`run_python` in a thread, at most `max_concurrent` at once."""
        return await self._async(self.run_python, code, **kwargs)

    async def arun(self, argv: list[str], **kwargs) -> SandboxResult:
        return await self._async(self.run, argv, **kwargs)

    async def _async(self, fn, *args, **kwargs) -> SandboxResult:
        if self._slots is None:
            return await asyncio.to_thread(fn, *args, **kwargs)
        if getattr(self._slots, "_hybridrl_loop", None) is not asyncio.get_running_loop():
            self._slots = asyncio.Semaphore(self._max_concurrent)  # a semaphore belongs to one event loop
            self._slots._hybridrl_loop = asyncio.get_running_loop()
        async with self._slots:
            return await asyncio.to_thread(fn, *args, **kwargs)

    def run(
        self,
        argv: list[str],
        stdin: str | bytes = "",
        files: dict[str, str | bytes] | None = None,
        fetch_files: list[str] | tuple[str, ...] = (),
    ) -> SandboxResult:
        """Run `argv` (argv[0] a path visible inside) in a fresh directory holding `files`; return
        its result with the files named in `fetch_files` (paths relative to that directory)."""
        if not argv:
            raise ValueError("Sandbox.run needs a program to run (argv is empty)")
        work = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
        stdin_path = None
        try:
            plan = self._plan(work, isolate=self.isolation)
            _write_files(plan.work_dir, files or {}, plan.uid)
            fd, stdin_path = tempfile.mkstemp(dir=_scratch("stdin"))
            with os.fdopen(fd, "wb") as f:
                f.write(stdin.encode() if isinstance(stdin, str) else bytes(stdin))
            result = self._execute(argv, plan, stdin_path)
            result.files = _read_files(plan.work_dir, fetch_files)
            return result
        finally:
            _CLEANER.submit(
                _remove, work, stdin_path
            )  # off the caller's path (deleting is slow on some disks)

    def _execute(self, argv: list[str], plan: jail.ChildPlan, stdin_path: str) -> SandboxResult:
        lim = self.limits
        home = jail.INSIDE if plan.isolate else plan.work_dir
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": "/tmp" if plan.isolate else plan.work_dir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        request = {
            "argv": list(argv),
            "env": env,
            "plan": dataclasses.asdict(plan),
            "stdin_path": stdin_path,
            "wall_time_s": lim.wall_time_s,
            "max_output_bytes": lim.max_output_bytes,
        }
        r = _helper().call(request)
        status, code, cpu = r["status"], r["return_code"], r["cpu_time_s"]
        killed = code in (-signal.SIGXCPU, -signal.SIGKILL)  # the kernel's CPU-time signals
        if status == "Finished" and killed and cpu >= 0.9 * lim.cpu_time_s:
            status = "TimeLimitExceeded"
        return SandboxResult(
            status=status,
            return_code=code,
            stdout=base64.b64decode(r["stdout"]).decode(errors="replace"),
            stderr=base64.b64decode(r["stderr"]).decode(errors="replace"),
            wall_time_s=r["wall_time_s"],
            cpu_time_s=cpu,
        )


class _Helper:
    """A small process (stdlib only, `jail.py` as a script) that starts the sandboxed programs.

    Starting them from here instead would fork this process: with torch loaded a fork costs tens of
    milliseconds, and a fork of a multi-threaded process that runs Python code before exec (the
    namespace set-up) can deadlock. The helper forks cheaply and runs each request in a thread.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", jail.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list]] = {}
        self._next = 0
        threading.Thread(target=self._read, daemon=True, name="sandbox-helper-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self._lock:
                event, box = self._waiting.pop(reply["id"])
            box.append(reply)
            event.set()
        with self._lock:  # the helper ended: wake everyone waiting
            for event, box in self._waiting.values():
                box.append({"error": f"the sandbox helper process ended (exit status {self.proc.poll()})"})
                event.set()
            self._waiting.clear()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, request: dict) -> dict:
        event, box = threading.Event(), []
        with self._lock:
            self._next += 1
            request = {**request, "id": self._next}
            self._waiting[self._next] = (event, box)
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        event.wait()
        reply = box[0]
        if "error" in reply:
            raise RuntimeError(f"the code sandbox could not run the program: {reply['error']}")
        return reply["result"]


_HELPER: _Helper | None = None
_HELPER_LOCK = threading.Lock()


def _helper() -> _Helper:
    """This process's helper (started on first use, again after it died or after a fork)."""
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None or not _HELPER.alive() or _HELPER.pid_of_owner != os.getpid():
            _HELPER = _Helper()
            _HELPER.pid_of_owner = os.getpid()
        return _HELPER


def _tasks_of(uid: int) -> int:
    """Processes + threads the user runs now (RLIMIT_NPROC counts them all)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _inside(work_dir: str, name: str) -> str:
    path = os.path.realpath(os.path.join(work_dir, name))
    if os.path.isabs(name) or not path.startswith(os.path.realpath(work_dir) + os.sep):
        raise ValueError(
            f"sandbox file names must be relative paths inside the run's directory, got {name!r}"
        )
    return path


def _write_files(work_dir: str, files: dict[str, str | bytes], uid: int | None) -> None:
    for name, content in files.items():
        path = _inside(work_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else bytes(content))
        if uid is not None:
            os.chown(path, uid, uid)
            d = os.path.dirname(path)
            while d != work_dir and d.startswith(work_dir):
                os.chown(d, uid, uid)
                d = os.path.dirname(d)


def _read_files(work_dir: str, names) -> dict[str, bytes]:
    out = {}
    for name in names:
        try:
            path = _inside(work_dir, name)  # a symlink the program made to a host file is refused here
        except ValueError:
            continue
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


_SCRATCH: dict[str, str] = {}
_CLEANER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-cleanup")


def _scratch(name: str) -> str:
    """A directory of this process shared by its runs: `root` (the empty mount point of every
    private root: each run mounts over it in its own mount namespace) and `stdin` (input files)."""
    key = f"{os.getpid()}-{name}"
    if key not in _SCRATCH:
        path = tempfile.mkdtemp(prefix=f"hybridrl-sandbox-{name}-")
        os.chmod(path, 0o711 if name == "root" else 0o700)
        _SCRATCH[key] = path
        atexit.register(shutil.rmtree, path, True)
    return _SCRATCH[key]


def _remove(path: str, stdin_path: str | None = None) -> None:
    if stdin_path is not None:
        with contextlib.suppress(OSError):
            os.unlink(stdin_path)

    def fix(func, p, _exc):  # a directory the program made unreadable
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def _warn_not_isolated() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        logger.warning(
            "code sandbox running WITHOUT isolation (isolation=False): limits apply, but programs can reach "
            "the network and read the files this user can read%s",
            " (running as root: the process limit does not hold either)" if os.geteuid() == 0 else "",
        )
