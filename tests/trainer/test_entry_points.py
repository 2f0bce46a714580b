"""The commands users type still exist after the layout change and print their help (docstring + yaml).

Each module runs as `python -m <module> --help` would (runpy, as __main__), in this process.
"""

from __future__ import annotations

import runpy
import sys

import pytest


@pytest.mark.parametrize(
    "module, expect",
    [
        ("hybridrl.trainer.main_ppo", "adv_estimator"),
        ("hybridrl.trainer.main_async", "max_head_offpolicyness"),
        ("hybridrl.trainer.main_sft", "partial_pretrain"),
        ("hybridrl.trainer.main_rm", "rejected_key"),
        ("hybridrl.trainer.main_dpo", "precompute_ref_log_probs"),
        ("hybridrl.trainer.main_generation", "n_samples"),
        ("hybridrl.trainer.main_eval", "reward_model_key"),
        ("hybridrl.model_merger", "{merge,test}"),
    ],
)
def test_command_prints_its_help(module, expect, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code in (0, None)
    assert expect in capsys.readouterr().out
