"""reward_model.sandbox_fusion: code rewards from a SandboxFusion `run_code` service.

The service here is a real HTTP server started in the test that speaks SandboxFusion's protocol
and really runs the posted Python with the given stdin (a subprocess with a timeout); it counts the
requests in flight so the client's concurrency limit can be checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridrl.reward.scorers.sandbox_fusion import (
    SandboxFusionClient,
    SandboxSettings,
    compute_score_with_sandbox,
    score_code,
)


class RunCode(BaseHTTPRequestHandler):
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with RunCode.lock:
            RunCode.in_flight += 1
            RunCode.peak = max(RunCode.peak, RunCode.in_flight)
        try:
            time.sleep(0.05)  # let concurrent requests overlap
            proc = subprocess.run(
                [sys.executable, "-c", req["code"]],
                input=req["stdin"],
                capture_output=True,
                text=True,
                timeout=req["run_timeout"],
            )
            run = {
                "status": "Finished",
                "stdout": proc.stdout,
                "stderr": proc.stderr,
                "return_code": proc.returncode,
            }
            answer = {"status": "Success" if proc.returncode == 0 else "Failed", "run_result": run}
        finally:
            with RunCode.lock:
                RunCode.in_flight -= 1
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RunCode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/run_code"
    server.shutdown()


CASES = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3", "12"]}
RIGHT = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
HALF = "```python\na, b = map(int, input().split())\nprint(3 if a == 1 else a * b)\n```"


def test_code_rows_run_on_the_sandbox_and_others_keep_the_builtin_scorers(url):
    s = SandboxSettings(url, max_concurrent=4)
    assert compute_score_with_sandbox("codecontests", RIGHT, json.dumps(CASES), sandbox=s) == {
        "score": 1.0,
        "acc": True,
    }
    assert compute_score_with_sandbox("apps", HALF, CASES, sandbox=s) == {"score": 0.5, "acc": False}
    assert compute_score_with_sandbox("taco", "no code here", CASES, sandbox=s)["score"] == 0.0
    assert compute_score_with_sandbox("openai/gsm8k", "#### 7", "7", sandbox=s) == 1.0


def test_requests_in_flight_never_exceed_max_concurrent(url):
    client = SandboxFusionClient(SandboxSettings(url, max_concurrent=2))
    RunCode.peak = 0
    with ThreadPoolExecutor(8) as pool:
        scores = list(pool.map(lambda _: score_code(client, RIGHT, CASES)["score"], range(8)))
    assert scores == [1.0] * 8
    assert 1 <= RunCode.peak <= 2


def test_an_unreachable_service_is_a_clear_error():
    client = SandboxFusionClient(
        SandboxSettings("http://127.0.0.1:9/run_code", retries=2, api_timeout=1, retry_window_s=0)
    )
    with pytest.raises(RuntimeError, match="sandbox_fusion.url='http://127.0.0.1:9/run_code' failed 2 times"):
        score_code(client, RIGHT, CASES)


def test_the_config_key_routes_code_rows_of_the_reward_manager_to_the_sandbox(url, tmp_path):
    import numpy as np

    from hybridrl.models.tokenizer_builder import build_tokenizer
    from hybridrl.trainer.ppo.config import ConfigError
    from hybridrl.trainer.ppo.setup import build_reward_fns
    from tests.trainer.test_reward_keys import _check, batch_of

    tok = build_tokenizer()
    data = batch_of(tok, ["```python\nprint(int(input()) * 2)\n```"], t=64)
    data.non_tensor_batch["data_source"] = np.array(["codecontests"], dtype=object)
    data.non_tensor_batch["reward_model"] = np.array(
        [{"ground_truth": {"inputs": ["2\n", "5\n"], "outputs": ["4", "10"]}}], dtype=object
    )
    reward = build_reward_fns(_check([f"reward_model.sandbox_fusion.url={url}"]), tok)[0](data)
    assert reward.sum() == 1.0
    with pytest.raises(RuntimeError, match="no built-in reward function for data_source .codecontests."):
        build_reward_fns(_check([]), tok)[0](data)
    f = tmp_path / "r.py"
    f.write_text("def compute_score(**kw):\n    return 0.0\n")
    with pytest.raises(ConfigError, match="sandbox_fusion.url is used by the built-in code scorer"):
        _check([f"reward_model.sandbox_fusion.url={url}", f"custom_reward_function.path={f}"])
