"""The TRL side of bench/compare_trl.py: GRPOTrainer on the same workload, with a step clock."""

from __future__ import annotations

import os
import tempfile
import time

import _common as C
from compare_trl import score, workload_data


def trl_dataset(path: str):
    import pandas as pd
    from datasets import Dataset

    df = pd.read_parquet(path)
    prompts = [[{"role": m["role"], "content": m["content"]} for m in p] for p in df["prompt"]]
    truths = [rm["ground_truth"] for rm in df["reward_model"]]
    return Dataset.from_dict({"prompt": prompts, "ground_truth": truths})


def arith_reward(prompts, completions, ground_truth, **kwargs):
    """TRL reward function: hybridrl's own scorer on the decoded completion."""
    return [
        score(c[0]["content"] if isinstance(c, list) else c, gt) for c, gt in zip(completions, ground_truth)
    ]


def greedy_accuracy(model, tokenizer, val_path: str, max_new_tokens: int) -> float:
    """Greedy exact match on the validation prompts with plain HF generate (one left-padded batch)."""
    import pandas as pd
    import torch

    df = pd.read_parquet(val_path)
    texts = [
        tokenizer.apply_chat_template([dict(m) for m in p], add_generation_prompt=True, tokenize=False)
        for p in df["prompt"]
    ]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    truths = [rm["ground_truth"] for rm in df["reward_model"]]
    return sum(score(c, t) for c, t in zip(completions, truths)) / len(truths)


def run_trl(w: dict, seed: int, extra: list[str] | None = None) -> dict:
    """One TRL GRPOTrainer run in this process; returns per-step records."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t_start = time.perf_counter()
    paths = workload_data(w)
    timing = {"gen_s": 0.0, "log_prob_s": 0.0, "prepare_s": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            t = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                timing["gen_s"] += time.perf_counter() - t

        def _get_per_token_logps_and_entropies(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*a, **k)
            finally:
                if not torch.is_grad_enabled():  # old / reference log-probs, not the loss forward
                    timing["log_prob_s"] += time.perf_counter() - t

        def _prepare_inputs(self, generation_batch):
            t = time.perf_counter()
            try:
                return super()._prepare_inputs(generation_batch)
            finally:
                timing["prepare_s"] += time.perf_counter() - t

    ends: list[float] = []
    cpu_ends: list[float] = []
    splits: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(C.tree_cpu_seconds())
            splits.append(dict(timing))
            for k in timing:
                timing[k] = 0.0

    batch = w["prompts"] * w["n"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            num_generations=w["n"],
            max_completion_length=w["response_length"],
            learning_rate=w["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.01,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            epsilon=0.2,
            num_iterations=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            bf16=w.get("dtype", "fp32") == "bf16",  # autocast bf16 over fp32 weights
            fp16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            max_steps=w["steps"],
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=seed,
            data_seed=seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
            log_completions=False,
            use_vllm=False,
            remove_unused_columns=False,
        )
        tokenizer = AutoTokenizer.from_pretrained(w["model_path"])
        model = AutoModelForCausalLM.from_pretrained(w["model_path"], dtype=torch.float32)
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=arith_reward,
            args=cfg,
            train_dataset=trl_dataset(paths["train"]),
            processing_class=tokenizer,
            callbacks=[StepClock()],
        )
        t_fit = time.perf_counter()
        cpu_fit = C.tree_cpu_seconds()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
        acc = (
            greedy_accuracy(trainer.model, tokenizer, paths["val"], w["response_length"])
            if w["eval"]
            else None
        )
    steps = []
    prev, cpu_prev = t_fit, cpu_fit
    for i, (end, split) in enumerate(zip(ends, splits)):
        wall = end - prev
        prev = end
        cpu_s, cpu_prev = cpu_ends[i] - cpu_prev, cpu_ends[i]
        log = logs[i] if i < len(logs) else {}
        steps.append(
            {
                "wall_s": wall,
                "cpu_s": cpu_s,
                "gen_s": split["gen_s"],
                "weight_sync_s": 0.0,
                "log_prob_s": split["log_prob_s"],
                "update_s": wall - split["prepare_s"],
                "gen_tokens": log.get("completions/mean_length", float("nan")) * batch,
                "reward": log.get("reward", float("nan")),
                "mfu_update": None,
            }
        )
    return {"steps": steps, "start_up_s": t_fit - t_start, "final_greedy_acc": acc}
