"""Code-execution rewards through a SandboxFusion service (`reward_model.sandbox_fusion.*`).

As in veRL, rows whose data source is a code task (`CODE_DATA_SOURCES`) are scored by running the
response's last ```python block once per test case on a SandboxFusion `run_code` endpoint
(`reward_model.sandbox_fusion.url`): POST JSON {code, stdin, language, run_timeout,
compile_timeout, memory_limit_MB, files, fetch_files}; a case passes when the response's
`status` is "Success", `run_result.status` "Finished", the return code 0 and stdout equals the
expected output (stripped). Score = passed / cases; "acc" = all passed. Other data sources keep
the built-in scorers.

At most `max_concurrent` requests are in flight per scoring process (a semaphore; the `prime`
manager scores in several processes, each with its own). Each request has a timeout
(compile + run + `api_timeout` s); a connection error, an HTTP error or a non-JSON answer is
retried `retries` times and then raises a RuntimeError naming the URL and the cause; nothing is
scored 0 because the service failed.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
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


class SandboxFusionClient:
    """HTTP client of one SandboxFusion `run_code` endpoint with a concurrency limit."""

    def __init__(self, settings: SandboxSettings) -> None:
        if settings.max_concurrent < 1:
            raise ValueError(
                f"reward_model.sandbox_fusion.max_concurrent must be >= 1, got {settings.max_concurrent}"
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
        for attempt in range(max(1, s.retries)):
            try:
                with (
                    self._slots,
                    urllib.request.urlopen(
                        request, timeout=s.compile_timeout + s.run_timeout + s.api_timeout
                    ) as resp,
                ):
                    return json.loads(resp.read().decode())
            except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as e:
                error = e
                time.sleep(min(0.2 * 2**attempt, 2.0))
        raise RuntimeError(
            f"SandboxFusion at reward_model.sandbox_fusion.url={s.url!r} failed {max(1, s.retries)} times: "
            f"{type(error).__name__}: {error}. Check that the service runs and the URL ends in /run_code"
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
    from hybridrl.workers.reward.scorers import default_compute_score

    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
