"""Code-execution rewards through a SandboxFusion service (`reward_model.sandbox_fusion.*`).

As in veRL, rows whose data source is a code task (`CODE_DATA_SOURCES`) are scored by running the
response's last ```python block once per test case on a SandboxFusion `run_code` endpoint
(`reward_model.sandbox_fusion.url`): POST JSON {code, stdin, language, run_timeout,
compile_timeout, memory_limit_MB, files, fetch_files}; a case passes when the response's
`status` is "Success", `run_result.status` "Finished", the return code 0 and stdout equals the
expected output (stripped). Score = passed / cases; "acc" = all passed. Other data sources keep
the built-in scorers.

At most `max_concurrent` requests are in flight per scoring process (a semaphore; the `prime`
manager scores in several processes, each with its own). Each request has one total deadline
(compile + run + `api_timeout` s, for connecting, the headers and the whole body: a server that
trickles bytes ends at the deadline, plus at most one stalled read of that length) and an answer
larger than `max_response_bytes` is refused (not retried). A connection error, an HTTP error or a non-JSON answer is retried with exponential backoff
(0.5 s doubling to 16 s) for at least `retries` attempts and `retry_window_s` seconds (so a sandbox
that restarts is waited for), then raises a RuntimeError naming the URL and the cause; nothing is
scored 0 because the service failed. Only http:// and https:// URLs are accepted.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SandboxSettings:
    """What a scoring process needs to reach the service (picklable)."""

    url: str
    max_concurrent: int = 64
    memory_limit_mb: int = 1024
    run_timeout: float = 10.0
    compile_timeout: float = 10.0
    api_timeout: float = 10.0
    retries: int = 3
    retry_window_s: float = 60.0  # keep retrying (with backoff) at least this long: a sandbox restart
    max_response_bytes: int = 16 << 20


class SandboxFusionClient:
    """HTTP client of one SandboxFusion `run_code` endpoint with a concurrency limit."""

    def __init__(self, settings: SandboxSettings) -> None:
        if settings.max_concurrent < 1:
            raise ValueError(
                f"reward_model.sandbox_fusion.max_concurrent must be >= 1, got {settings.max_concurrent}"
            )
        scheme = urllib.parse.urlsplit(str(settings.url)).scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(
                f"reward_model.sandbox_fusion.url={settings.url!r} must be an http:// or https:// URL of the "
                "SandboxFusion run_code endpoint (e.g. http://localhost:8080/run_code)"
            )
        self.settings = settings
        self._slots = threading.BoundedSemaphore(settings.max_concurrent)

    def run_code(self, code: str, stdin: str = "", language: str = "python") -> dict[str, Any]:
        """The service's JSON answer for one run; RuntimeError after `retries` failed attempts."""
        s = self.settings
        body = json.dumps(
            {
                "code": code,
                "stdin": stdin,
                "language": language,
                "run_timeout": s.run_timeout,
                "compile_timeout": s.compile_timeout,
                "memory_limit_MB": s.memory_limit_mb,
                "files": {},
                "fetch_files": [],
            }
        ).encode()
        request = urllib.request.Request(
            s.url, data=body, headers={"Content-Type": "application/json", "Accept": "application/json"}
        )
        error: Exception | None = None
        start, attempt = time.monotonic(), 0
        while True:
            try:
                with self._slots:
                    return json.loads(self._post(request).decode())
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
                error = e
            attempt += 1
            elapsed = time.monotonic() - start
            if attempt >= max(1, s.retries) and elapsed >= s.retry_window_s:
                break
            time.sleep(min(0.5 * 2 ** (attempt - 1), 16.0))
        raise RuntimeError(
            f"SandboxFusion at reward_model.sandbox_fusion.url={s.url!r} failed {attempt} times in "
            f"{time.monotonic() - start:.0f} s: {type(error).__name__}: {error}. Check that the service runs "
            "and the URL ends in /run_code"
        )

    def _post(self, request: urllib.request.Request) -> bytes:
        """The answer's body, within one total deadline and at most `max_response_bytes`."""
        s = self.settings
        limit = s.compile_timeout + s.run_timeout + s.api_timeout
        deadline = time.monotonic() + limit
        body = bytearray()
        with urllib.request.urlopen(request, timeout=limit) as resp:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"the answer did not arrive within {limit:g} s (compile + run + api timeout)"
                    )
                chunk = resp.read1(65536)
                if not chunk:
                    return bytes(body)
                body += chunk
                if len(body) > s.max_response_bytes:
                    raise RuntimeError(
                        f"SandboxFusion at reward_model.sandbox_fusion.url={s.url!r} sent an answer larger than "
                        f"{s.max_response_bytes} bytes (SandboxSettings.max_response_bytes); it is not read further"
                    )


def extract_code(solution: str) -> str | None:
    """The last ```python block of a response (None: no code block)."""
    blocks = _CODE_BLOCK.findall(solution)
    return blocks[-1] if blocks else None


def _cases(ground_truth: Any) -> tuple[list[str], list[str]]:
    cases = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    if "inputs" not in cases or "outputs" not in cases or len(cases["inputs"]) != len(cases["outputs"]):
        raise ValueError(
            "a code task's ground_truth must hold test cases {'inputs': [...], 'outputs': [...]} of equal length"
        )
    return list(cases["inputs"]), list(cases["outputs"])


def passed(answer: dict[str, Any], expected: str) -> bool:
    run = answer.get("run_result") or {}
    return (
        answer.get("status") == "Success"
        and run.get("status") == "Finished"
        and run.get("return_code", 0) == 0
        and str(run.get("stdout", "")).strip() == str(expected).strip()
    )


def score_code(client: SandboxFusionClient, solution: str, ground_truth: Any) -> dict[str, Any]:
    """{"score": passed / cases, "acc": all passed} of one response."""
    inputs, outputs = _cases(ground_truth)
    code = extract_code(solution)
    if code is None or not inputs:
        return {"score": 0.0, "acc": False}
    ok = [passed(client.run_code(code, stdin), out) for stdin, out in zip(inputs, outputs)]
    return {"score": sum(ok) / len(ok), "acc": all(ok)}


_CLIENTS: dict[SandboxSettings, SandboxFusionClient] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(settings: SandboxSettings) -> SandboxFusionClient:
    """One client (one semaphore) per settings and process."""
    with _CLIENTS_LOCK:
        if settings not in _CLIENTS:
            _CLIENTS[settings] = SandboxFusionClient(settings)
        return _CLIENTS[settings]


def compute_score_with_sandbox(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    sandbox: SandboxSettings,
) -> float | dict:
    """The built-in scorers, with code data sources run on the sandbox (bind `sandbox` with functools.partial)."""
    if data_source in CODE_DATA_SOURCES:
        return score_code(client_for(sandbox), solution_str, ground_truth)
    from hybridrl.reward.scorers import default_compute_score

    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
