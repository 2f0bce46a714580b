"""Model FLOPs utilisation of each GRPO stage against this machine's matmul peak, measured in one run.

1. Peak: the best FLOP/s of a square matmul (1024 and 2048) in fp32 and bf16, with 1 and 2 torch
   threads, measured here before and after the stages; the better of the two is the peak (the
   machine is shared and the number moves with the load, by 2x for bf16).
2. Stages, in this process, with the library's own pieces as a worker uses them (world size 1,
   gloo): `FSDPEngine.build` + `PPOActor` for the old log-prob pass and the PPO update, the HF
   rollout engine (`create_rollout`) for generation, `sync_weights` for the weight hand-over.
   FLOPs follow `hybridrl.utils.flops.estimate_flops` (6N per token for training, 2N for a
   forward, plus the attention term), counted on valid tokens ("useful") and on the padded
   tensors actually computed ("executed").
3. A plain-PyTorch reference on the same batch (HF model, forward + backward + AdamW, no hybridrl)
   separates the library's overhead from what eager PyTorch gets out of this CPU.

The default is the benchmark's ~30M-parameter Qwen2 (random init, so every response runs to the
length limit), 8 prompts x 8 samples, 9 prompt tokens, 12 new tokens, fp32, ONE torch thread (more
than one thread per process is catastrophically slow on this 2-core machine under any other load).
The MFU of a stage is against the peak of the same dtype and thread count.

Run:
    python bench/mfu.py                      # ~2 min
    python bench/mfu.py --response-length 64 --prompts 16
    python bench/mfu.py --dtype bf16         # bf16 compute (FSDP mixed precision, bf16 rollout)
    python bench/mfu.py --dtype bf16 --attn sdpa --reshard   # bf16 with the pre-auto defaults
    python bench/mfu.py --threads 2          # only on an otherwise idle machine
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

for _k, _v in C.ONE_THREAD_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------- peak
def matmul_peak(dtype: torch.dtype, threads: int, sizes=(1024, 2048), seconds: float = 0.6) -> float:
    """Best FLOP/s of an (n x n) @ (n x n) matmul over ~`seconds` per size, with `threads` threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for n in sizes:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            torch.mm(a, b)
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                torch.mm(a, b)
                best = max(best, 2.0 * n**3 / (time.perf_counter() - t))
        return best
    finally:
        torch.set_num_threads(old)


def measure_peaks() -> dict[str, float]:
    out = {}
    for name, dtype in DTYPES.items():
        for threads in (1, 2):
            out[f"{name}/{threads}t"] = matmul_peak(dtype, threads)
    return out


# ------------------------------------------------------------------------------------- setup
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_batch(tokenizer, prompts: int, n: int, pad_to: int | None):
    """`prompts` built-in task prompts, each repeated n times, LEFT-padded to `pad_to` (or the longest)."""
    from hybridrl.data.builtin_task import make_rl_rows
    from hybridrl.protocol import DataProto

    rows = make_rl_rows(prompts, seed=0, split="train")
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(max(len(x) for x in ids), pad_to or 0)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": pos})
    return batch.repeat(repeat_times=n, interleave=True), sum(len(x) for x in ids) / len(ids)


def build(model_path: str, args):
    from hybridrl.config.roles import (
        ActorConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
    )
    from hybridrl.config.rollout import RolloutConfig
    from hybridrl.engine.fsdp import FSDPEngine
    from hybridrl.rollout.base import create_rollout
    from hybridrl.utils.device import init_process_group
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    os.environ["MASTER_PORT"] = str(_free_port())
    init_process_group(rank=0, world_size=1, timeout_s=120)
    rows = args.prompts * args.n
    fsdp = FSDPConfig(
        model_dtype="fp32",
        mixed_precision=MixedPrecisionConfig(param_dtype=args.dtype, reduce_dtype="fp32"),
        reshard_after_forward=True if args.reshard else (False if args.no_reshard else None),
    )
    actor_cfg = ActorConfig(
        ppo_mini_batch_size=args.prompts,
        ppo_micro_batch_size_per_gpu=args.micro_batch or rows,
        optim=OptimConfig(lr=3e-5, weight_decay=0.01, clip_grad=1.0),
        fsdp_config=fsdp,
    )
    override = {"attn_implementation": args.attn} if args.attn else {}
    model_cfg = ModelConfig(path=model_path, use_remove_padding=args.remove_padding, override_config=override)
    engine = FSDPEngine.build(model_cfg, fsdp, actor_cfg.optim, role="actor")
    actor = PPOActor(
        actor_cfg,
        engine.module,
        engine.optimizer,
        engine.lr_scheduler,
        dp_size=1,
        batch_sizes=normalize_actor_batch_sizes(actor_cfg, rollout_n=args.n, dp_size=1),
        use_remove_padding=args.remove_padding,
    )
    rollout_cfg = RolloutConfig(
        name="hf",
        n=1,
        prompt_length=args.prompt_pad or 16,
        response_length=args.response_length,
        dtype="float32" if args.dtype == "fp32" else "bfloat16",
        load_format="auto",
        log_prob_micro_batch_size_per_gpu=rows,
        ignore_eos=args.ignore_eos,
    )
    rollout = create_rollout(rollout_cfg, model_path, engine.tokenizer)
    return engine, actor, rollout, actor_cfg


# ------------------------------------------------------------------------------------- stages
def timed(fn, reps: int, warmup: int = 1):
    """Median seconds of `fn()` over `reps` runs after `warmup` runs; returns (median, last result)."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out, times


def run_stages(model_path: str, args) -> dict:
    from hybridrl.engine.fsdp import resolve_reshard_after_forward
    from hybridrl.utils.flops import attention_dims, count_params, estimate_flops
    from hybridrl.weight_sync import sync_weights

    engine, actor, rollout, _ = build(model_path, args)
    tok = engine.tokenizer
    prompts, mean_prompt = prompt_batch(tok, args.prompts, args.n, args.prompt_pad)
    num_params = count_params(engine.module)
    layers, attn_dim = attention_dims(engine.module.config)
    dtype = DTYPES[args.dtype]

    def sync():
        return sync_weights(rollout, engine.iter_full_params(dtype=dtype))

    t_sync, _, _ = timed(sync, args.reps)
    t_gen, gen, _ = timed(lambda: rollout.generate_sequences(prompts), args.reps)
    batch = gen
    valid = batch.batch["attention_mask"].sum(-1).tolist()
    executed = [batch.batch["input_ids"].shape[1]] * len(batch)
    resp = batch.batch["response_mask"].sum(-1)
    gen_tokens = int(resp.sum())

    def log_prob():
        lp, _ = actor.compute_log_prob(batch, calculate_entropy=True, micro_batch_size=len(batch))
        return lp

    t_lp, old_lp, _ = timed(log_prob, args.reps)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(len(batch), 1, generator=g) * batch.batch["response_mask"]
    batch.batch["old_log_probs"] = old_lp
    batch.batch["advantages"] = adv

    def update():
        return actor.update_policy(batch)

    t_up, metrics, _ = timed(update, args.reps)

    # Generation FLOPs: every prompt token once (prefill) and every generated token once
    # (KV cache), with the same 2N-per-token + attention estimate as a forward pass.
    gen_valid = [int(m) for m in batch.batch["attention_mask"].sum(-1).tolist()]
    gen_exec = [batch.batch["prompts"].shape[1] + int(resp.max())] * len(batch)
    out = {
        "params_non_embedding": num_params,
        "layers": layers,
        "rows": len(batch),
        "mean_prompt_tokens": mean_prompt,
        "padded_seq_len": executed[0],
        "generated_tokens": gen_tokens,
        "mean_valid_tokens_per_row": sum(valid) / len(valid),
        "attn_implementation": engine.module.config._attn_implementation,
        "reshard_after_forward": resolve_reshard_after_forward(engine.fsdp_config, engine.mesh),
        "stages": {},
    }
    for name, seconds, tr, val, exe in (
        ("generate", t_gen, False, gen_valid, gen_exec),
        ("old log-prob", t_lp, False, valid, executed),
        ("update", t_up, True, valid, executed),
    ):
        out["stages"][name] = {
            "seconds": seconds,
            "useful_flops": estimate_flops(num_params, val, layers, attn_dim, training=tr),
            "executed_flops": estimate_flops(num_params, exe, layers, attn_dim, training=tr),
        }
    out["stages"]["weight sync"] = {"seconds": t_sync, "useful_flops": 0.0, "executed_flops": 0.0}
    out["generate_tokens_per_s"] = gen_tokens / t_gen
    out["reference"] = plain_torch_reference(model_path, batch, args, num_params, layers, attn_dim)
    out["grad_norm"] = metrics.get("actor/grad_norm")
    return out


def plain_torch_reference(model_path: str, batch, args, num_params, layers, attn_dim) -> dict:
    """The same update on a plain HF model with torch AdamW: what eager PyTorch gets on this CPU."""
    from transformers import AutoModelForCausalLM

    from hybridrl.utils.flops import estimate_flops

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.01)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    pos = batch.batch["position_ids"]
    t = batch.batch["responses"].shape[1]
    resp_mask = batch.batch["response_mask"].float()
    adv = batch.batch["advantages"]
    cast = DTYPES[args.dtype]

    def step():
        with torch.autocast("cpu", dtype=cast, enabled=cast != torch.float32):
            logits = (
                model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -t - 1 : -1].float()
            )
        lp = torch.log_softmax(logits, -1).gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
        loss = -((lp - lp.detach()).exp() * adv * resp_mask).sum() / resp_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, _, _ = timed(step, args.reps)
    executed = [ids.shape[1]] * ids.shape[0]
    return {"seconds": seconds, "executed_flops": estimate_flops(num_params, executed, layers, attn_dim)}


# ------------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="30m", help="30m (default), tiny, or a Hugging Face folder")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response-length", type=int, default=12)
    p.add_argument(
        "--prompt-pad",
        type=int,
        default=None,
        help="left-pad prompts to this length, as data.max_prompt_length does (default: no padding)",
    )
    p.add_argument("--micro-batch", type=int, default=None, help="rows per update forward (default: all)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--remove-padding", action="store_true", help="model.use_remove_padding=True")
    p.add_argument(
        "--attn",
        choices=["sdpa", "eager"],
        help="model.override_config.attn_implementation (default: the engine's choice, eager for bf16 on CPU)",
    )
    reshard = p.add_mutually_exclusive_group()
    reshard.add_argument("--no-reshard", action="store_true", help="fsdp_config.reshard_after_forward=False")
    reshard.add_argument(
        "--reshard", action="store_true", help="fsdp_config.reshard_after_forward=True (default: auto)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --response-length tokens")
    p.add_argument("--json", help="write all numbers to this file")
    args = p.parse_args()

    info = C.print_header("MFU per GRPO stage (bench/mfu.py)")
    model_path = C.resolve_bench_model(args.model)
    before = measure_peaks()
    torch.set_num_threads(args.threads)
    res = run_stages(model_path, args)
    after = measure_peaks()
    # The peak is what the machine can do: the better of the two measurements (the other helpers'
    # load moves both; taking the max makes every MFU below conservative).
    peaks = {k: max(before[k], after[k]) for k in before}
    print(
        "\nmatmul peak (square matmul, 1024 and 2048, best of ~0.6 s each, before / after the stages), GFLOP/s:"
    )
    C.print_table(
        ["dtype", "1 thread", "2 threads"],
        [
            [d, *(f"{C.fmt(before[f'{d}/{t}t'] / 1e9)} / {C.fmt(after[f'{d}/{t}t'] / 1e9)}" for t in (1, 2))]
            for d in DTYPES
        ],
    )
    peak = peaks[f"{args.dtype}/{args.threads}t"]
    print(
        f"\nmodel {args.model} ({res['params_non_embedding'] / 1e6:.1f}M non-embedding params, {res['layers']} "
        f"layers), {res['rows']} rows = {args.prompts} prompts x {args.n}, prompt {res['mean_prompt_tokens']:.0f} "
        f"tokens (padded row length {res['padded_seq_len']}), {res['generated_tokens']} generated tokens, "
        f"{args.dtype}, {args.threads} thread(s); peak used: {peak / 1e9:.1f} GFLOP/s; median of {args.reps}; "
        f"actor attention {res['attn_implementation']}, reshard_after_forward={res['reshard_after_forward']}"
    )
    rows = []
    for name, s in res["stages"].items():
        rows.append(
            [
                name,
                C.fmt(s["seconds"]),
                C.fmt(s["useful_flops"] / 1e9),
                C.fmt(s["useful_flops"] / s["seconds"] / 1e9),
                f"{100 * s['useful_flops'] / s['seconds'] / peak:.1f}%" if s["useful_flops"] else "-",
                f"{100 * s['executed_flops'] / s['seconds'] / peak:.1f}%" if s["executed_flops"] else "-",
            ]
        )
    ref = res["reference"]
    rows.append(
        [
            "plain torch update (reference)",
            C.fmt(ref["seconds"]),
            C.fmt(ref["executed_flops"] / 1e9),
            C.fmt(ref["executed_flops"] / ref["seconds"] / 1e9),
            "-",
            f"{100 * ref['executed_flops'] / ref['seconds'] / peak:.1f}%",
        ]
    )
    C.print_table(["stage", "s", "GFLOP (useful)", "GFLOP/s", "MFU useful", "MFU executed"], rows)
    up = res["stages"]["update"]
    mfu = up["useful_flops"] / up["seconds"] / peak
    print(
        f"\nupdate MFU {100 * mfu:.1f}% of the measured {args.dtype} {args.threads}-thread peak "
        f"(target >= 35%: {'met' if mfu >= 0.35 else 'NOT met'}); generation {res['generate_tokens_per_s']:.0f} tok/s"
    )
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")
    C.write_json(
        args.json,
        {
            "machine": info,
            "args": vars(args),
            "peaks": peaks,
            "peaks_before": before,
            "peaks_after": after,
            "results": res,
        },
    )


if __name__ == "__main__":
    main()
