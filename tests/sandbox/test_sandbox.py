"""The local code sandbox: limits and escapes, each contained, the calling process unaffected."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hybridrl.sandbox import Sandbox, SandboxLimits, SandboxUnavailable


def _pids_with(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (read from the host's /proc)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


@pytest.fixture(scope="module")
def box():
    try:
        return Sandbox(SandboxLimits(wall_time_s=10, cpu_time_s=5))
    except SandboxUnavailable as e:
        pytest.skip(f"namespaces refused on this machine: {e}")


def test_runs_code_with_stdin_and_files(box):
    code = "import sys\nprint(open('data.txt').read().strip(), sys.stdin.read()[::-1])\nopen('out.txt','w').write('ok')"
    r = box.run_python(code, stdin="abc", files={"data.txt": "hello"}, fetch_files=["out.txt"])
    assert (r.status, r.return_code, r.stdout) == ("Finished", 0, "hello cba\n")
    assert r.files == {"out.txt": b"ok"} and r.ok
    bad = box.run_python("raise SystemExit(3)")
    assert (bad.status, bad.return_code, bad.ok) == ("Finished", 3, False)


def test_no_network_not_even_the_callers_loopback(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import socket
        for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)):
            s = socket.socket(); s.settimeout(2)
            print(host, s.connect_ex((host, port)) != 0)
        try:
            socket.getaddrinfo("pypi.org", 443); print("dns True")
        except OSError:
            print("dns blocked")
        """
    )
    try:
        r = box.run_python(code)
    finally:
        server.close()
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:4] == ["127.0.0.1 True", "1.1.1.1 True", "8.8.8.8 True", "dns blocked"]


def test_fork_bomb_is_contained_and_the_caller_still_forks():
    box = Sandbox(SandboxLimits(wall_time_s=3, cpu_time_s=3, max_processes=16))
    marker = "forkbomb-4d1c"
    code = f"import os\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    r = box.run_python(code, args=[marker])
    assert time.monotonic() - start < 8
    assert r.status == "TimeLimitExceeded"
    time.sleep(0.2)
    assert _pids_with(marker) == []  # every process of the run is gone
    assert subprocess.run(["/usr/bin/true"]).returncode == 0


def test_huge_file_stops_at_the_file_size_limit():
    box = Sandbox(SandboxLimits(max_file_mb=1))
    code = "with open('big', 'wb') as f:\n    for _ in range(100):\n        f.write(b'x' * (1 << 20))\n"
    r = box.run_python(code, fetch_files=["big"])
    assert r.return_code != 0 and "File too large" in r.stderr
    assert len(r.files["big"]) <= 1 << 20


def test_private_tmp_is_size_limited():
    box = Sandbox(SandboxLimits(tmp_mb=2, max_file_mb=64))
    r = box.run_python("open('/tmp/fill', 'wb').write(b'x' * (8 << 20))")
    assert r.return_code != 0 and "No space left" in r.stderr


def test_infinite_loop_and_sleep_end_at_their_limits():
    cpu = Sandbox(SandboxLimits(cpu_time_s=1, wall_time_s=20)).run_python("while True:\n    pass\n")
    assert cpu.status == "TimeLimitExceeded" and cpu.wall_time_s < 10, cpu
    wall = Sandbox(SandboxLimits(cpu_time_s=20, wall_time_s=1)).run_python("import time\ntime.sleep(60)")
    assert wall.status == "TimeLimitExceeded" and wall.wall_time_s < 5


def test_memory_limit():
    r = Sandbox(SandboxLimits(memory_mb=256)).run_python("x = bytearray(1 << 30)")
    assert r.return_code != 0 and "MemoryError" in r.stderr


def test_output_limit():
    r = Sandbox(SandboxLimits(max_output_bytes=1000)).run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)"
    )
    assert r.status == "OutputLimitExceeded" and len(r.stdout) + len(r.stderr) <= 1000


def test_files_outside_its_directory_are_invisible_or_read_only(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    here = os.path.abspath(__file__)
    code = textwrap.dedent(
        f"""
        import os
        for path in ({str(secret)!r}, {here!r}, "/root/.bashrc", "/proc/1/environ"):
            try:
                open(path).read(); print("read", path)
            except OSError as e:
                print("no", type(e).__name__)
        for path in ("/etc/evil", "/usr/evil", {str(tmp_path / "evil")!r}, "/evil"):
            try:
                open(path, "w").write("x"); print("wrote", path)
            except OSError as e:
                print("no", type(e).__name__)
        open("/tmp/private", "w").write("x")  # its own /tmp
        os.symlink({str(secret)!r}, "link")
        """
    )
    r = box.run_python(code, fetch_files=["link"])
    assert r.ok, r.stderr
    assert "read" not in r.stdout and "wrote" not in r.stdout, r.stdout
    assert r.files == {}  # a link to a host file is not followed when files come back
    assert not (tmp_path / "evil").exists() and not os.path.exists("/tmp/private")


def test_process_left_behind_is_killed(box):
    marker = "left-behind-7e2a"
    code = textwrap.dedent(
        f"""
        import subprocess, sys, os
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", "{marker}"])
        print("left")
        """
    )
    r = box.run_python(code)
    assert r.ok and r.stdout == "left\n", r.stderr
    time.sleep(0.3)
    assert _pids_with(marker) == []


def test_runs_concurrently_from_asyncio_and_threads(box):
    async def many():
        return await asyncio.gather(*(box.arun_python(f"print({i} * {i})") for i in range(4)))

    assert [r.stdout for r in asyncio.run(many())] == ["0\n", "1\n", "4\n", "9\n"]
    results = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, box.run_python(f"print({i})").stdout))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: "0\n", 1: "1\n", 2: "2\n"}


def test_refuses_to_start_without_isolation_and_says_how_to_turn_it_off(tmp_path):
    missing = str(tmp_path / "not-there")
    with pytest.raises(SandboxUnavailable, match="isolation=False"):
        Sandbox(read_only=("/usr", missing))
    with pytest.raises(TypeError, match="True or False"):
        Sandbox(isolation="off")
    with pytest.raises(ValueError, match="absolute host directories"):
        Sandbox(read_only=("/",))


def test_without_isolation_limits_still_apply(caplog):
    box = Sandbox(SandboxLimits(wall_time_s=1), isolation=False)
    assert box.run_python("print(2 + 2)").stdout == "4\n"
    assert box.run_python("import time\ntime.sleep(30)").status == "TimeLimitExceeded"
    assert sys.executable  # the caller is unaffected
