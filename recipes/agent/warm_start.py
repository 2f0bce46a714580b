"""SFT warm start of the built-in model on the built-in tool task (recipes/agent/run.sh, step 1).

Starts from `builtin:tiny` and trains on conversations of hybridrl.data.agent_task that call the
calculator (hermes format), plus direct-answer prompts labelled on their first token only, so that
the model starts an answer with a tool call with probability `--tool-fraction` (greedy decoding
then answers directly, which the model cannot do). The sequences are tokenised exactly as the tool agent builds them at
rollout time (prompt ids, generated turn ids + EOS, the chat template's tool-turn ids), and the
loss covers the assistant turns only. The result is a model that *sometimes* calls the tool; GRPO
then has to learn to call it every time.

    python recipes/agent/warm_start.py --out /tmp/agent_sft --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def encode(tokenizer, renderer, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and loss labels (-100 off the assistant turns) of one conversation."""
    ids = tokenizer.apply_chat_template(
        conversation[:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = list(ids)
    labels = [-100] * len(ids)
    for msg in conversation[1:]:
        if msg["role"] == "assistant":
            turn = tokenizer(msg["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids += turn
            labels += turn
        else:
            turn = renderer.ids([msg["content"]])
            ids += turn
            labels += [-100] * len(turn)
    return ids, labels


def _pad(seqs, pad_id):
    width = max(len(x) for x, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)], lab[i, : len(y)], att[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, att, lab


def batches(tokenizer, renderer, steps: int, batch_size: int, tool_fraction: float, seed: int):
    """Per step: `batch_size` tool-using conversations (every assistant token labelled) and enough
    direct-answer prompts, labelled on their first assistant token only, that the first token of
    an answer is the tool call with probability `tool_fraction`. So the model learns the whole
    tool path from every example, while its *choice* to call stays at `tool_fraction`."""
    from hybridrl.data import agent_task

    n_direct = round(batch_size * (1 - tool_fraction) / tool_fraction)
    pairs = agent_task.sample_pairs(steps * (batch_size + n_direct), seed, "train")
    per = batch_size + n_direct
    for s in range(steps):
        chunk = pairs[s * per : (s + 1) * per]
        tool = [
            encode(tokenizer, renderer, agent_task.tool_conversation(a, b)) for a, b in chunk[:batch_size]
        ]
        direct = []
        for a, b in chunk[batch_size:]:
            ids, labels = encode(tokenizer, renderer, agent_task.direct_conversation(a, b))
            first = labels.index(next(x for x in labels if x != -100))
            direct.append((ids[: first + 1], [-100] * first + [ids[first]]))
        yield _pad(tool, tokenizer.pad_token_id), _pad(direct, tokenizer.pad_token_id)


def first_label_mask(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the first labelled position of each row."""
    valid = labels != -100
    return valid & (valid.cumsum(-1) == 1)


def step_loss(model, tool_batch, direct_batch) -> torch.Tensor:
    """Mean CE over the tool conversations' tokens after the first assistant token, plus the mean
    CE over every example's first assistant token (the call-or-answer choice)."""
    firsts, rest = [], []
    for ids, att, lab in (tool_batch, direct_batch):
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        target = lab[:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1).clamp(min=0), reduction="none"
        ).view_as(target)
        first = first_label_mask(target)
        firsts.append(ce[first])
        rest.append(ce[(target != -100) & ~first])
    rest_t = torch.cat(rest)
    return torch.cat(firsts).mean() + (rest_t.mean() if rest_t.numel() else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tool-fraction", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="torch threads (default: cores, at most 4)",
    )
    ap.add_argument(
        "--init", default="builtin:tiny", help="model to start from (default: the built-in model)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.workers.agent.tokenization import ToolTurnRenderer

    src = get_builtin_model_path() if args.init in ("builtin", "builtin:tiny") else args.init
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    renderer = ToolTurnRenderer(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    t0 = time.perf_counter()
    loss = float("nan")
    for step, (tool_batch, direct_batch) in enumerate(
        batches(tokenizer, renderer, args.steps, args.batch_size, args.tool_fraction, args.seed)
    ):
        loss_t = step_loss(model, tool_batch, direct_batch)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = loss_t.item()
        if (step + 1) % 50 == 0:
            print(
                f"warm start step {step + 1}/{args.steps} loss {loss:.4f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval()
    out_dir = Path(args.out)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    info = {**vars(args), "final_loss": round(loss, 4), "seconds": round(time.perf_counter() - t0, 1)}
    (out_dir / "warm_start.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
