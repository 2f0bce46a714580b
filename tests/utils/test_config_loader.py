"""The one structured-config loader: schema merge, did-you-mean, interpolation, typed result, one error type."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf

from hybridrl.trainer.async_ppo.config import load_async_config
from hybridrl.trainer.offline.evaluation import load_eval_config
from hybridrl.trainer.offline.generation import load_generation_config
from hybridrl.trainer.ppo.config import load_config
from hybridrl.trainer.sft.config import load_sft_config
from hybridrl.utils.config_loader import ConfigError, all_keys, check_override_keys, load_structured


@dataclass
class Inner:
    size: int = 4
    name: str = "x"


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    double: int = 0
    extra: dict = field(default_factory=dict)


def test_typed_result_with_interpolation_and_yaml_then_overrides(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("inner:\n  size: 7\n  name: from_yaml\ndouble: ${inner.size}\n")
    out = load_structured(Outer, ["inner.name=cli"], "c.yaml", yaml)
    assert isinstance(out, Outer) and isinstance(out.inner, Inner)
    assert (out.inner.size, out.inner.name, out.double) == (7, "cli", 7)
    assert load_structured(Outer, {"inner": {"size": 2}}, "c.yaml").inner.size == 2


def test_unknown_key_names_it_and_suggests_and_bad_type_names_the_key():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'inner\.sise'.*Did you mean inner\.size.*c\.yaml"
    ):
        load_structured(Outer, ["inner.sise=3"], "c.yaml")
    with pytest.raises(ConfigError, match=r"bad value for config key 'inner\.size'"):
        load_structured(Outer, ["inner.size=many"], "c.yaml")
    assert all_keys(OmegaConf.structured(Outer))[:3] == ["inner", "inner.size", "inner.name"]


def test_command_line_check_allows_free_form_nodes_and_hydra_options():
    check_override_keys(["extra.anything=1", "hydra.run.dir=.", "--multirun", "~inner.size"], Outer, "c.yaml")
    with pytest.raises(ConfigError, match="Did you mean double"):
        check_override_keys(["doubel=2"], Outer, "c.yaml")


@pytest.mark.parametrize(
    "load",
    [load_config, load_async_config, load_sft_config, load_generation_config, load_eval_config],
    ids=["ppo", "async", "sft", "generation", "eval"],
)
def test_every_entry_point_raises_the_same_error_type(load):
    with pytest.raises(
        ConfigError, match="unknown config key 'trainer.no_such_key'|unknown config key 'trainer'"
    ):
        load(["trainer.no_such_key=1"])


def test_main_ppo_command_line_suggests_the_key():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.trainer.main_ppo", "actor_rollout_ref.actor.ppo_mini_batch=2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "ConfigError: unknown config key 'actor_rollout_ref.actor.ppo_mini_batch'" in proc.stderr
    assert "Did you mean actor_rollout_ref.actor.ppo_mini_batch_size" in proc.stderr


def test_shared_schema_node_is_not_changed_by_loads(tmp_path):
    """The schema is built once per class (start-up cost) and shared: loads with a yaml, overrides
    and interpolations, and a full PPO load, must leave it equal to a freshly built one."""
    from hybridrl.trainer.ppo.config import PPOConfig
    from hybridrl.utils.config_loader import schema_node

    yaml = tmp_path / "c.yaml"
    yaml.write_text("inner:\n  size: 7\ndouble: ${inner.size}\nextra:\n  k: 1\n")
    first = load_structured(Outer, ["inner.name=a", "+extra.j=2"], "c.yaml", yaml)
    second = load_structured(Outer, ["double=3"], "c.yaml")
    assert (first.inner.name, first.double, first.extra, second.double, second.inner.name) == (
        "a", 7, {"k": 1, "j": 2}, 3, "x"
    )  # fmt: skip
    assert schema_node(Outer) is schema_node(Outer)
    assert OmegaConf.to_container(schema_node(Outer)) == OmegaConf.to_container(OmegaConf.structured(Outer))
    load_config(["trainer.total_training_steps=3", "actor_rollout_ref.actor.optim.lr=0.5"])
    assert OmegaConf.to_container(schema_node(PPOConfig)) == OmegaConf.to_container(
        OmegaConf.structured(PPOConfig)
    )
