"""hybridrl's main_rm / main_dpo vs TRL's RewardTrainer / DPOTrainer, side by side (A B A B ...).

Workload (both libraries): the built-in preference pairs (a correct and a wrong answer to the
built-in task's question; prompts as chat messages, rendered with the model's chat template), the
built-in tiny model, `--batch` pairs per optimizer step in one micro-batch, AdamW lr `--lr`, fp32,
one torch thread, no validation, no checkpoints (TRL's bf16 autocast and gradient checkpointing,
on by default in its configs, are turned off to match). Each library runs with its own defaults otherwise:
DPO's reference log-probs are precomputed before training in hybridrl and computed beside every
step in TRL (its `precompute_ref_log_probs=False` default).

Each run is a fresh child process; the runners alternate every round so machine drift hits them
alike. Reported per runner (medians over rounds): tokens per second over the training loop (the
first step is warm-up and left out; tokens = prompt + completion tokens of both completions),
wall time per step, the whole child's wall time (imports and start-up included) and the peak RSS
of its process tree, and tokens per CPU second of the training process (its process time over the
same steps: on a shared machine, where other processes take the cores for a while, this is the
steadier speed); then hybridrl / TRL, and the median of the per-round ratios.

Run:
    python bench/pref_vs_trl.py                   # rm and dpo, 2 rounds x 20 steps
    python bench/pref_vs_trl.py --kinds rm --rounds 3 --steps 40

Needs `pip install -e .[bench]` (TRL and datasets).
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


def pair_files() -> dict:
    from hybridrl.data.preference import ensure_builtin_preference_data

    return ensure_builtin_preference_data()


# ------------------------------------------------------------------------------------ children
def run_hybridrl(kind: str, steps: int, batch: int, lr: float, out: str) -> None:
    from hybridrl.trainer.pref.config import load_pref_config
    from hybridrl.trainer.pref.data import load_pref_datasets
    from hybridrl.trainer.pref.trainer import DPOTrainer, RewardModelTrainer
    from hybridrl.trainer.sft.launch import init_distributed

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_pref_config(
            kind,
            {
                "data": {
                    "train_files": pair_files()["pref_train"],
                    "train_batch_size": batch,
                    "micro_batch_size_per_gpu": batch,
                },
                "optim": {"lr": lr, "lr_scheduler": "constant", "lr_warmup_steps": 0},
                "trainer": {
                    "default_local_dir": tmp,
                    "total_training_steps": steps,
                    "val_before_train": False,
                },
            },
        )
        tok, train, _, _ = load_pref_datasets(cfg)
        init_distributed(cfg)
        cls = RewardModelTrainer if kind == "rm" else DPOTrainer
        trainer = cls(cfg, train, None, tok)
        if kind == "dpo":
            trainer._reference_table(train)  # before the timed loop, as main_dpo does
        times, cpu, tokens = [], [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            m = trainer.train_step(trainer._next_indices())
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            tokens.append(m["train/tokens"])
    Path(out).write_text(json.dumps({"step_s": times, "cpu_s": cpu, "tokens": tokens}))


def trl_dataset():
    import pandas as pd
    from datasets import Dataset

    rows = pd.read_parquet(pair_files()["pref_train"]).to_dict("records")
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in rows
        ]
    )


def run_trl(kind: str, steps: int, batch: int, lr: float, out: str) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    from hybridrl.models.builtin import get_builtin_model_path

    path = get_builtin_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    times, cpu, tokens = [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start, self.start_cpu = time.perf_counter(), time.process_time()
            self.before = trainer._total_train_tokens

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)
            cpu.append(time.process_time() - self.start_cpu)
            tokens.append(trainer._total_train_tokens - self.before)

    common = dict(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, per_device_train_batch_size=batch,
        max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, save_strategy="no",
        logging_steps=10**6, adam_beta2=0.95, weight_decay=0.01, max_grad_norm=1.0, dataloader_num_workers=0,
        seed=1, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    if kind == "rm":
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
        trainer = RewardTrainer(
            model=model, args=RewardConfig(**common), train_dataset=trl_dataset(), processing_class=tok
        )
    else:
        from trl import DPOConfig, DPOTrainer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = DPOTrainer(
            model=model, args=DPOConfig(**common, beta=0.1), train_dataset=trl_dataset(), processing_class=tok
        )
    trainer.add_callback(Clock())
    trainer.train()
    Path(out).write_text(json.dumps({"step_s": times, "cpu_s": cpu, "tokens": tokens}))


# ------------------------------------------------------------------------------------ driver
def summarise(result: dict) -> dict:
    step_s, cpu_s, tokens = result["step_s"][1:], result["cpu_s"][1:], result["tokens"][1:]
    return {
        "tokens_per_s": sum(tokens) / max(sum(step_s), 1e-9),
        "tokens_per_cpu_s": sum(tokens) / max(sum(cpu_s), 1e-9),
        "step_s": C.median(step_s),
        "child_wall_s": result["child_wall_s"],
        "peak_rss_mib": result["peak_rss_tree_mib"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="rm,dpo")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=["hybridrl", "trl"], default=None)
    p.add_argument("--kind", default="rm")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.child:
        (run_hybridrl if a.child == "hybridrl" else run_trl)(a.kind, a.steps, a.batch, a.lr, a.out)
        return
    info = C.print_header("hybridrl main_rm / main_dpo vs TRL RewardTrainer / DPOTrainer")
    pair_files()  # written once, before the timed children
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for kind in a.kinds.split(","):
                for lib in ("hybridrl", "trl") if rnd % 2 == 0 else ("trl", "hybridrl"):
                    out = os.path.join(tmp, f"{lib}_{kind}.json")
                    args = [__file__, "--child", lib, "--kind", kind, "--steps", str(a.steps)]
                    args += ["--batch", str(a.batch), "--lr", str(a.lr), "--out", out]
                    r = summarise(C.run_child(args, out, env={"OMP_NUM_THREADS": "1"}))
                    r["load_1min"] = C.load_average()[0]
                    results.setdefault(kind, {}).setdefault(lib, []).append(r)
                    print(f"round {rnd} {kind} {lib}: {r}", flush=True)
    rows = []
    cols = ("tokens_per_s", "tokens_per_cpu_s", "step_s", "child_wall_s", "peak_rss_mib")
    for kind, libs in results.items():
        med = {lib: {k: C.median([r[k] for r in rs]) for k in rs[0]} for lib, rs in libs.items()}
        for lib in ("hybridrl", "trl"):
            rows.append(
                [kind, lib] + [C.fmt(med[lib][c], 4 if "tokens" in c or "rss" in c else 3) for c in cols]
            )
        h, t = med["hybridrl"], med["trl"]
        rows.append([kind, "hybridrl / trl"] + [C.fmt(h[c] / t[c]) for c in cols])
        for c in ("tokens_per_s", "tokens_per_cpu_s"):
            ratios = [x[c] / y[c] for x, y in zip(libs["hybridrl"], libs["trl"])]
            print(
                f"{kind}: {c} ratio per round {[round(r, 2) for r in ratios]}, median {C.median(ratios):.2f}"
            )
    C.print_table(
        ["kind", "runner", "tokens/s", "tokens/CPU s", "step s", "child wall s", "peak RSS MiB"], rows
    )
    C.write_json(a.json, {"machine": info, "args": vars(a), "results": results})


if __name__ == "__main__":
    main()
