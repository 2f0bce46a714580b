"""Gathering the full weights out of FSDP2 shards: one all-gather per parameter vs one per bucket.

`--ranks` processes (gloo on CPU, one torch thread each) build the actor `FSDPEngine` of each model
size and time, alternating (A B C A B C ...), the median of `--repeats`:

* per-param:  `p.full_tensor()` for every parameter in turn (what `iter_full_params` did before);
* bucketed:   `FSDPEngine.iter_full_params()` (several parameters per collective);
* bucketed bf16: the same with dtype=bfloat16, cast before the gather (what a bf16 rollout asks).

    python bench/fsdp_gather.py [--ranks 2] [--sizes tiny,8m,30m] [--bucket-mb 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

for _k, _v in C.ONE_THREAD_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

from hybridrl.engine.full_params import GATHER_BUCKET_BYTES  # noqa: E402


def _per_param(engine) -> int:
    n = 0
    for _, p in engine.module.named_parameters():
        n += p.detach().full_tensor().numel()
    return n


def _bucketed(engine, bucket_bytes: int, dtype=None) -> int:
    return sum(t.numel() for _, t in engine.iter_full_params(dtype=dtype, bucket_bytes=bucket_bytes))


def _time_alternating(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _worker(rank: int, world: int, port: int, paths: dict, args) -> None:
    import torch.distributed as dist

    from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig, ModelConfig
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.utils.device import init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_process_group(rank=rank, world_size=world, timeout_s=300)
    bucket = int(args.bucket_mb * 2**20)
    for size, path in paths.items():
        fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
        engine = FSDPEngine.build(ModelConfig(path=path), fsdp, role="ref", load_tok=False)
        assert _per_param(engine) == _bucketed(engine, bucket)
        fns = {
            "per-param": lambda e=engine: _per_param(e),
            "bucketed": lambda e=engine: _bucketed(e, bucket),
            "bucketed bf16": lambda e=engine: _bucketed(e, bucket, torch.bfloat16),
        }
        med = _time_alternating(fns, args.repeats)
        if rank == 0:
            n_params = sum(1 for _ in engine.module.parameters())
            numel = sum(p.numel() for p in engine.module.parameters())
            cells = " | ".join(f"{C.fmt(s, 3)}" for s in med.values())
            ratio = med["per-param"] / med["bucketed"]
            print(f"| {size} | {numel / 1e6:.1f}M / {n_params} | {cells} | {ratio:.1f}x |", flush=True)
        del engine
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from rollout_generation import build_model_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="tiny,8m,30m")
    p.add_argument("--bucket-mb", type=float, default=GATHER_BUCKET_BYTES / 2**20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    C.print_header(f"FSDP2 full-weight gather, {args.ranks} gloo ranks (bench/fsdp_gather.py)")
    print(f"median of {args.repeats}, seconds per full gather; bucket {args.bucket_mb} MiB\n")
    print("| model | params / tensors | per-param s | bucketed s | bucketed bf16 s | per-param / bucketed |")
    print("|---|---|---|---|---|---|")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as root:
        paths = {size: build_model_dir(size, root)[0] for size in args.sizes.split(",")}
        mp.start_processes(
            _worker,
            args=(args.ranks, _free_port(), paths, args),
            nprocs=args.ranks,
            join=True,
            start_method="fork",
        )
    print(f"\nload average at the end: {[round(x, 2) for x in C.load_average()]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
