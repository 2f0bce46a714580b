"""ResumableSampler / RLDataLoader: order, epochs, and exact resumption."""

from __future__ import annotations

import pytest
import torch
from data_helpers import write_parquet
from torch.utils.data import Dataset

from hybridrl.data.rl_dataset import RLDataConfig, RLHFDataset, collate_fn
from hybridrl.data.sampler import ResumableSampler, RLDataLoader


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([i]), "tag": f"row{i}"}


def ids(batch) -> list[int]:
    return batch["x"][:, 0].tolist()


def make_loader(n=10, bs=3, shuffle=True, seed=7, drop_last=True) -> RLDataLoader:
    return RLDataLoader(
        Rows(n), bs, ResumableSampler(n, shuffle=shuffle, seed=seed), collate_fn, drop_last=drop_last
    )


def test_sequential_batches_and_len():
    loader = make_loader(n=5, bs=2, shuffle=False)
    assert len(loader) == 2
    assert [ids(b) for b in loader] == [[0, 1], [2, 3]]  # row 4 dropped
    assert loader.sampler.epoch == 1 and loader.sampler.position == 0
    loose = make_loader(n=5, bs=2, shuffle=False, drop_last=False)
    assert len(loose) == 3
    batches = [ids(b) for b in loose]
    assert batches == [[0, 1], [2, 3], [4]]
    assert list(next(iter(loose))["tag"]) == ["row0", "row1"]


def test_shuffle_is_seeded_per_epoch():
    a, b = ResumableSampler(20, True, 3), ResumableSampler(20, True, 3)
    assert a.epoch_order(0) == b.epoch_order(0)
    assert sorted(a.epoch_order(0)) == list(range(20))
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != ResumableSampler(20, True, 4).epoch_order(0)
    assert list(a) == a.epoch_order(0) and a.epoch == 1  # torch-Sampler iteration walks one epoch
    assert list(a) == a.epoch_order(1)


def test_epochs_cover_each_row_once():
    loader = make_loader(n=9, bs=3)
    for epoch in range(3):
        seen = [i for b in loader for i in ids(b)]
        assert sorted(seen) == list(range(9))
        assert seen == loader.sampler.epoch_order(epoch)


def test_resume_gives_identical_remaining_batches():
    epochs = 3
    uninterrupted = make_loader()
    reference = [ids(b) for _ in range(epochs) for b in uninterrupted]
    assert len(reference) == 9  # 10 rows, batch 3, drop_last: 3 batches per epoch

    # the trainer's loop shape: for epoch ...: for batch in loader; stop after 4 batches (mid epoch 1)
    first = make_loader()
    consumed = []
    for _ in range(epochs):
        for b in first:
            consumed.append(ids(b))
            if len(consumed) == 4:
                break
        if len(consumed) == 4:
            break
    state = first.state_dict()
    assert state["sampler"]["epoch"] == 1 and state["sampler"]["position"] == 3
    assert consumed == reference[:4]

    resumed = make_loader()
    resumed.load_state_dict(state)
    rest = [ids(b) for _ in range(resumed.sampler.epoch, epochs) for b in resumed]
    assert rest == reference[4:]


def test_state_after_last_batch_points_at_next_epoch():
    loader = make_loader(n=6, bs=3)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["sampler"]["epoch"] == 0
    next(it)  # last batch of epoch 0 handed out
    assert (loader.sampler.epoch, loader.sampler.position) == (1, 0)


def test_resume_with_real_rl_dataset(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "a.parquet", [{"prompt": "abcdefgh"[: i + 1], "k": i} for i in range(8)])
    ds = RLHFDataset(path, tokenizer, RLDataConfig(max_prompt_length=8))

    def loader():
        return RLDataLoader(ds, 2, ResumableSampler(len(ds), shuffle=True, seed=1), collate_fn)

    reference = [list(b["k"]) for b in loader()]
    first = loader()
    it = iter(first)
    head = [list(next(it)["k"]) for _ in range(2)]
    second = loader()
    second.load_state_dict(first.state_dict())
    assert head + [list(b["k"]) for b in second] == reference


def test_load_state_rejects_other_seed_or_length():
    state = make_loader(seed=7).state_dict()
    with pytest.raises(ValueError, match="seed"):
        make_loader(seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="data_len"):
        make_loader(n=11).load_state_dict(state)


def test_loader_errors():
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_loader(n=2, bs=3)
    with pytest.raises(ValueError, match="sampler covers"):
        RLDataLoader(Rows(4), 2, ResumableSampler(5, False, 0), collate_fn)
    with pytest.raises(ValueError, match="non-empty"):
        ResumableSampler(0, False, 0)
