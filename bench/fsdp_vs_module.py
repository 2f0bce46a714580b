"""FSDP2 on one rank vs the plain module: the same update step, same batch, same process, alternating.

Two copies of one model with identical weights: A is sharded with the library's `apply_fsdp2` over
a one-rank gloo group (what `FSDPEngine` runs with `trainer.n_gpus_per_node=1`), B is the bare
module. Each step is the actor update's work through `ModuleEngine`: `forward_log_probs` with
entropy (the chunked head at the response positions), a token-mean loss, backward, grad-norm clip
and AdamW. The two alternate (A B, then B A) for `--rounds` rounds of `--steps` steps each; printed:
seconds per step of each, the ratio FSDP2 / plain per round and its median (above 1: FSDP2 costs),
and the largest difference of the losses (the two must compute the same numbers).

Run:
    python bench/fsdp_vs_module.py                        # real-vocabulary model, 48 response tokens
    python bench/fsdp_vs_module.py --model tiny --rounds 5
    python bench/fsdp_vs_module.py --response-length 256 --threads 2
    python bench/fsdp_vs_module.py --rounds 0 --profile 20   # one profiled step each, op by op

`--profile K` runs one step of each under torch.profiler after the rounds and prints the K ops whose
self CPU time differs most between the two (calls and milliseconds of each), the plain module's K
most expensive ops with their share of its self CPU time, then the totals.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _batch(rows: int, prompt: int, response: int, vocab: int):
    """rows x (prompt + response) random tokens, all valid; responses are the last `response`."""
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    b = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:]}
    return TensorDict(b, batch_size=[rows])


def _engine(module, lr: float):
    import torch

    from hybridrl.engine.base import LogProbRequest
    from hybridrl.engine.module_engine import ModuleEngine

    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01)
    return ModuleEngine(module, opt), LogProbRequest(calculate_entropy=True)


def _step(engine, request, batch) -> tuple[float, float]:
    """One forward+backward+step; (seconds, loss). `_CPU_S` collects the process CPU seconds of
    each step (less sensitive to other processes' load than wall time at one thread)."""

    def loss_fn(micro, out):
        loss = -out.log_probs.mean() - 0.001 * out.entropy.mean()
        return loss, float(loss.detach())

    t, c = time.perf_counter(), time.process_time()
    engine.optimizer.zero_grad(set_to_none=True)
    (loss,) = engine.forward_backward([batch], request, loss_fn)
    engine.optimizer_step(1.0)
    _CPU_S.append(time.process_time() - c)
    return time.perf_counter() - t, loss


_CPU_S: list[float] = []


def _profile(engines: dict, batch, top: int) -> None:
    """One step of each under torch.profiler; the `top` ops whose self CPU time differs most."""
    from torch.profiler import ProfilerActivity, profile

    stats = {}
    for name, (engine, request) in engines.items():
        _step(engine, request, batch)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(engine, request, batch)
        stats[name] = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}
    a, b = stats["fsdp2"], stats["plain"]
    keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1]))
    print(f"\n{'op':<48} {'fsdp2 calls':>11} {'ms':>8} {'plain calls':>11} {'ms':>8} {'diff ms':>8}")
    for k in keys[:top]:
        (ca, ta), (cb, tb) = a.get(k, (0, 0.0)), b.get(k, (0, 0.0))
        print(f"{k[:48]:<48} {ca:>11} {ta:>8.1f} {cb:>11} {tb:>8.1f} {ta - tb:>+8.1f}")
    tot = {n: sum(t for _, t in st.values()) for n, st in stats.items()}
    print(f"\nplain module, the {top} ops with the most self CPU time (where the update's time goes):")
    print(f"{'op':<48} {'calls':>7} {'ms':>9} {'share':>6}")
    for k in sorted(b, key=lambda k: -b[k][1])[:top]:
        print(f"{k[:48]:<48} {b[k][0]:>7} {b[k][1]:>9.1f} {b[k][1] / tot['plain']:>6.1%}")
    calls = {n: sum(c for c, _ in st.values()) for n, st in stats.items()}
    print(f"total self CPU: fsdp2 {tot['fsdp2']:.1f} ms in {calls['fsdp2']} op calls, "
          f"plain {tot['plain']:.1f} ms in {calls['plain']} op calls")  # fmt: skip


def _models(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    if name == "real100m":
        from real_model import ensure_real_model

        path = ensure_real_model()["model"]
    else:
        path = C.resolve_bench_model(name)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return copy.deepcopy(plain), plain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="real100m", help="real100m (bench/real_model.py), tiny, 30m or a folder"
    )
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument("--prompt-length", type=int, default=53)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="steps per engine per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--profile", type=int, default=0, help="after the rounds: one profiled step each, top K ops"
    )
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybridrl.config.roles import FSDPConfig, MixedPrecisionConfig
    from hybridrl.engine.fsdp import apply_fsdp2

    torch.set_num_threads(args.threads)
    C.print_header(f"FSDP2 world 1 vs plain module (bench/fsdp_vs_module.py), {args.threads} thread(s)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    sharded, plain = _models(args.model)
    fsdp_config = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))  # the yaml default
    apply_fsdp2(sharded, init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)), fsdp_config)
    engines = {"fsdp2": _engine(sharded, 1e-5), "plain": _engine(plain, 1e-5)}
    batch = _batch(args.rows, args.prompt_length, args.response_length, plain.config.vocab_size)
    times: dict[str, list[float]] = {"fsdp2": [], "plain": []}
    cpu: dict[str, list[float]] = {"fsdp2": [], "plain": []}
    losses: dict[str, list[float]] = {"fsdp2": [], "plain": []}
    for name in ("fsdp2", "plain"):  # warm-up step of each (allocator, lazy init); kept in the loss check
        losses[name].append(_step(*engines[name], batch)[1])
    for r in range(args.rounds):
        for name in ("fsdp2", "plain") if r % 2 == 0 else ("plain", "fsdp2"):
            secs = []
            _CPU_S.clear()
            for _ in range(args.steps):
                s, loss = _step(*engines[name], batch)
                secs.append(s)
                losses[name].append(loss)
            times[name].append(C.median(secs))
            cpu[name].append(C.median(_CPU_S))
            print(f"round {r + 1} {name}: {times[name][-1]:.3f} s/step (load avg {C.load_average()[0]:.2f})",
                  flush=True)  # fmt: skip
    ratios = [a / b for a, b in zip(times["fsdp2"], times["plain"])] or [float("nan")]
    diff = max(abs(a - b) for a, b in zip(losses["fsdp2"], losses["plain"]))
    print(f"\n{args.rows} rows x ({args.prompt_length} + {args.response_length}) tokens, {args.model}: "
          f"fsdp2 {C.median(times['fsdp2']):.3f} s vs plain {C.median(times['plain']):.3f} s per step; "
          f"fsdp2 / plain per round {', '.join(f'{x:.3f}' for x in ratios)} (median {C.median(ratios):.3f}); "
          f"max |loss difference| over {len(losses['plain'])} steps: {diff:.2e}")  # fmt: skip
    if args.profile:
        _profile(engines, batch, args.profile)
    cpu_ratios = [a / b for a, b in zip(cpu["fsdp2"], cpu["plain"])] or [float("nan")]
    print(f"process CPU s/step: fsdp2 {C.median(cpu['fsdp2']):.3f} vs plain {C.median(cpu['plain']):.3f}; "
          f"fsdp2 / plain per round {', '.join(f'{x:.3f}' for x in cpu_ratios)} (median {C.median(cpu_ratios):.3f})")  # fmt: skip
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
