"""Weight sync with rollout tensor parallelism: 2 processes (one core each, gloo), per rank.

The source is what the hybrid engine syncs from: an FSDP2 model sharded over both ranks. Per
rank and repeat, alternating in one run: a memcpy of the full model's bytes (preallocated
destination), the bucketed all-gather alone (`iter_full_params`, tensors dropped), and the whole
sync (gather + the vLLM engine's loaders keeping this rank's slice). Engines: TP=2 (one engine
over both ranks) and then, in the same processes, TP=1 (one engine per rank). Best of --repeats.
Used by ``bench/weight_sync.py --tp 2``.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rank_main(rank: int, path: str, dtype_name: str, repeats: int, port: int, queue) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    import dataclasses
    from types import SimpleNamespace

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybridrl.engine.full_params import iter_full_params
    from hybridrl.models.weight_map import to_torch_dtype
    from hybridrl.rollout import RolloutConfig, create_rollout
    from hybridrl.weight_sync import sync_weights

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    dtype = to_torch_dtype(dtype_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    full = [p.detach().clone() for p in model.parameters()]
    dst = [torch.empty_like(t) for t in full]
    nbytes = sum(t.numel() * t.element_size() for t in full)
    _shard(model)

    def memcpy() -> None:
        for d, s in zip(dst, full):
            d.copy_(s)

    def gather_only() -> None:
        for _ in iter_full_params(model, dtype=dtype):
            pass

    cfg = RolloutConfig(
        name="vllm",
        dtype=dtype_name,
        prompt_length=16,
        response_length=16,
        load_format="dummy",
        max_num_seqs=8,
    )
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    rows = []
    for tp in (2, 1):
        rollout = create_rollout(dataclasses.replace(cfg, tensor_model_parallel_size=tp), path, tok)
        sync_weights(rollout, iter_full_params(model, dtype=dtype))  # warm-up
        times: dict[str, list[float]] = {"memcpy": [], "gather": [], "sync": []}
        for _ in range(repeats):  # alternate the three in one run (the machine is shared and noisy)
            dist.barrier()
            times["memcpy"].append(_timed(memcpy))
            dist.barrier()
            times["gather"].append(_timed(gather_only))
            dist.barrier()
            times["sync"].append(
                _timed(lambda r=rollout: sync_weights(r, iter_full_params(model, dtype=dtype)))
            )
        rollout.shutdown()
        rows.append(
            {"tp": tp, "rank": rank, "mbytes": nbytes / 2**20, **{k: min(v) for k, v in times.items()}}
        )
    queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run_tp_rows(path: str, dtype_name: str, repeats: int) -> list[dict]:
    """Per-rank rows ({"tp", "rank", "mbytes", "memcpy", "gather", "sync"} seconds) for one model."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, path, dtype_name, repeats, port, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    rows = [row for _ in procs for row in queue.get(timeout=1800)]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a TP bench rank exited with {p.exitcode}")
    return sorted(rows, key=lambda r: (-r["tp"], r["rank"]))


def print_tp_rows(size: str, params_m: float, rows: list[dict]) -> None:
    for r in rows:
        print(
            f"{size:6s} {params_m:7.1f}M tp={r['tp']} rank={r['rank']} {r['mbytes']:7.1f} MiB  memcpy {r['memcpy']:.4f}s"
            f"  gather {r['gather']:.4f}s ({r['gather'] / r['memcpy']:.1f}x)  sync {r['sync']:.4f}s"
            f" ({r['sync'] / r['memcpy']:.1f}x memcpy)",
            flush=True,
        )
