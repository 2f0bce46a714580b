"""A reward that runs the response's code against unit tests in the local code sandbox.

Use it as the custom reward function (`custom_reward_function.path` = this file,
`custom_reward_function.name=compute_score`; `custom_reward_function.reward_kwargs` may set
`isolation`, `wall_time_s`, `memory_mb`). The response's last ```python block is the program; the
row's ground truth gives the tests, either

- stdin/stdout cases {"inputs": [...], "outputs": [...]} (SandboxFusion's code datasets): each case
  runs the program once; it passes when the program exits 0 and prints the expected output
  (stripped); or
- test code {"tests": "assert f(2) == 4\\n..."} (or the test code as a plain string): the program
  followed by the tests runs once; it passes when it exits 0.

Score = passed / cases ("acc" = all passed); a response without a code block scores 0.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from hybridrl.reward.scorers.sandbox_fusion import extract_code
from hybridrl.sandbox import Sandbox, SandboxLimits

__all__ = ["compute_score", "score_with_sandbox"]

_SANDBOXES: dict[tuple, Sandbox] = {}
_LOCK = threading.Lock()


def _sandbox(isolation: bool, wall_time_s: float, memory_mb: int) -> Sandbox:
    key = (isolation, wall_time_s, memory_mb)
    with _LOCK:
        if key not in _SANDBOXES:
            limits = SandboxLimits(
                wall_time_s=wall_time_s, cpu_time_s=max(1, int(wall_time_s + 0.999)), memory_mb=memory_mb
            )
            _SANDBOXES[key] = Sandbox(limits, isolation=isolation)
        return _SANDBOXES[key]


def _tests(ground_truth: Any) -> tuple[list[str], list[str]] | str:
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            return ground_truth  # test code
    if isinstance(ground_truth, dict):
        if "tests" in ground_truth:
            return str(ground_truth["tests"])
        if "inputs" in ground_truth and "outputs" in ground_truth:
            inputs, outputs = list(ground_truth["inputs"]), list(ground_truth["outputs"])
            if len(inputs) == len(outputs):
                return inputs, outputs
    raise ValueError(
        "a code task's ground_truth must be test code, {'tests': code} or {'inputs': [...], 'outputs': [...]} "
        f"of equal length; got {str(ground_truth)[:200]!r}"
    )


def score_with_sandbox(sandbox: Sandbox, solution: str, ground_truth: Any) -> dict[str, Any]:
    """{"score": passed / cases, "acc": all passed} of one response."""
    tests = _tests(ground_truth)
    code = extract_code(solution)
    if code is None:
        return {"score": 0.0, "acc": False}
    if isinstance(tests, str):
        ok = [sandbox.run_python(code + "\n\n" + tests).ok]
    else:
        ok = [
            (r := sandbox.run_python(code, stdin=str(i))).ok and r.stdout.strip() == str(o).strip()
            for i, o in zip(*tests)
        ]
    if not ok:
        return {"score": 0.0, "acc": False}
    return {"score": sum(ok) / len(ok), "acc": all(ok)}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    isolation: bool = True,
    wall_time_s: float = 5.0,
    memory_mb: int = 1024,
) -> dict[str, Any]:
    """veRL's custom reward signature; the keyword arguments come from `custom_reward_function.reward_kwargs`."""
    return score_with_sandbox(
        _sandbox(bool(isolation), float(wall_time_s), int(memory_mb)), solution_str, ground_truth
    )
