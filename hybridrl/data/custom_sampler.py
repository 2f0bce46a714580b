"""User samplers (veRL's `data.sampler.{class_path,class_name}`), curriculum updates, and their
exact resumption.

veRL's contract: the class is built as `cls(data_source=dataset, data_config=data)` and must be
an `AbstractSampler` (a torch `Sampler[int]`); an `AbstractCurriculumSampler` also has
`update(batch)`, which the trainer calls with the step's batch after every training step, so the
sampler can reorder what comes next. `class_path` is `pkg://dotted.module` or a Python file.

Resumption: `CustomSamplerAdapter` gives a user sampler the interface RLDataLoader draws from
(`take(n)`, epochs, `state_dict()`). Its state is (epoch, position in the epoch) plus the user
sampler's own `state_dict()` when it has one. On resume, a sampler with `load_state_dict`
restores itself (its iterator continues from where it was); any other sampler is replayed: the
epoch's iterator is rebuilt (after `set_epoch(epoch)` when the sampler has it) and `position`
indices are skipped, which is exact for samplers whose order depends only on their construction
and the epoch (seeded).

veRL's example `pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu` / `RandomCurriculumSampler`
(a test class of veRL's) resolves to hybridrl's `RandomCurriculumSampler` (seeded by `data.seed`).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

__all__ = [
    "AbstractCurriculumSampler",
    "AbstractSampler",
    "CustomSamplerAdapter",
    "RandomCurriculumSampler",
    "SamplerConfig",
    "build_custom_sampler",
    "load_sampler_class",
]

KEY = "data.sampler"
VERL_SAMPLER_ALIASES = {
    ("pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu", "RandomCurriculumSampler"): (
        "pkg://hybridrl.data.custom_sampler",
        "RandomCurriculumSampler",
    ),
}


@dataclass
class SamplerConfig:
    """`data.sampler`: a user sampler class (both null: hybridrl's resumable shuffle sampler)."""

    class_path: str | None = None  # file of a user sampler class (null: the resumable shuffle sampler)
    class_name: str | None = None  # name of that class


class AbstractSampler(Sampler[int]):
    """Base of user samplers: built with `(data_source, data_config)`."""

    def __init__(self, data_source: Sized, data_config: Any) -> None:
        self.data_source = data_source
        self.data_config = data_config


class AbstractCurriculumSampler(AbstractSampler):
    """A sampler that learns from training: `update(batch)` after every step (the step's DataProto)."""

    def update(self, batch: Any) -> None:
        raise NotImplementedError(f"{type(self).__qualname__}.update is not implemented")


class RandomCurriculumSampler(AbstractCurriculumSampler):
    """veRL's example curriculum sampler: a random order per epoch (seeded by `data.seed` and the
    epoch), `update` does nothing."""

    def __init__(self, data_source: Sized, data_config: Any) -> None:
        super().__init__(data_source, data_config)
        self.seed = int(_get(data_config, "seed", 0) or 0)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        return iter(rng.permutation(len(self.data_source)).tolist())

    def __len__(self) -> int:
        return len(self.data_source)

    def update(self, batch: Any) -> None:
        return None


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def load_sampler_class(class_path: str, class_name: str) -> type:
    """`pkg://dotted.module` or a file path, and a class name -> the class (errors name the keys)."""
    class_path, class_name = VERL_SAMPLER_ALIASES.get((class_path, class_name), (class_path, class_name))
    where = f"{KEY}.class_path={class_path!r}, {KEY}.class_name={class_name!r}"
    if class_path.startswith("pkg://"):
        try:
            module = importlib.import_module(class_path[len("pkg://") :])
        except ImportError as e:
            raise ImportError(f"{where}: cannot import the module: {e}") from e
    else:
        full = os.path.abspath(os.path.expanduser(class_path))
        if not os.path.isfile(full):
            raise FileNotFoundError(f"{where}: no such file (use pkg://dotted.module or a .py path)")
        spec = importlib.util.spec_from_file_location(f"hybridrl_sampler_{abs(hash(full))}", full)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, Sampler):
        raise TypeError(
            f"{where}: {class_name!r} is not a torch Sampler / AbstractSampler class in that module"
        )
    return cls


def build_custom_sampler(config: SamplerConfig, dataset: Sized, data_config: Any, num_workers: int):
    """The user sampler wrapped for RLDataLoader, or None when `data.sampler` is unset."""
    if config.class_path is None and config.class_name is None:
        return None
    if not (config.class_path and config.class_name):
        raise ValueError(f"set both {KEY}.class_path and {KEY}.class_name (or neither)")
    cls = load_sampler_class(config.class_path, config.class_name)
    sampler = cls(data_source=dataset, data_config=data_config)
    if hasattr(sampler, "update") and num_workers > 0:
        raise ValueError(
            f"{KEY}: a curriculum sampler (one with update(batch)) needs data.dataloader_num_workers=0 "
            f"(got {num_workers}): loader workers fetch batches ahead, before the sampler could reorder them"
        )
    return CustomSamplerAdapter(sampler, len(dataset))


class CustomSamplerAdapter:
    """A user sampler behind RLDataLoader's sampler interface, with exact state (module docstring).

    Args:
        sampler: the user's Sampler (iterable of row indices; `len` = indices per epoch).
        data_len: rows in the dataset.
    """

    def __init__(self, sampler: Any, data_len: int) -> None:
        self.user = sampler
        self.data_len = int(data_len)
        self.epoch = 0
        self.position = 0
        self._it: Iterator[int] | None = None
        self._skip = 0
        self._resumed_user_state = False  # the user sampler restored its own position

    @property
    def epoch_len(self) -> int:
        return len(self.user)

    def remaining(self) -> int:
        return self.epoch_len - self.position

    def _iterator(self) -> Iterator[int]:
        if self._it is None:
            if hasattr(self.user, "set_epoch") and not self._resumed_user_state:
                self.user.set_epoch(self.epoch)
            self._it = iter(self.user)
            for _ in range(self._skip):  # replay to the saved position
                next(self._it)
            self._skip = 0
        return self._it

    def take(self, n: int) -> list[int]:
        it, out = self._iterator(), []
        while len(out) < n and self.remaining() > 0:
            idx = int(next(it))
            if not 0 <= idx < self.data_len:
                raise IndexError(f"{KEY}: the sampler yielded index {idx}, outside [0, {self.data_len})")
            out.append(idx)
            self.position += 1
        self._resumed_user_state = False
        return out

    def start_next_epoch(self) -> None:
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._it, self._skip = int(epoch), 0, None, 0
        self._resumed_user_state = False

    def update(self, batch: Any) -> None:
        """Forward a training step's batch to a curriculum sampler (no-op for others)."""
        if hasattr(self.user, "update"):
            self.user.update(batch=batch)

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "position": self.position, "data_len": self.data_len}
        if hasattr(self.user, "state_dict"):
            state["user"] = copy.deepcopy(self.user.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("data_len", self.data_len) != self.data_len:
            raise ValueError(
                f"cannot resume {KEY}: checkpoint has data_len={state['data_len']}, this run has "
                f"{self.data_len}; use the same data files"
            )
        self.epoch, self.position, self._it = int(state["epoch"]), int(state["position"]), None
        if "user" in state and hasattr(self.user, "load_state_dict"):
            self.user.load_state_dict(copy.deepcopy(state["user"]))
            self._skip, self._resumed_user_state = 0, True
        else:
            self._skip, self._resumed_user_state = self.position, False
