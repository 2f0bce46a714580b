"""A crafted torch.distributed.checkpoint `.metadata` must not run code.

A real DCP checkpoint is written with `dcp.save`; its `.metadata` is then replaced by a pickle
whose reduction calls `os.mkdir` (a visible side effect). model_merger's shard reader and the
trainer's pre-load check must refuse it, naming the file and the refused callable, and the
directory must not appear. Genuine metadata reads back equal to plain `pickle.load`.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridrl.trainer.offline.model_merger import load_sharded_state_dict
from hybridrl.utils.safe_dcp import check_dcp_tree, read_dcp_metadata
from hybridrl.utils.safe_io import UnsafeCheckpointError


class _MakesADirectory:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture
def shard_dir(tmp_path):
    path = str(tmp_path / "model")
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def test_genuine_metadata_reads_as_with_pickle(shard_dir):
    meta_file = os.path.join(shard_dir, ".metadata")
    with open(meta_file, "rb") as f:
        plain = pickle.load(f)
    assert repr(read_dcp_metadata(meta_file)) == repr(plain)
    assert check_dcp_tree(os.path.dirname(shard_dir)) == [meta_file]
    full = load_sharded_state_dict(shard_dir)
    assert torch.equal(full["w"], torch.arange(6.0).reshape(2, 3))


def test_crafted_metadata_is_refused_before_it_runs(shard_dir, tmp_path):
    marker = str(tmp_path / "code_ran")
    with open(os.path.join(shard_dir, ".metadata"), "wb") as f:
        pickle.dump(_MakesADirectory(marker), f)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*mkdir"):
        load_sharded_state_dict(shard_dir)
    with pytest.raises(UnsafeCheckpointError, match="mkdir"):
        check_dcp_tree(str(tmp_path))
    assert not os.path.exists(marker)


def test_truncated_metadata_is_reported(shard_dir):
    meta_file = os.path.join(shard_dir, ".metadata")
    with open(meta_file, "r+b") as f:
        f.truncate(20)
    with pytest.raises(UnsafeCheckpointError, match="not a readable DCP metadata file"):
        check_dcp_tree(shard_dir)
