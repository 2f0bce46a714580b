"""Fixtures for the CPU speed-path tests: the rollout tests' tiny Qwen2 checkpoint and helpers.

The paths are tested on their own and inside the HF rollout that uses them, so this folder
shares tests/rollout's fixtures (loaded from its conftest under another name) and its
rollout_testlib helpers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_ROLLOUT_TESTS = Path(__file__).resolve().parent.parent / "rollout"
sys.path.insert(0, str(_ROLLOUT_TESTS))

_spec = importlib.util.spec_from_file_location("rollout_fixtures", _ROLLOUT_TESTS / "conftest.py")
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

tiny_model_dir = _fixtures.tiny_model_dir
tokenizer = _fixtures.tokenizer
source_model = _fixtures.source_model
