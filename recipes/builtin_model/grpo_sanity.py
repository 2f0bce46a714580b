"""Sanity check of the shipped built-in model: does a plain GRPO loop raise its greedy accuracy?

Not part of the library (no Ray, no FSDP, no rollout engine): one process, HF ``generate`` for
sampling, on-policy GRPO (one gradient step per batch, so the PPO ratio is 1 and no clipping is
needed), group-normalised advantages, token-mean loss, no KL. It answers one question before the
full trainer is involved: is there enough room and signal in the shipped checkpoint for RL to show
a clear gain within minutes on a CPU?

    python recipes/builtin_model/grpo_sanity.py --seconds 120
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

try:
    from hybridrl.data import builtin_task
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hybridrl.data import builtin_task
from hybridrl.models.builtin import BUILTIN_MODEL_NAME, evaluate_accuracy, resolve_model_path
from hybridrl.reward.scorers import default_compute_score


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including the first eos of each row, 0 after it.

    Args:
        responses: (B, T) generated token ids.

    Returns:
        (B, T) float mask.
    """
    is_eos = (responses == eos_id).long()
    after_eos = torch.cumsum(is_eos, dim=1) - is_eos  # eos positions seen strictly before t
    return (after_eos == 0).float()


def grpo_step(model, tokenizer, opt, rows, group: int, max_new_tokens: int, temperature: float):
    """Sample ``group`` completions per prompt, score, and take one policy-gradient step."""
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    input_ids = enc["input_ids"].repeat_interleave(group, dim=0)  # (B*G, P)
    attn = enc["attention_mask"].repeat_interleave(group, dim=0)
    model.eval()
    with torch.no_grad():
        seq = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    p_len = input_ids.shape[1]
    responses = seq[:, p_len:]  # (B*G, T)
    mask = response_mask(responses, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    gts = [r["reward_model"]["ground_truth"] for r in rows for _ in range(group)]
    rewards = torch.tensor(
        [default_compute_score(builtin_task.BUILTIN_DATA_SOURCE, t, g) for t, g in zip(texts, gts)]
    )
    grouped = rewards.view(-1, group)  # (B, G)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)

    model.train()
    full_attn = torch.cat([attn, mask.long()], dim=1)
    logits = model(input_ids=seq, attention_mask=full_attn).logits[:, p_len - 1 : -1] / temperature
    logp = (
        torch.log_softmax(logits.float(), dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    )  # (B*G, T)
    loss = -(adv.unsqueeze(1) * logp * mask).sum() / mask.sum().clamp(min=1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(rewards.mean())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=BUILTIN_MODEL_NAME)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--eval-every", type=float, default=20, help="seconds between greedy evaluations")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="save the final model here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    train = builtin_task.make_rl_rows(len(builtin_task.split_pool("train")), args.seed, "train")

    def greedy_acc() -> float:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            return evaluate_accuracy(tmp)

    log = [{"t": 0.0, "step": 0, "greedy_acc": greedy_acc()}]
    print(json.dumps(log[-1]), flush=True)
    t0, step, next_eval, cursor, rewards = time.perf_counter(), 0, args.eval_every, 0, []
    while time.perf_counter() - t0 < args.seconds:
        batch = [train[(cursor + i) % len(train)] for i in range(args.prompts)]
        cursor += args.prompts
        rewards.append(
            grpo_step(model, tokenizer, opt, batch, args.group, args.max_new_tokens, args.temperature)
        )
        step += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= next_eval or elapsed >= args.seconds:
            next_eval += args.eval_every
            log.append(
                {
                    "t": round(elapsed, 1),
                    "step": step,
                    "train_reward": round(sum(rewards) / len(rewards), 3),
                    "greedy_acc": greedy_acc(),
                }
            )
            rewards = []
            print(json.dumps(log[-1]), flush=True)
    if args.save:
        model.save_pretrained(args.save)
        tokenizer.save_pretrained(args.save)


if __name__ == "__main__":
    main()
