"""Weight-sync time vs model size, against a plain memcpy (torch `copy_`) of the same bytes.

For each model size the source is the model's `named_parameters()` (what the FSDP engine
streams: each tied tensor once). Measured side by side in one run:

* memcpy: `dst.copy_(src)` into preallocated tensors of the same shapes and dtype;
* hf:     `sync_weights` into an HFRollout (in-place copy into its private model);
* vllm:   `sync_weights` into a VLLMRollout (vLLM's in-place layer-wise reload, which also
          re-packs the CPU kernel formats).

Best of `--repeats` after one warm-up each. Prints seconds and the ratio to memcpy.

`--tp 2` instead measures the rollout-TP rows, per rank, in 2 processes (one core each): an
FSDP2 source sharded over both ranks, memcpy of the full bytes vs the bucketed gather alone vs
the whole sync into a vLLM TP=2 engine (and a TP=1 engine per rank), alternating in one run
(bench/weight_sync_tp.py). Model sizes need an even number of heads (not 135m).

    VLLM_CPU_KVCACHE_SPACE=1 python bench/weight_sync.py [--sizes tiny,8m,30m,70m,135m]
    VLLM_CPU_KVCACHE_SPACE=1 python bench/weight_sync.py --tp 2 --sizes tiny,8m,30m
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout_generation import build_model_dir, count_params  # noqa: E402

from hybridrl.models.weight_map import to_torch_dtype  # noqa: E402
from hybridrl.rollout import RolloutConfig, create_rollout  # noqa: E402
from hybridrl.weight_sync import sync_weights  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_size(size: str, root: str, args) -> dict:
    dtype = to_torch_dtype(args.dtype)
    path, model = build_model_dir(size, root)
    model = model.to(dtype)
    source = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in source)
    dst = [torch.empty_like(t) for _, t in source]

    def memcpy():
        for d, (_, s) in zip(dst, source):
            d.copy_(s)

    row = {"size": size, "params_m": count_params(model) / 1e6, "mbytes": nbytes / 2**20}
    row["memcpy_s"] = best_of(memcpy, args.repeats)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    for engine in args.engines.split(","):
        cfg = RolloutConfig(
            name=engine,
            dtype=args.dtype,
            prompt_length=16,
            response_length=16,
            load_format="dummy",
            max_num_seqs=8,
            update_weights_bucket_megabytes=args.bucket_mb,
        )
        rollout = create_rollout(cfg, path, tok, **({"device": "cpu"} if engine == "hf" else {}))
        row[f"{engine}_s"] = best_of(lambda r=rollout: sync_weights(r, iter(source)), args.repeats)
        rollout.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="tiny,8m,30m,70m,135m")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="2: the per-rank rollout-TP rows (2 processes)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads (2 threads on a busy 2-core machine thrash)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.tp == 2:
        main_tp(args)
        return
    engines = args.engines.split(",")
    print(f"torch threads={torch.get_num_threads()} dtype={args.dtype} bucket={args.bucket_mb} MiB")
    header = f"{'size':6s} {'params':>8s} {'MiB':>7s} {'memcpy_s':>9s}" + "".join(
        f" {e + '_s':>8s} {e + '/memcpy':>12s}" for e in engines
    )
    print(header)
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes.split(","):
            r = bench_size(size, root, args)
            line = f"{r['size']:6s} {r['params_m']:7.1f}M {r['mbytes']:7.1f} {r['memcpy_s']:9.4f}"
            for e in engines:
                line += f" {r[e + '_s']:8.4f} {r[e + '_s'] / r['memcpy_s']:11.1f}x"
            print(line, flush=True)


def main_tp(args) -> None:
    from weight_sync_tp import print_tp_rows, run_tp_rows

    print(f"rollout TP rows: 2 ranks x 1 core, FSDP2 source, dtype={args.dtype}, best of {args.repeats}")
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes.split(","):
            path, model = build_model_dir(size, root)
            print_tp_rows(size, count_params(model) / 1e6, run_tp_rows(path, args.dtype, args.repeats))


if __name__ == "__main__":
    main()
