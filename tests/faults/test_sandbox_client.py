"""The SandboxFusion client against misbehaving real HTTP servers: a server that trickles
its answer ends at the total deadline, an oversized answer is refused, a sandbox that restarts is
waited for, and file:// URLs are refused."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridrl.reward.scorers.sandbox_fusion import SandboxFusionClient, SandboxSettings

OK = json.dumps({"status": "Success", "run_result": {"status": "Finished", "stdout": "3", "return_code": 0}})


class Handler(BaseHTTPRequestHandler):
    mode = "ok"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = OK.encode() if Handler.mode != "huge" else b" " * (1 << 20) + OK.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if Handler.mode == "trickle":  # one byte every 0.2 s: every read is quick, the whole is not
            for b in body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.2)
        else:
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(port=0):
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server():
    Handler.mode = "ok"
    srv = _serve()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(port, **kw):
    settings = dict(run_timeout=0.5, compile_timeout=0.5, api_timeout=0.5, retries=1, retry_window_s=0)
    return SandboxFusionClient(SandboxSettings(f"http://127.0.0.1:{port}/run_code", **{**settings, **kw}))


def test_a_trickling_answer_ends_at_the_total_deadline(server):
    Handler.mode = "trickle"  # ~100 bytes x 0.2 s = 20 s; deadline 1.5 s
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed 1 times.*did not arrive within 1.5 s"):
        _client(server.server_port).run_code("print(3)")
    assert time.monotonic() - t0 < 4


def test_an_oversized_answer_is_refused(server):
    Handler.mode = "huge"
    with pytest.raises(RuntimeError, match=r"answer larger than 65536 bytes"):
        _client(server.server_port, max_response_bytes=65536).run_code("print(3)")
    Handler.mode = "ok"
    assert _client(server.server_port).run_code("print(3)")["status"] == "Success"


def test_retries_span_a_sandbox_restart():
    with socket.socket() as s:  # a free port, nothing listening yet: the sandbox is "restarting"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Handler.mode = "ok"
    later: list = []
    timer = threading.Timer(2.0, lambda: later.append(_serve(port)))
    timer.start()
    try:
        t0 = time.monotonic()
        answer = _client(port, retries=3, retry_window_s=10).run_code("print(3)")
        assert answer["status"] == "Success" and 1.5 < time.monotonic() - t0 < 10
    finally:
        timer.join()
        for srv in later:
            srv.shutdown()
            srv.server_close()


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/run_code", "localhost:8080/run_code"])
def test_non_http_urls_are_refused_naming_the_key(url):
    with pytest.raises(
        ValueError, match=r"reward_model.sandbox_fusion.url=.* must be an http:// or https://"
    ):
        SandboxFusionClient(SandboxSettings(url))
