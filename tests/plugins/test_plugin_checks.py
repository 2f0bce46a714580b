"""Registry-backed choices and `model.external_lib`: checked at the config stage, after the user's
modules are imported; the worker side of the import (hybridrl.utils.plugins); role_worker_mapping."""

from __future__ import annotations

import json
import sys

import pytest
from hydra import compose, initialize_config_module

from hybridrl.trainer.ppo.config import load_config
from hybridrl.trainer.ppo.plugin_checks import check_plugins
from hybridrl.trainer.ppo.roles import Role, check_trainer_cls, mapped_class
from hybridrl.trainer.ppo.trainer import RayPPOTrainer
from hybridrl.utils import plugins
from hybridrl.utils.config_loader import ConfigError


def _config(overrides=()):
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        return load_config(compose("ppo_trainer", overrides=list(overrides)))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module named `name` with `body` into a folder on sys.path; removed again after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, body: str) -> str:
        (tmp_path / f"{name}.py").write_text(body)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)
        plugins._imported.pop(name, None)


@pytest.fixture
def restore_registries():
    """Registries are per process: take out whatever a test registers (other tests walk every entry)."""
    from hybridrl.algos import advantage, agg, kl, policy_loss
    from hybridrl.engine import base as engine_base
    from hybridrl.reward import manager
    from hybridrl.rollout import base as rollout_base

    tables = [
        advantage.ADV_ESTIMATORS._entries,
        advantage._NEEDS_CRITIC,
        advantage._GROUPS_BY_PROMPT,
        policy_loss.POLICY_LOSSES._entries,
        kl.KL_ESTIMATORS._entries,
        agg.LOSS_AGG_MODES._entries,
        rollout_base._ROLLOUTS,
        manager._REGISTRY,
    ]
    saved = [t.copy() for t in tables]
    engines = list(engine_base.ENGINE_NAMES)
    modules_before = set(sys.modules)
    yield
    for table, before in zip(tables, saved):
        if isinstance(table, dict):
            # keep what hybridrl itself registered meanwhile (a built-in engine imported on first use):
            # entries whose defining module was first imported during the test. A user's name bound
            # to a hybridrl function (``register_adv_est("x")(grpo_fn)``) is not one of them.
            def _builtin(value) -> bool:
                module = getattr(value, "__module__", "") or ""
                return module.startswith("hybridrl.") and module not in modules_before

            builtin = {k: v for k, v in table.items() if k not in before and _builtin(v)}
            table.clear()
            table.update({**builtin, **before})
        else:
            table.clear()
            table.update(before)
    for name in [n for n in engine_base.ENGINE_NAMES if n not in engines]:
        engine_base.unregister_engine(name)


# (override, the key and one built-in name the message must show)
WRONG_NAMES = [
    (
        "algorithm.adv_estimator=nope",
        "algorithm.adv_estimator='nope' is not a registered advantage estimator",
        "grpo",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.loss_mode=nope",
        "policy_loss.loss_mode='nope' is not a registered policy loss",
        "vanilla",
    ),
    ("actor_rollout_ref.rollout.name=nope", "rollout.name='nope' is not a registered rollout engine", "'hf'"),
    (
        "actor_rollout_ref.actor.strategy=nope",
        "actor.strategy='nope' is not a registered training engine",
        "fsdp",
    ),
    ("model_engine=nope", "model_engine='nope' is not a registered training engine", "megatron"),
    (
        "actor_rollout_ref.actor.loss_agg_mode=nope",
        "loss_agg_mode='nope' is not a registered loss aggregation",
        "token-mean",
    ),
    ("reward_model.reward_manager=nope", "reward_manager='nope' is not a registered reward manager", "naive"),
]


@pytest.mark.parametrize(
    "override, message, known", WRONG_NAMES, ids=[w[0].split("=")[0] for w in WRONG_NAMES]
)
def test_wrong_name_lists_the_registered_names(override, message, known):
    with pytest.raises(ConfigError, match=message) as e:
        _config([override])
    assert known in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=nope"],
            "kl_loss_type='nope' is not a registered KL estimator; registered: .*low_var_kl",
        ),
        (
            ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=nope"],
            "kl_penalty='nope' is not a registered KL estimator; registered: .*low_var_kl",
        ),
    ],
)
def test_wrong_kl_estimator_lists_the_registered_names(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(overrides)


def test_wrong_agent_loop_and_tool_parser_list_the_registered_names():
    config = _config(["actor_rollout_ref.rollout.agent.default_agent_loop=nope"])
    with pytest.raises(ConfigError, match="default_agent_loop='nope'.*known: .*single_turn_agent"):
        check_plugins(config)
    config = _config(["actor_rollout_ref.rollout.multi_turn.format=nope"])
    with pytest.raises(ConfigError, match="multi_turn.format='nope'; known: .*hermes"):
        check_plugins(config)


def test_names_registered_by_external_lib_are_accepted(user_module, restore_registries):
    """Every registry a package may extend, from one module named on the actor's model section."""
    name = user_module(
        "cfg_user_plugins",
        """
from hybridrl.algos import get_adv_estimator_fn, get_kl_estimator_fn, get_policy_loss_fn
from hybridrl.algos import register_adv_est, register_kl_estimator, register_loss_agg, register_policy_loss
from hybridrl.algos.agg import LOSS_AGG_MODES
from hybridrl.engine.base import register_engine
from hybridrl.engine.fsdp import FSDPEngine
from hybridrl.reward.manager import get_reward_manager_cls, register_reward_manager
from hybridrl.rollout.base import register_rollout
from hybridrl.rollout.hf import HFRollout

register_adv_est("cfg_est")(get_adv_estimator_fn("grpo"))
register_policy_loss("cfg_loss")(get_policy_loss_fn("vanilla"))
register_kl_estimator("cfg_kl")(get_kl_estimator_fn("low_var_kl"))
register_loss_agg("cfg_agg")(LOSS_AGG_MODES.get("token-mean"))
register_rollout("cfg_rollout")(type("CfgRollout", (HFRollout,), {}))
register_engine("cfg_engine", type("CfgEngine", (FSDPEngine,), {}))
register_reward_manager("cfg_rm")(type("CfgRM", (get_reward_manager_cls("naive"),), {}))
""",
    )
    overrides = [
        "algorithm.adv_estimator=cfg_est",
        "actor_rollout_ref.actor.policy_loss.loss_mode=cfg_loss",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=cfg_kl",
        "actor_rollout_ref.actor.loss_agg_mode=cfg_agg",
        "actor_rollout_ref.rollout.name=cfg_rollout",
        "actor_rollout_ref.actor.strategy=cfg_engine",
        "reward_model.reward_manager=cfg_rm",
    ]
    with pytest.raises(ConfigError, match="is not a registered"):  # unknown without external_lib
        _config(overrides)
    config = _config([*overrides, f"actor_rollout_ref.model.external_lib=[{name}]"])
    a = config.actor_rollout_ref
    assert (config.algorithm.adv_estimator, a.rollout.name, a.actor.strategy) == (
        "cfg_est",
        "cfg_rollout",
        "cfg_engine",
    )
    assert plugins.worker_env() == {
        plugins.ENV_VAR: json.dumps([["actor_rollout_ref.model.external_lib", name]])
    }


def test_failed_external_lib_names_the_key_and_the_module(user_module):
    with pytest.raises(
        ConfigError, match=r"critic.model.external_lib='no_such_pkg_xyz': module 'no_such_pkg_xyz'"
    ):
        _config(["critic.model.external_lib=no_such_pkg_xyz"])
    broken = user_module("broken_user_pkg", "raise RuntimeError('needs FOO_TOKEN')\n")
    with pytest.raises(
        ConfigError, match=r"reward_model.model.external_lib='broken_user_pkg'.*RuntimeError: needs FOO_TOKEN"
    ):
        _config([f"reward_model.model.external_lib={broken}"])
    with pytest.raises(ConfigError, match="give one module name"):
        _config(["actor_rollout_ref.model.external_lib={a: 1}"])
    with pytest.raises(ImportError):  # also an ImportError, for callers that catch those
        plugins.import_external_libs([("model.external_lib", "no_such_pkg_xyz")])


def test_worker_imports_what_the_driver_hands_over(user_module, monkeypatch):
    good = user_module("handed_over_pkg", "LOADED = True\n")
    monkeypatch.setenv(plugins.ENV_VAR, json.dumps([["actor_rollout_ref.model.external_lib", good]]))
    plugins.setup_worker_process()
    assert sys.modules[good].LOADED
    missing = json.dumps([["critic.model.external_lib", "not_on_this_node_pkg"]])
    monkeypatch.setenv(plugins.ENV_VAR, missing)
    plugins.setup_worker_process()  # Ray's start-up hook keeps going: the constructor reports it
    with pytest.raises(ConfigError, match="critic.model.external_lib='not_on_this_node_pkg'.*in process"):
        plugins.import_worker_libs()
    from hybridrl.single_controller.base import Worker

    with pytest.raises(ConfigError, match="not_on_this_node_pkg"):  # every worker's constructor
        Worker()


def test_role_worker_mapping_is_checked():
    from hybridrl.workers.engine_workers import ActorRolloutRefWorker, CriticWorker

    class Mine(ActorRolloutRefWorker):
        pass

    assert mapped_class({Role.ActorRolloutRef: Mine}, Role.ActorRollout, ActorRolloutRefWorker) is Mine
    assert mapped_class({"actor_rollout": Mine}, Role.ActorRollout, ActorRolloutRefWorker) is Mine
    assert mapped_class({Role.ActorRollout: Mine}, Role.Critic, CriticWorker) is CriticWorker
    with pytest.raises(ConfigError, match=r"role_worker_mapping\[Role.Critic\].*subclass of .*CriticWorker"):
        mapped_class({Role.Critic: Mine}, Role.Critic, CriticWorker)
    with pytest.raises(ConfigError, match="unknown role 'actor'"):
        mapped_class({"actor": Mine}, Role.ActorRollout, ActorRolloutRefWorker)
    with pytest.raises(ConfigError, match="trainer_cls=.*subclass of .*RayPPOTrainer"):
        check_trainer_cls(dict, RayPPOTrainer)
