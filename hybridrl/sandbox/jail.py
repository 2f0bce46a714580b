"""The isolation a sandboxed program runs in: Linux namespaces, a private read-only root and rlimits.

`prepare_child` runs in the forked child between fork and exec (subprocess's `preexec_fn`), so it
only calls `os` functions and libc through ctypes that were looked up before the fork. In order:

1. when the caller is root, switch to a user id of the sandbox's own (no files on the host belong to
   it, and `RLIMIT_NPROC` then counts only this run's processes; root is exempt from that limit);
2. unshare user, mount, network, IPC and UTS namespaces and map the sandbox user to root inside;
3. build a new root on a tmpfs: the system directories and the Python installation bind-mounted
   read-only, /dev/{null,zero,random,urandom}, a size-limited tmpfs at /tmp and the run's own
   directory read-write at /sandbox; `chroot` into it (nothing else of the host's file system is
   visible);
4. set the rlimits (CPU seconds, address space, file size, processes, open files, no core dumps).

The namespaces include a new PID namespace whose PID 1 is a small reaper process forked here (the
program is its child): when the program ends, or the sandbox kills the run, PID 1 ends and the kernel
kills every process the program left behind, even one that left its process group.

The network namespace has only a loopback device that is down: every connection fails.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
PR_SET_DUMPABLE = 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # the same on x86_64 and aarch64
OPEN_TREE_CLONE, AT_RECURSIVE, AT_EMPTY_PATH, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, 0x1000, 0x4
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _clone_tree(path: str, read_only: bool) -> int:
    """A detached copy of the mount at `path` (root only), made read-only recursively when asked."""
    L = ctypes.c_long
    fd = _libc.syscall(
        L(SYS_OPEN_TREE), L(-100), path.encode(), L(OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC)
    )
    if fd < 0:
        _check(-1, f"open_tree {path}")
    if read_only:
        attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
        ret = _libc.syscall(L(SYS_MOUNT_SETATTR), L(fd), b"", L(AT_EMPTY_PATH | AT_RECURSIVE), ctypes.byref(attr),
                            L(ctypes.sizeof(attr)))  # fmt: skip
        _check(ret, f"mount_setattr {path}")
    return fd


def _attach(fd: int, dst: str) -> None:
    L = ctypes.c_long
    ret = _libc.syscall(L(SYS_MOVE_MOUNT), L(fd), b"", L(-100), dst.encode(), L(MOVE_MOUNT_F_EMPTY_PATH))
    _check(ret, f"move_mount -> {dst}")


INSIDE = "/sandbox"  # where the run's directory appears in the private root
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


@dataclass(frozen=True)
class ChildPlan:
    """Everything the child needs, computed in the parent before the fork."""

    isolate: bool
    work_dir: str  # the run's directory on the host (read-write inside, at /sandbox when isolated)
    new_root: str  # an empty directory on the host where the private root is built
    read_only: tuple[str, ...]  # host directories bind-mounted read-only at the same path
    uid: int | None  # switch to this user id first (None: stay)
    rlimits: tuple[tuple[int, int], ...]  # (resource, limit)
    tmp_mb: int
    symlinks: tuple[tuple[str, str], ...] = ()  # (path, target) made in the new root (/bin -> usr/bin)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src} -> {dst}")


def _mount_point(dst: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))


def _bind(src: str, tree: int | None, dst: str, read_only: bool, is_dir: bool = True) -> None:
    """Mount `src` at `dst`: the detached copy `tree` (made before the user switch, when root: the
    sandbox user may not be allowed to walk the path) or a bind mount of the path."""
    _mount_point(dst, is_dir)
    if tree is not None:
        _attach(tree, dst)
        os.close(tree)
        return
    _mount(src, dst, None, MS_BIND | MS_REC)
    if not read_only:
        return
    locked = 0  # flags the host mount has must be kept in a user namespace (the kernel locks them)
    st = os.statvfs(dst)
    for flag, mask in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        if st.f_flag & flag:
            locked |= mask
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | locked)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces(plan: ChildPlan) -> None:
    """Steps 1-3 of the module docstring (in the child)."""
    trees: dict[str, int | None] = {p: None for p in (*plan.read_only, *DEVICES, plan.work_dir)}
    if plan.uid is not None:
        for p in trees:
            trees[p] = _clone_tree(p, read_only=p in plan.read_only)
        os.setgroups([])
        os.setgid(plan.uid)
        os.setuid(plan.uid)
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl")  # setuid made /proc/self root's
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    _check(_libc.unshare(flags), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = plan.new_root
    _mount("none", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    # the private /tmp first: a read-only tree that lives under the host's /tmp (a virtualenv
    # there) gets its mount point inside it instead of being hidden by it
    os.makedirs(root + "/tmp")
    _mount("none", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={plan.tmp_mb}m,mode=1777")
    for path in plan.read_only:
        _bind(path, trees[path], root + path, read_only=True)
    for link, target in plan.symlinks:
        os.symlink(target, root + link)
    for dev in DEVICES:
        _bind(dev, trees[dev], root + dev, read_only=False, is_dir=False)
    os.makedirs(root + INSIDE)
    _bind(plan.work_dir, trees[plan.work_dir], root + INSIDE, read_only=False)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir(INSIDE)


def _exit_like(status: int) -> None:
    """End this process the way `status` (a wait status) says its child ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _start_pid_namespace() -> None:
    """Fork twice: this process waits for the first child (PID 1 of the new PID namespace), which
    reaps orphans until its own child (the one that returns from here and execs the program) ends;
    then PID 1 exits and the kernel kills every process left in the namespace. The two waiting
    processes close every file descriptor (the program's pipes then close when the program's
    processes end, and the exec-status pipe of subprocess closes at the program's exec)."""
    init = os.fork()
    if init:
        os.closerange(0, 65536)
        _, status = os.waitpid(init, 0)
        code = os.waitstatus_to_exitcode(status)
        if 128 < code < 128 + signal.NSIG:  # PID 1 passed on "killed by a signal" as 128 + signal
            status = code - 128
        _exit_like(status)
    program = os.fork()
    if program == 0:
        return
    os.closerange(0, 65536)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == program:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)  # PID 1 cannot kill itself with a signal


def prepare_child(plan: ChildPlan) -> None:
    """Runs between fork and exec: namespaces (when isolating), then the rlimits."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if plan.isolate:
        enter_namespaces(plan)
        _start_pid_namespace()
    else:
        if plan.uid is not None:
            os.setgroups([])
            os.setgid(plan.uid)
            os.setuid(plan.uid)
        os.chdir(plan.work_dir)
    for which, limit in plan.rlimits:
        resource.setrlimit(which, (limit, limit))


def default_read_only() -> tuple[str, ...]:
    """The host directories a sandboxed Python program needs: the system's and the interpreter's."""
    paths = ["/usr", "/etc"]
    for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))):
        p = os.path.realpath(p)
        if not any(p == q or p.startswith(q + "/") for q in paths):
            paths.append(p)
    for link in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.isdir(link) and not os.path.islink(link):
            paths.append(link)
    return tuple(paths)


def symlinks_in_root() -> tuple[tuple[str, str], ...]:
    """Top-level symlinks (/bin -> usr/bin on merged-/usr systems) to recreate in the new root."""
    out = []
    for link in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(link):
            out.append((link, os.readlink(link)))
    return tuple(out)


def probe(plan: ChildPlan) -> str | None:
    """None when an isolated child can be prepared here, else why not (the kernel's answer)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports the first failure and never returns
        os.close(read_end)
        try:
            prepare_child(plan)
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - any failure is the answer
            os.write(write_end, f"{type(e).__name__}: {e}".encode()[:2000])
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else (message or f"wait status {status}")


def execute(request: dict) -> dict:
    """One run (in the helper process): start, collect output within the limits, kill the rest."""
    plan = ChildPlan(**{k: _tuples(v) for k, v in request["plan"].items()})
    argv = list(request["argv"])
    start = time.monotonic()
    with open(request["stdin_path"], "rb") as stdin:
        proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=request["env"],
            cwd=None if plan.isolate else plan.work_dir,
            start_new_session=True,
            preexec_fn=lambda: prepare_child(plan),
        )
    deadline = start + request["wall_time_s"]
    status, out, err = _collect(proc, deadline, request["max_output_bytes"], plan.isolate)
    while status == "Finished" and _alive(proc.pid):  # output closed: let the process end by itself
        if time.monotonic() > deadline:
            status = "TimeLimitExceeded"
            break
        time.sleep(0.001)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run (its PID namespace dies with it)
    except (ProcessLookupError, PermissionError):
        pass
    _, wait_status, usage = os.wait4(proc.pid, 0)
    return {
        "status": status,
        "return_code": os.waitstatus_to_exitcode(wait_status),
        "stdout": base64.b64encode(out).decode(),
        "stderr": base64.b64encode(err).decode(),
        "wall_time_s": time.monotonic() - start,
        "cpu_time_s": usage.ru_utime + usage.ru_stime,
    }


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _alive(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _collect(proc: subprocess.Popen, deadline: float, max_bytes: int, isolated: bool):
    """Read stdout/stderr until both close, the deadline passes or the output passes `max_bytes`."""
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    status = "Finished"
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = "TimeLimitExceeded"
                break
            exited = not isolated and not _alive(proc.pid)
            # without a PID namespace a process left behind may hold the pipes open: stop soon after exit
            events = sel.select(timeout=min(left, 0.1) if exited else left)
            if not events and exited:
                break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
            if len(out) + len(err) > max_bytes:
                status = "OutputLimitExceeded"
                break
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    return status, bytes(out[:max_bytes]), bytes(err[: max(0, max_bytes - len(out))])


def serve(inp, out) -> None:
    """The helper's loop: one JSON request a line in, one JSON answer a line out (runs in threads)."""
    lock = threading.Lock()

    def answer(request: dict) -> None:
        try:
            if request.get("probe"):
                reply = {
                    "id": request["id"],
                    "result": probe(ChildPlan(**{k: _tuples(v) for k, v in request["plan"].items()})),
                }
            else:
                reply = {"id": request["id"], "result": execute(request)}
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the helper goes on
            reply = {"id": request["id"], "error": f"{type(e).__name__}: {e}"}
        with lock:
            out.write(json.dumps(reply) + "\n")
            out.flush()

    for line in inp:
        threading.Thread(target=answer, args=(json.loads(line),), daemon=True).start()


if __name__ == "__main__":  # the helper process (stdlib only: it starts without torch)
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: end with the process that started it
    serve(sys.stdin, sys.stdout)
