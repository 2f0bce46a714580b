"""Rollout parallel layout helpers: meshes, the start-up checks' messages, loaders, core binding,
and the TP prompt check over a real 2-rank gloo group."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest
import torch

from hybridrl.rollout.parallel import (
    check_rollout_parallel_config,
    validate_rollout_parallel,
    weight_loader_for,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rollout_mesh(world: int, tp: int):
    from hybridrl.workers.parallel_dims import ParallelDims

    return ParallelDims(world, rollout_tp=tp).rollout_mesh()


def training_mesh(world: int, fsdp_size: int = -1):
    from hybridrl.workers.parallel_dims import ParallelDims

    return ParallelDims(world, fsdp=fsdp_size).train_mesh()


def test_rollout_mesh_groups_adjacent_ranks_like_vllm():
    m = rollout_mesh(8, 2)
    assert m.sizes == {"dp": 4, "tp": 2}
    assert m.groups(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [m.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r for r in range(8) if m.is_collector(r)] == [0, 2, 4, 6]


def test_training_mesh_is_data_parallel_over_every_rank():
    assert training_mesh(4).dp_size == 4 and training_mesh(4).sizes == {"ddp": 1, "fsdp": 4}
    hsdp = training_mesh(4, fsdp_size=2)
    assert hsdp.sizes == {"ddp": 2, "fsdp": 2} and hsdp.dp_size == 4


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            (2, 2, "hf", 2, 2),
            r"rollout.name=hf.*use rollout.name=vllm.*or set .*tensor_model_parallel_size=1",
        ),
        ((3, 2, "vllm", 2, 2), r"=3 does not divide the 2 ranks.*use one of \[1, 2\]"),
        ((3, 3, "vllm", 2, 2), r"=3 does not divide the model's 2 attention heads.*use one of \[1\]"),
        ((4, 8, "vllm", 8, 2), r"=4 does not divide the model's 2 KV heads.*use one of \[1, 2\]"),
    ],
)
def test_bad_tp_messages_name_the_numbers_and_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        validate_rollout_parallel(*args)


def test_good_tp_passes():
    validate_rollout_parallel(1, 1, "hf", 2, 2)
    validate_rollout_parallel(2, 4, "vllm", 8, 4)
    validate_rollout_parallel(2, 2, "sglang", None, None)


def test_heads_are_read_from_the_model_folder():
    with pytest.raises(ValueError, match="2 attention heads"):
        check_rollout_parallel_config(
            tp=4, world_size=4, engine="vllm", load_format="auto", strategy="fsdp", model_path="builtin:tiny"
        )


@pytest.mark.parametrize(
    ("load_format", "strategy", "loader"),
    [
        ("dummy_dtensor", "fsdp", "dtensor"),
        ("dummy", "fsdp", "dtensor"),
        ("auto", "fsdp2", "dtensor"),
        ("safetensors", "fsdp", "dtensor"),
        ("dummy_hf", "fsdp", "hf"),
        ("hf", "fsdp", "hf"),
        ("dummy_megatron", "megatron", "megatron"),
        ("auto", "megatron", "megatron"),
    ],
)
def test_load_format_picks_the_loader(load_format, strategy, loader):
    assert weight_loader_for(load_format, strategy) == loader


def test_mismatched_loader_and_strategy_are_refused():
    with pytest.raises(
        ValueError, match="dummy_megatron syncs from a Megatron actor.*use load_format=dummy_dtensor"
    ):
        weight_loader_for("dummy_megatron", "fsdp")
    with pytest.raises(ValueError, match="dummy_dtensor is an FSDP loader.*dummy_megatron"):
        weight_loader_for("dummy_dtensor", "megatron")


def _bind_in_child(local_rank, queue):
    from hybridrl.rollout.parallel import bind_cpu_cores

    cores = bind_cpu_cores(local_rank, 2, 1)
    queue.put((cores, sorted(os.sched_getaffinity(0)), os.environ["VLLM_CPU_OMP_THREADS_BIND"]))


def test_bind_cpu_cores_pins_each_rank_to_its_own_core():
    allowed = sorted(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")  # binding must not touch the test process
    results = []
    for local_rank in (0, 1):
        q = ctx.Queue()
        p = ctx.Process(target=_bind_in_child, args=(local_rank, q))
        p.start()
        results.append(q.get(timeout=60))
        p.join()
    if len(allowed) >= 2:
        assert results == [
            ([allowed[0]], [allowed[0]], str(allowed[0])),
            ([allowed[1]], [allowed[1]], str(allowed[1])),
        ]
    else:
        assert results[0][1] == results[1][1] == allowed
    assert sorted(os.sched_getaffinity(0)) == allowed


def _same_rows_checks(rank, world):
    import torch.distributed as dist

    from hybridrl.rollout.parallel import check_same_rows

    ids = torch.arange(6).view(2, 3)
    mask = torch.ones_like(ids)
    check_same_rows(ids, mask, dist.group.WORLD, "gen")  # identical: passes
    with pytest.raises(
        RuntimeError, match="gen: the ranks of one tensor-parallel engine received different prompts"
    ):
        check_same_rows(ids + rank, mask, dist.group.WORLD, "gen")


def test_tp_ranks_with_different_prompts_fail_loudly(tmp_path):
    from fsdp_testkit import spawn

    spawn(_same_rows_checks, 2, tmp_path)


def test_hf_engine_refuses_tp_when_built_directly(tmp_path):
    from rollout_testlib import make_tiny_qwen2

    from hybridrl.rollout import RolloutConfig, create_rollout

    _, tok = make_tiny_qwen2(str(tmp_path))
    cfg = RolloutConfig(
        name="hf", dtype="float32", prompt_length=8, response_length=4, tensor_model_parallel_size=2
    )
    with pytest.raises(ValueError, match="rollout.name=hf.*use rollout.name=vllm"):
        create_rollout(cfg, str(tmp_path), tok, device="cpu")
