"""The reward manager's keyword arguments, from hybridrl's keys and veRL's `reward_model.reward_kwargs`.

veRL passes `reward_model.reward_kwargs` to the reward manager's constructor (its recipes set
`+reward_model.reward_kwargs.overlong_buffer_cfg.*` and `max_resp_len` for `reward_manager=dapo`).
hybridrl's managers take their own options as keywords and forward the rest to the score function,
so the same dict works here. Keys that have a hybridrl spelling too are one setting:

    reward_model.reward_kwargs.overlong_buffer_cfg   <->  reward_manager_kwargs.overlong_buffer
    reward_model.reward_kwargs.num_workers / timeout <->  reward_manager_kwargs.num_workers / timeout
    reward_model.reward_kwargs.<score fn argument>   <->  custom_reward_function.reward_kwargs.<same>

Setting both spellings to different values is an error naming both keys.
`max_resp_len` (dapo) defaults to data.max_response_length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import OmegaConf

from hybridrl.trainer.ppo.sections import RewardManagerKwargs


@dataclass
class RewardManagerModule:
    path: str | None = None  # a .py file holding the class
    name: str = "custom_reward_manager"  # the class in that file


@dataclass
class RewardManagerSection:
    """veRL's newer top-level `reward_manager` section (beside the legacy `reward_model.reward_manager`).

    name: the registered manager; one setting with `reward_model.reward_manager` (null: that key's
      value; both set and different: an error). source: `register` (the registry) or `importlib`
      (the class `module.name` from the file `module.path`, a RewardManager subclass or any class with
      the same constructor and `__call__(data, return_dict=False)`).
    """

    source: str = "register"  # register (the registry) or importlib (reward_manager.module)
    name: str | None = None  # registered manager; null: reward_model.reward_manager
    module: RewardManagerModule = field(default_factory=RewardManagerModule)


def link_reward_manager(config: Any, explicit_keys) -> None:
    """Make `reward_manager.name` and `reward_model.reward_manager` one value; check `source`."""
    section, legacy = config.reward_manager, config.reward_model
    if section.source not in ("register", "importlib"):
        raise ValueError(f"reward_manager.source={section.source!r} is not one of register, importlib")
    if section.source == "importlib" and not section.module.path:
        raise ValueError("reward_manager.source=importlib needs reward_manager.module.path (a .py file)")
    legacy_set = explicit_keys is None or "reward_model.reward_manager" in explicit_keys
    if section.name is not None and legacy_set and section.name != legacy.reward_manager:
        raise ValueError(
            f"reward_manager.name={section.name!r} and reward_model.reward_manager={legacy.reward_manager!r} "
            "disagree; set one of them (reward_manager.name is veRL's newer spelling)"
        )
    if section.name is not None:
        legacy.reward_manager = section.name
    section.name = legacy.reward_manager


def reward_manager_class(config: Any) -> type | None:
    """The class named by `reward_manager.source=importlib` (None: use the registry)."""
    section = config.reward_manager
    if section.source != "importlib":
        return None
    from hybridrl.utils.import_utils import import_user_file

    module = import_user_file(
        section.module.path, "reward_manager.module.path", prefix="hybridrl_reward_manager"
    )
    cls = getattr(module, section.module.name, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"reward_manager.module.name={section.module.name!r} is not a class in {section.module.path}"
        )
    return cls


# veRL's key in reward_kwargs -> (hybridrl's key, the reward manager that reads it)
SPELLINGS = {
    "overlong_buffer_cfg": ("reward_manager_kwargs.overlong_buffer", "dapo"),
    "num_workers": ("reward_manager_kwargs.num_workers", "prime"),
    "timeout": ("reward_manager_kwargs.timeout", "prime"),
}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _hybridrl_values(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """({veRL key: value of its hybridrl spelling}, {veRL key: that spelling's default})."""
    kw, default = config.reward_manager_kwargs, RewardManagerKwargs()
    ours = {
        "overlong_buffer_cfg": asdict(kw.overlong_buffer),
        "num_workers": kw.num_workers,
        "timeout": kw.timeout,
    }
    base = {
        "overlong_buffer_cfg": asdict(default.overlong_buffer),
        "num_workers": default.num_workers,
        "timeout": default.timeout,
    }
    return ours, base


def _merge_overlong(given: dict, ours: dict, base: dict, manager: str) -> dict:
    """reward_kwargs.overlong_buffer_cfg over reward_manager_kwargs.overlong_buffer, field by field."""
    bad = sorted(set(given) - set(base))
    if bad:
        raise ValueError(
            f"reward_model.reward_kwargs.overlong_buffer_cfg has unknown keys {bad}; known: {list(base)}"
        )
    if manager != "dapo":
        raise ValueError(
            f"reward_model.reward_kwargs.overlong_buffer_cfg is an option of reward_manager=dapo, not of {manager}"
        )
    merged = dict(ours)
    for field_name, value in given.items():
        if ours[field_name] != base[field_name] and ours[field_name] != value:
            raise ValueError(
                f"reward_model.reward_kwargs.overlong_buffer_cfg.{field_name}={value!r} and "
                f"reward_manager_kwargs.overlong_buffer.{field_name}={ours[field_name]!r} disagree; set one of them"
            )
        merged[field_name] = value
    return merged


def reward_manager_kwargs(config: Any) -> dict[str, Any]:
    """Keyword arguments for `load_reward_manager` (besides reward_fn_key); ValueError on a conflict."""
    name = config.reward_model.reward_manager
    ours, base = _hybridrl_values(config)
    out: dict[str, Any] = {}
    if name == "prime":
        out = {"num_workers": ours["num_workers"], "timeout": ours["timeout"]}
    elif name == "dapo":
        out = {
            "max_resp_len": config.data.max_response_length,
            "overlong_buffer_cfg": ours["overlong_buffer_cfg"],
        }
    crf = config.custom_reward_function
    bound = (_plain(crf.reward_kwargs) or {}) if crf.path else {}  # bound to the custom score function
    for key, value in (_plain(config.reward_model.reward_kwargs) or {}).items():
        where = f"reward_model.reward_kwargs.{key}={value!r}"
        if key == "overlong_buffer_cfg":
            out[key] = _merge_overlong(dict(value or {}), ours[key], base[key], name)
        elif key in SPELLINGS:
            other, manager = SPELLINGS[key]
            if ours[key] != base[key] and ours[key] != value:
                raise ValueError(f"{where} and {other}={ours[key]!r} disagree; set one of them")
            if name != manager:
                raise ValueError(f"{where} is an option of reward_manager={manager}, not of {name}")
            out[key] = value
        elif key == "max_resp_len":
            out[key] = value
        elif key in bound:
            if bound[key] != value:
                raise ValueError(
                    f"{where} and custom_reward_function.reward_kwargs.{key}={bound[key]!r} disagree; set one"
                )
        else:
            out[key] = value  # an argument of the score function, passed on every call
    return out
