"""SandboxFusion's `run_code` API served by the local sandbox.

A veRL config that points at a SandboxFusion service (`reward_model.sandbox_fusion.url`) can point
at this server instead; nothing else changes:

    python -m hybridrl.sandbox.fusion --port 8080          # serves http://127.0.0.1:8080/run_code
    ... reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code

Request (JSON, SandboxFusion's fields): `code`, `language` ("python"/"python3"; other languages are
answered with status "SandboxError" and a message), `stdin`, `run_timeout` (s), `compile_timeout`
(accepted; Python has no compile step), `memory_limit_MB`, `files` ({relative path: base64}),
`fetch_files` ([relative path]). Unknown fields are refused (HTTP 400), never ignored.

Answer: {"status": "Success" (ran and exited 0) | "Failed" | "SandboxError", "message",
"compile_result": null, "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
"execution_time", "return_code", "stdout", "stderr"}, "executor_pod_name": null,
"files": {path: base64}}. A run that floods its output ends with run_result.status "Error" and a
message saying so.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridrl.sandbox.core import Sandbox, SandboxLimits

logger = logging.getLogger(__name__)

__all__ = ["run_code", "make_server", "RequestError"]

FIELDS = {
    "code",
    "language",
    "stdin",
    "run_timeout",
    "compile_timeout",
    "memory_limit_MB",
    "files",
    "fetch_files",
}
LANGUAGES = ("python", "python3")


class RequestError(ValueError):
    """A malformed request (HTTP 400)."""


def _limits(request: dict[str, Any], base: SandboxLimits) -> SandboxLimits:
    run_timeout = float(request.get("run_timeout") or base.wall_time_s)
    memory = int(request.get("memory_limit_MB") or base.memory_mb)
    if run_timeout <= 0 or memory <= 0:
        raise RequestError("run_timeout and memory_limit_MB must be > 0")
    return SandboxLimits(
        cpu_time_s=max(1, int(run_timeout + 0.999)),
        wall_time_s=run_timeout,
        memory_mb=memory,
        max_processes=base.max_processes,
        max_file_mb=base.max_file_mb,
        max_open_files=base.max_open_files,
        max_output_bytes=base.max_output_bytes,
        tmp_mb=base.tmp_mb,
    )


def run_code(request: dict[str, Any], *, isolation: bool = True, base: SandboxLimits | None = None) -> dict:
    """One SandboxFusion `run_code` request run in the local sandbox; its answer in SandboxFusion's shape."""
    if not isinstance(request, dict):
        raise RequestError("the request must be a JSON object")
    unknown = sorted(set(request) - FIELDS)
    if unknown:
        raise RequestError(f"unknown request fields {unknown}; known: {sorted(FIELDS)}")
    if not isinstance(request.get("code"), str):
        raise RequestError("'code' (a string) is required")
    language = request.get("language") or "python"
    if language not in LANGUAGES:
        return _answer(
            "SandboxError", f"language {language!r} is not supported by the local sandbox (only {LANGUAGES})"
        )
    try:
        files = {
            name: base64.b64decode(data, validate=True) for name, data in (request.get("files") or {}).items()
        }
    except (binascii.Error, TypeError, AttributeError) as e:
        raise RequestError(f"'files' must map relative paths to base64 strings ({e})") from e
    fetch = list(request.get("fetch_files") or [])
    sandbox = Sandbox(_limits(request, base or SandboxLimits()), isolation=isolation, max_concurrent=0)
    try:
        result = sandbox.run_python(
            request["code"], stdin=request.get("stdin") or "", files=files, fetch_files=fetch
        )
    except ValueError as e:  # a file name outside the run's directory
        raise RequestError(str(e)) from e
    run_status = {"Finished": "Finished", "TimeLimitExceeded": "TimeLimitExceeded"}.get(
        result.status, "Error"
    )
    message = (
        "" if result.status != "OutputLimitExceeded" else "the program's output passed the sandbox's limit"
    )
    status = "Success" if result.ok else "Failed"
    answer = _answer(status, message)
    answer["run_result"] = {
        "status": run_status,
        "execution_time": result.wall_time_s,
        "return_code": result.return_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }
    answer["files"] = {name: base64.b64encode(data).decode() for name, data in result.files.items()}
    return answer


def _answer(status: str, message: str) -> dict:
    return {
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


def make_server(host: str = "127.0.0.1", port: int = 8080, *, isolation: bool = True) -> ThreadingHTTPServer:
    """An HTTP server answering POST /run_code (call `serve_forever()`; port 0 picks a free one)."""
    Sandbox(isolation=isolation)  # refuse at start-up, not at the first request

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/run_code":
                return self._send(404, {"error": f"unknown path {self.path!r}; POST to /run_code"})
            try:
                length = int(self.headers.get("Content-Length", "0"))
                answer = run_code(json.loads(self.rfile.read(length)), isolation=isolation)
            except (RequestError, json.JSONDecodeError, ValueError) as e:
                return self._send(400, {"error": str(e)})
            self._send(200, answer)

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug(fmt, *args)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="SandboxFusion's run_code API on the local code sandbox")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--no-isolation",
        action="store_true",
        help="run without namespaces (no network/file-system isolation; limits still apply)",
    )
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port, isolation=not args.no_isolation)
    print(f"serving http://{args.host}:{server.server_address[1]}/run_code", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
