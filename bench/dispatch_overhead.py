"""Overhead of the single-controller dispatch layer over plain Ray calls.

A no-op DP_COMPUTE_PROTO method on a 2-rank RayWorkerGroup gets a batch of B x T int64 tokens
(default 256 x 1024, 2 MiB) and returns its chunk. It is timed against plain
``ray.get([a.noop.remote(chunk) for ...])`` of the same pre-split payload to the same actors,
and against the plain call plus the chunk/concat the dispatch layer does. The three variants
run interleaved in one process so that machine noise hits them alike; medians are printed.

Run: python bench/dispatch_overhead.py [--iters 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.single_controller import Dispatch, Worker, register  # noqa: E402
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402


class NoopWorker(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def noop(self, data: DataProto) -> DataProto:
        return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool([2], use_gpu=False, cpus_per_slot=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NoopWorker), name_prefix="bench")
    actors = wg.workers
    data = DataProto.from_dict({"input_ids": torch.randint(0, 32000, (args.batch, args.seq_len))})
    chunks = data.chunk(wg.world_size)

    def dispatch_layer() -> None:
        wg.noop(data)

    def plain_ray() -> None:
        ray.get([a.noop.remote(c) for a, c in zip(actors, chunks)])

    def plain_ray_split_concat() -> None:
        DataProto.concat(ray.get([a.noop.remote(c) for a, c in zip(actors, data.chunk(len(actors)))]))

    out = wg.noop(data)
    assert torch.equal(out.batch["input_ids"], data.batch["input_ids"]), "round trip changed the data"

    variants = {
        "dispatch layer": dispatch_layer,
        "plain ray.get": plain_ray,
        "plain + chunk/concat": plain_ray_split_concat,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.warmup + args.iters):
        order = list(variants.items())
        order = order[i % len(order) :] + order[: i % len(order)]  # rotate: no variant always goes first
        for name, fn in order:
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)

    mib = data.batch["input_ids"].numel() * 8 / 2**20
    print(
        f"payload {args.batch} x {args.seq_len} int64 = {mib:.1f} MiB over 2 ranks, {args.iters} calls each"
    )
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, t in times.items():
        q = statistics.quantiles([x * 1e3 for x in t], n=10)
        print(f"  {name:22s} median {med[name]:7.3f} ms   p10 {q[0]:7.3f}   p90 {q[-1]:7.3f}")
    ratio = med["dispatch layer"] / med["plain ray.get"]
    print(f"dispatch layer / plain ray.get          = {ratio:.3f} (overhead {100 * (ratio - 1):+.1f}%)")
    print(
        f"dispatch layer / plain + chunk/concat   = {med['dispatch layer'] / med['plain + chunk/concat']:.3f}"
    )
    wg.shutdown()
    pool.remove()
    ray.shutdown()


if __name__ == "__main__":
    main()
