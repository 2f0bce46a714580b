"""A user's plug-in package, written by the tests to a folder outside hybridrl.

It registers one plug-in of each kind, each a working implementation that wraps the built-in one
and records, once per process, that it ran (what, pid, the Ray worker group) in `ran.jsonl` next
to the package. The import itself is recorded too: it shows which processes imported the package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PACKAGE = "hrl_user_plugins"

SOURCE = '''
"""Plug-ins of a user's own (registered when this package is imported)."""
import json
import os

from hybridrl.algos import get_adv_estimator_fn, get_policy_loss_fn, register_adv_est, register_policy_loss
from hybridrl.engine.base import register_engine
from hybridrl.engine.fsdp import FSDPEngine
from hybridrl.rollout.base import register_rollout
from hybridrl.rollout.hf import HFRollout

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran.jsonl")
_seen = set()


def record(what):
    if what in _seen:
        return
    _seen.add(what)
    row = {"what": what, "pid": os.getpid(), "group": os.environ.get("HYBRIDRL_WORKER_GROUP")}
    with open(LOG, "a") as f:
        f.write(json.dumps(row) + "\\n")


record("import")
_grpo = get_adv_estimator_fn("grpo")
_vanilla = get_policy_loss_fn("vanilla")


@register_adv_est("user_grpo")
def user_grpo(token_level_rewards, response_mask, *, index, **kwargs):
    record("adv_estimator")
    return _grpo(token_level_rewards, response_mask, index=index, **kwargs)


@register_policy_loss("user_pg")
def user_pg(old_log_prob, log_prob, advantages, response_mask, **kwargs):
    record("policy_loss")
    return _vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs)


@register_rollout("user_hf")
class UserRollout(HFRollout):
    def _generate(self, request):
        record("rollout")
        return super()._generate(request)


class UserEngine(FSDPEngine):
    def forward_backward(self, micros, request, loss_fn):
        record("engine")
        return super().forward_backward(micros, request, loss_fn)


register_engine("user_dp", UserEngine)
'''


def write_package(root: Path) -> Path:
    """Write the package under `root` (a folder to put on PYTHONPATH); returns its ran.jsonl path."""
    pkg = root / PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(SOURCE)
    return pkg / "ran.jsonl"


def read_records(path: Path) -> list[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
