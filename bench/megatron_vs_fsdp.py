"""PPO update time: the Megatron engine vs the FSDP2 engine on the same ranks, alternating.

`--ranks` processes (gloo on CPU, one torch thread each) build both the FSDP actor (data parallel
over all ranks) and the Megatron actor (`--tp` tensor parallel, the rest data parallel) of the
~30M model, then time `update_policy` on the same global batch, alternating F M F M ..., and
print the median of `--repeats` per engine and their ratio (Megatron / FSDP).

    python bench/megatron_vs_fsdp.py [--ranks 2] [--tp 2] [--rows 16] [--prompt 32] [--response 32] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

for _k, _v in C.ONE_THREAD_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402


def _batch(rows: int, prompt: int, response: int, vocab: int):
    from hybridrl.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:],
            "old_log_probs": -4.0 + 0.1 * torch.randn(rows, response, generator=g),
            "advantages": torch.randn(rows, response, generator=g),
        }
    )


def _worker(rank: int, world: int, port: int, path: str, args) -> None:
    import torch.distributed as dist

    from hybridrl.config.megatron import MegatronConfig
    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.engine.megatron.engine import MegatronEngine
    from hybridrl.utils.device import init_process_group
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_process_group(rank=rank, world_size=world, timeout_s=600)
    fsdp_cfg = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype=args.dtype))
    cfg = ActorConfig(
        ppo_mini_batch_size=args.rows,
        ppo_micro_batch_size_per_gpu=args.micro,
        optim=OptimConfig(lr=1e-6),
        fsdp_config=fsdp_cfg,
    )
    model = ModelConfig(path=path)
    fsdp = FSDPEngine.build(model, fsdp_cfg, cfg.optim, load_tok=False)
    f_actor = PPOActor(
        cfg,
        fsdp.module,
        fsdp.optimizer,
        fsdp.lr_scheduler,
        dp_size=world,
        batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=world),
    )
    mcfg = MegatronConfig(
        tensor_model_parallel_size=args.tp, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    )
    meg = MegatronEngine.build(model, mcfg, cfg.optim, max_grad_norm=cfg.max_grad_norm, load_tok=False)
    m_actor = PPOActor(
        cfg, meg, batch_sizes=normalize_actor_batch_sizes(cfg, rollout_n=1, dp_size=meg.dp_size)
    )
    data = _batch(args.rows, args.prompt, args.response, meg.spec.vocab_size)
    from megatron.core import parallel_state as ps

    f_data = data.chunk(world)[rank]
    m_data = data.chunk(meg.dp_size)[ps.get_data_parallel_rank()] if meg.dp_size > 1 else data
    fns = {"fsdp": lambda: f_actor.update_policy(f_data), "megatron": lambda: m_actor.update_policy(m_data)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in fns.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t)
    if rank == 0:
        f, m = statistics.median(times["fsdp"]), statistics.median(times["megatron"])
        ratios = [b / a for a, b in zip(times["fsdp"], times["megatron"])]
        print(
            f"| {world} | FSDP dp={world} | Megatron tp={args.tp} dp={meg.dp_size} | {C.fmt(f)} | {C.fmt(m)} | "
            f"{m / f:.2f}x (per pair {min(ratios):.2f}-{max(ratios):.2f}) |",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="FSDP param_dtype / megatron.dtype"
    )
    p.add_argument("--model", default="30m", help="'tiny', '30m' or a HF folder")
    args = p.parse_args()
    C.print_header(
        "PPO update: Megatron vs FSDP2 engine, same ranks, alternating (bench/megatron_vs_fsdp.py)"
    )
    print(
        f"one update_policy of {args.rows} rows x ({args.prompt} + {args.response}) tokens, micro-batch "
        f"{args.micro} per rank, {args.dtype}, median of {args.repeats}\n"
    )
    print("| ranks | FSDP | Megatron | FSDP s | Megatron s | Megatron / FSDP |")
    print("|---|---|---|---|---|---|")
    import torch.multiprocessing as mp

    path = C.resolve_bench_model(args.model)
    mp.start_processes(
        _worker,
        args=(args.ranks, _free_port(), path, args),
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
