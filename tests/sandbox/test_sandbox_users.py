"""The sandbox's users: SandboxFusion's run_code API (served over HTTP, read by hybridrl's own
SandboxFusion client), the code_interpreter tool and the unit-test reward."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import urllib.error
import urllib.request

import pytest

from hybridrl.sandbox import Sandbox, SandboxUnavailable
from hybridrl.sandbox.fusion import RequestError, make_server, run_code

SOLUTION = "Here:\n```python\nn = int(input())\nprint(n * n)\n```"


@pytest.fixture(scope="module")
def server():
    try:
        Sandbox()
    except SandboxUnavailable as e:
        pytest.skip(f"namespaces refused on this machine: {e}")
    srv = make_server("127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/run_code"
    srv.shutdown()


def test_run_code_answers_in_sandbox_fusions_shape():
    files = {"data.txt": base64.b64encode(b"7").decode()}
    code = "print(int(open('data.txt').read()) + int(input()))\nopen('o.txt', 'w').write('x')"
    a = run_code({"code": code, "stdin": "5", "language": "python", "files": files, "fetch_files": ["o.txt"]})
    assert a["status"] == "Success" and a["run_result"]["status"] == "Finished"
    assert a["run_result"]["stdout"] == "12\n" and a["run_result"]["return_code"] == 0
    assert base64.b64decode(a["files"]["o.txt"]) == b"x"
    slow = run_code({"code": "import time\ntime.sleep(30)", "run_timeout": 1})
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    assert run_code({"code": "x", "language": "cpp"})["status"] == "SandboxError"
    with pytest.raises(RequestError, match="unknown request fields"):
        run_code({"code": "print(1)", "timeout": 3})
    with pytest.raises(RequestError, match="relative paths"):
        run_code({"code": "print(1)", "files": {"/etc/x": base64.b64encode(b"1").decode()}})


def test_sandbox_fusion_client_scores_against_the_local_server(server):
    from hybridrl.reward.scorers.sandbox_fusion import SandboxSettings, compute_score_with_sandbox

    settings = SandboxSettings(server, max_concurrent=2, run_timeout=5)
    truth = json.dumps({"inputs": ["3", "4"], "outputs": ["9", "16"]})
    assert compute_score_with_sandbox("codecontests", SOLUTION, truth, sandbox=settings) == {
        "score": 1.0,
        "acc": True,
    }
    half = json.dumps({"inputs": ["3", "4"], "outputs": ["9", "15"]})
    assert compute_score_with_sandbox("codecontests", SOLUTION, half, sandbox=settings) == {
        "score": 0.5,
        "acc": False,
    }
    request = urllib.request.Request(server, data=b'{"cod": 1}', headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400


def test_unit_test_reward():
    from hybridrl.reward.scorers.code_tests import compute_score

    tests = "assert square(3) == 9\nassert square(-2) == 4"
    good = "```python\ndef square(x):\n    return x * x\n```"
    bad = "```python\ndef square(x):\n    return x + x\n```"
    assert compute_score("code", good, {"tests": tests}) == {"score": 1.0, "acc": True}
    assert compute_score("code", bad, tests) == {"score": 0.0, "acc": False}
    assert compute_score("code", "no code here", tests) == {"score": 0.0, "acc": False}
    cases = {"inputs": ["3", "5"], "outputs": ["9", "25"]}
    assert compute_score("code", SOLUTION, cases) == {"score": 1.0, "acc": True}
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("code", good, {"inputs": ["1"]})


def test_code_interpreter_tool():
    from hybridrl.tools.code_tool import CodeSandboxTool

    tool = CodeSandboxTool({"default_timeout": 2, "memory_limit_mb": 512})
    assert tool.name == "code_interpreter"

    async def calls():
        iid = await tool.create()
        ok = await tool.execute(iid, {"code": "print(sum(range(10)))"})
        slow = await tool.execute(iid, {"code": "while True: pass"})
        return ok, slow

    (ok, reward, metrics), (slow, _, slow_metrics) = asyncio.run(calls())
    assert ok.text == "45\n" and reward == 0.0 and metrics["status"] == "Finished"
    assert "[TimeLimitExceeded]" in slow.text and slow_metrics["status"] == "TimeLimitExceeded"
    with pytest.raises(ValueError, match="sandbox_fusion_url"):
        CodeSandboxTool({"sandbox_fusion_url": "http://x/run_code"})
    with pytest.raises(ValueError, match="unknown keys"):
        CodeSandboxTool({"timeout": 3})
