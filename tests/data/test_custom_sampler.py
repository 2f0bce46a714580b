"""data.sampler (user / curriculum samplers) and data.dataloader_num_workers: order, curriculum
updates, and exact resumption."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from hybridrl.data.custom_sampler import (
    AbstractCurriculumSampler,
    RandomCurriculumSampler,
    SamplerConfig,
    build_custom_sampler,
)
from hybridrl.data.rl_dataset import collate_fn
from hybridrl.data.sampler import ResumableSampler, RLDataLoader

THIS_FILE = __file__


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([i]), "tag": f"row{i}"}


def ids(batch) -> list[int]:
    return batch["x"][:, 0].tolist()


class HardestFirst(AbstractCurriculumSampler):
    """A real curriculum: rows are served by descending failure count; `update(batch)` counts the
    batch's failures (odd rows "fail", and make every odd row harder), so the order depends on
    training."""

    def __init__(self, data_source, data_config):
        super().__init__(data_source, data_config)
        self.failures = [0] * len(data_source)
        self.queue: list[int] = []

    def __iter__(self):
        if not self.queue:
            self.queue = sorted(range(len(self.failures)), key=lambda i: (-self.failures[i], i))
        while self.queue:
            yield self.queue.pop(0)

    def __len__(self):
        return len(self.failures)

    def update(self, batch):
        for i in batch["x"][:, 0].tolist():
            if i % 2:  # an odd row failed: every odd row counts as harder now
                self.failures = [f + j % 2 for j, f in enumerate(self.failures)]
        # re-rank what is left of this epoch
        self.queue.sort(key=lambda i: (-self.failures[i], i))

    def state_dict(self):
        return {"failures": list(self.failures), "queue": list(self.queue)}

    def load_state_dict(self, state):
        self.failures, self.queue = list(state["failures"]), list(state["queue"])


def curriculum_loader(n=8, bs=2, name="HardestFirst", workers=0):
    cfg = SamplerConfig(class_path=THIS_FILE, class_name=name)
    sampler = build_custom_sampler(cfg, Rows(n), OmegaConf.create({"seed": 5}), workers)
    return RLDataLoader(Rows(n), bs, sampler, collate_fn, drop_last=True)


def run_steps(loader, it, k, update=True):
    out = []
    for _ in range(k):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        out.append(ids(batch))
        if update:
            loader.sampler.update(batch)
    return out, it


def test_curriculum_updates_reorder_and_resume_exactly():
    ref = curriculum_loader()
    it = iter(ref)
    first, it = run_steps(ref, it, 3)
    state = ref.state_dict()
    rest, _ = run_steps(ref, it, 6)  # crosses into epoch 2, ordered by the failures seen so far
    assert first == [[0, 1], [3, 5], [7, 2]]  # odd rows fail: they move ahead of the even ones
    no_update, _ = run_steps(curriculum_loader(), iter(curriculum_loader()), 3, update=False)
    assert no_update != first  # the updates changed the order

    resumed = curriculum_loader()
    resumed.load_state_dict(state)
    again, _ = run_steps(resumed, iter(resumed), 6)
    assert again == rest


def test_verl_example_sampler_alias_replays_exactly():
    cfg = SamplerConfig(
        class_path="pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu",
        class_name="RandomCurriculumSampler",
    )
    sampler = build_custom_sampler(cfg, Rows(7), OmegaConf.create({"seed": 3}), 0)
    assert isinstance(sampler.user, RandomCurriculumSampler)
    loader = RLDataLoader(Rows(7), 3, sampler, collate_fn, drop_last=True)
    it = iter(loader)
    first, it = run_steps(loader, it, 3)  # epoch 0: 2 batches, then epoch 1
    state = loader.state_dict()
    rest, _ = run_steps(loader, it, 3)
    fresh = build_custom_sampler(cfg, Rows(7), OmegaConf.create({"seed": 3}), 0)
    resumed = RLDataLoader(Rows(7), 3, fresh, collate_fn, drop_last=True)
    resumed.load_state_dict(state)
    again, _ = run_steps(resumed, iter(resumed), 3)
    assert again == rest
    assert first[0] + first[1] != first[2] + rest[0]  # epochs differ (seeded by epoch)


def test_sampler_config_errors_name_the_cause():
    with pytest.raises(ValueError, match="dataloader_num_workers=0"):
        curriculum_loader(workers=2)
    with pytest.raises(TypeError, match="not a torch Sampler"):
        curriculum_loader(name="Rows")
    with pytest.raises(ImportError, match="data.sampler.class_path='pkg://no_such_mod'"):
        build_custom_sampler(SamplerConfig("pkg://no_such_mod", "X"), Rows(3), {}, 0)
    with pytest.raises(ValueError, match="set both"):
        build_custom_sampler(SamplerConfig(None, "X"), Rows(3), {}, 0)


def test_worker_processes_give_the_same_batches_and_exact_state():
    """num_workers=2 prefetches ahead; the saved state is still "k batches handed out"."""

    def loader(workers):
        return RLDataLoader(Rows(11), 3, ResumableSampler(11, True, 9), collate_fn, True, num_workers=workers)

    plain, pooled = loader(0), loader(2)
    ref = [ids(b) for _ in range(2) for b in plain]
    it = iter(pooled)
    got = [ids(next(it)) for _ in range(2)]  # stop mid-epoch while workers have prefetched more
    state = pooled.state_dict()
    assert state["sampler"]["position"] == 6 and pooled.sampler.state_dict() != state["sampler"]  # ran ahead
    got += [ids(b) for b in it]  # the rest of epoch 0
    got += [ids(b) for b in pooled]  # epoch 1
    assert got == ref

    resumed = loader(2)
    resumed.load_state_dict(state)
    assert [ids(b) for b in resumed] == ref[2:3]
    # an abandoned iteration's prefetched batches are not skipped by the next one
    again = loader(2)
    it = iter(again)
    first = ids(next(it))
    del it
    assert [first] + [ids(b) for b in again] == ref[:3]
