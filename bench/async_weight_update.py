"""main_async's weight-update time, collective vs object store, alternating in one run.

    python bench/async_weight_update.py [--model 30m] [--workers 1,2] [--rounds 5]
    python bench/async_weight_update.py --tp 2 [--model 30m] [--rounds 5]

Real workers as main_async starts them (hybridrl/trainer/async_ppo/trainer.py
`start_async_workers`): one FSDP trainer slot and `--workers` HF rollout workers in their own
pool, one thread each. One update = the path main_async takes for every step
(hybridrl/weight_sync/publisher.py): publish version v, then wait until every rollout
worker has loaded it (`load_weights`) and the training ranks are done. Both paths include the
gather on the trainer. The two modes alternate (object store, collective, object store, ...)
after one warm-up each; prints the median seconds per update, the ratio collective / object
store, and the collective path's parts (trainer rank 0's gather + broadcast, the slowest
worker's load). Never used as a timed assertion in tests.

`--tp N`: one vLLM engine of N TP ranks instead (rollout.name=vllm), collective path only; the
full broadcast (every TP rank gets the full tensors) and the rank-sliced update (each TP rank
its slices, weight_sync/tp_shards.py) alternate; prints the median seconds of each, their
ratio, and the bytes each TP rank received (from the group's tables).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402


def start(model_path: str, n_workers: int, dtype: str, tp: int = 1):
    from hybridrl.trainer.async_ppo.config import load_async_config
    from hybridrl.trainer.async_ppo.launch import compose_async_config
    from hybridrl.trainer.async_ppo.trainer import start_async_workers

    keys = [
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.rollout.dtype={dtype}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "trainer.cpus_per_worker=1",
        f"async_training.rollout_n_gpus_per_node={n_workers}",
        "async_training.rollout_cpus_per_worker=1",
    ]
    if tp > 1:
        keys += [
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        ]
    return start_async_workers(load_async_config(compose_async_config(keys)))


def one_update(publisher, group, version: int) -> dict[str, float]:
    """Seconds from publish(version) until every worker loaded it and the trainer is done."""
    import ray

    t0 = time.perf_counter()
    payload = publisher.publish(version)
    loads = ray.get([w.load_weights.remote(payload, version) for w in group.workers])
    publisher.check_last()
    out = {"update_s": time.perf_counter() - t0, "load_s": max(loads)}
    out.update(publisher.metrics)
    return out


def bench(model_path: str, n_workers: int, rounds: int, dtype: str) -> dict:
    from hybridrl.weight_sync.publisher import WeightPublisher

    workers = start(model_path, n_workers, dtype)
    try:
        train, group = workers.actor_rollout, workers.rollout
        pubs = {m: WeightPublisher(train, group, m, timeout_s=300) for m in ("object_store", "collective")}
        rows: dict[str, list[dict]] = {m: [] for m in pubs}
        version = 0
        for r in range(rounds + 1):  # round 0: warm-up (and the collective group's creation)
            for mode, pub in pubs.items():
                version += 1
                row = one_update(pub, group, version)
                if r > 0:
                    rows[mode].append(row)
        return rows
    finally:
        workers.shutdown()


def one_tp_update(train, group, version: int, sliced: bool) -> dict[str, float]:
    """Seconds from broadcast_weights(version) until every TP rank loaded it and the trainer is done."""
    import ray

    from hybridrl.weight_sync.collective import collective_payload

    t0 = time.perf_counter()
    sent = train.broadcast_weights(version, tp_shards=sliced)
    loads = ray.get([w.load_weights.remote(collective_payload(version), version) for w in group.workers])
    stats = ray.get(sent.refs)[0]
    return {"update_s": time.perf_counter() - t0, "load_s": max(loads), **stats}


def bench_tp(model_path: str, tp: int, rounds: int, dtype: str) -> dict:
    import ray

    from hybridrl.weight_sync.publisher import WeightPublisher

    workers = start(model_path, tp, dtype, tp=tp)
    try:
        train, group = workers.actor_rollout, workers.rollout
        WeightPublisher(train, group, "collective", timeout_s=300).join()
        rows: dict[str, list[dict]] = {"full": [], "sliced": []}
        version = 0
        for r in range(rounds + 1):  # round 0: warm-up
            for mode in rows:
                version += 1
                row = one_tp_update(train, group, version, sliced=mode == "sliced")
                received = ray.get([w.received_weight_bytes.remote() for w in group.workers])
                row["received_bytes"] = [got[version] for got in received]
                if r > 0:
                    rows[mode].append(row)
        return rows
    finally:
        workers.shutdown()


def main_tp(args, path: str) -> dict:
    rows = bench_tp(path, args.tp, args.rounds, args.dtype)
    full, sliced = med(rows["full"], "update_s"), med(rows["sliced"], "update_s")
    C.print_table(
        ["model", "TP", "dtype", "full s", "sliced s", "sliced / full", "full: send s", "sliced: send s",
         "full: load s", "sliced: load s", "MiB per TP rank full", "MiB per TP rank sliced"],
        [[args.model, str(args.tp), args.dtype, C.fmt(full), C.fmt(sliced), C.fmt(sliced / full),
          C.fmt(med(rows["full"], "send_s")), C.fmt(med(rows["sliced"], "send_s")),
          C.fmt(med(rows["full"], "load_s")), C.fmt(med(rows["sliced"], "load_s")),
          " / ".join(C.fmt(b / 2**20) for b in rows["full"][-1]["received_bytes"]),
          " / ".join(C.fmt(b / 2**20) for b in rows["sliced"][-1]["received_bytes"])]],
    )  # fmt: skip
    return rows


def med(rows: list[dict], key: str) -> float:
    xs = [r[key] for r in rows if key in r]
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="30m", help="tiny, 30m or a Hugging Face folder")
    p.add_argument("--workers", default="1,2", help="rollout worker counts, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--dtype",
        default="float32",
        help="rollout dtype, what crosses the wire (main_async's default: float32)",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="> 1: one vLLM engine of this many TP ranks, full vs sliced"
    )
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    path = C.resolve_bench_model(args.model)
    if args.tp > 1:
        ray.init(num_cpus=1 + args.tp, include_dashboard=False, log_to_driver=False)
        dump = main_tp(args, path)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dump, f, indent=1)
        ray.shutdown()
        return
    counts = [int(x) for x in args.workers.split(",")]
    ray.init(num_cpus=1 + max(counts), include_dashboard=False, log_to_driver=False)
    table, dump = [], {}
    for n in counts:
        rows = bench(path, n, args.rounds, args.dtype)
        dump[n] = rows
        obj, col = med(rows["object_store"], "update_s"), med(rows["collective"], "update_s")
        table.append([
            args.model, str(n), args.dtype, C.fmt(obj), C.fmt(col), C.fmt(col / obj),
            C.fmt(med(rows["collective"], "async/weight_update/gather_send_s")),
            C.fmt(med(rows["object_store"], "load_s")), C.fmt(med(rows["collective"], "load_s")),
        ])  # fmt: skip
    C.print_table(
        ["model", "rollout workers", "dtype", "object store s", "collective s", "collective / object store",
         "collective: gather+broadcast s", "object store: load s", "collective: load s"],
        table,
    )  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dump, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
