"""SFT warm start of the built-in model on the built-in tool task (recipes/agent/run.sh, step 1).

Starts from `builtin:tiny` and trains on conversations of hybridrl.data.agent_task that call the
calculator (hermes format), plus direct-answer prompts labelled on their first token only, so that
the model starts an answer with a tool call with probability `--tool-fraction` (greedy decoding
then answers directly, which the model cannot do). The sequences are tokenised exactly as the tool
agent builds them at rollout time (prompt ids, generated turn ids + EOS, the chat template's
tool-turn ids), and the loss covers the assistant turns only. The result is a model that
*sometimes* calls the tool; GRPO then has to learn to call it every time.

When to stop: the loss is the call-or-answer choice's cross-entropy (its floor is the entropy of
`--tool-fraction`, H(0.3) = 0.611 nats) plus the cross-entropy of the tool path (the call format,
copying the operands and the result; its floor is 0). The loss sits on a plateau well above the
floor until the tool path is learnt, and how many steps that takes depends on float rounding (CPU,
thread count). So training runs until the mean loss of the last `--window` steps is at most
`--target-loss` (default: H(tool_fraction) + `--target-margin`), or `--steps` steps (the cap).
warm_start.json records which (`reached_target`, `stop_step`); the exit status is 3 when the cap
came first, so a script can stop before running GRPO on a model that never calls the tool right.

    python recipes/agent/warm_start.py --out /tmp/agent_sft              # to the target, <= 1500 steps
    python recipes/agent/warm_start.py --out /tmp/agent_sft --target-loss 0  # exactly --steps steps
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections import deque
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
    pairs = agent_task.iter_pairs(seed, "train")  # the same pairs as sample_pairs, drawn lazily
    per = batch_size + n_direct
    for _ in range(steps):
        chunk = list(itertools.islice(pairs, per))
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


def step_loss(model, tool_batch, direct_batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean CE over the tool conversations' tokens after the first assistant token, plus the mean
    CE over every example's first assistant token (the call-or-answer choice).

    Returns:
        (loss, choice, path): the scalar loss and its two terms (choice CE, tool-path CE).
    """
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
    choice = torch.cat(firsts).mean()
    path = rest_t.mean() if rest_t.numel() else torch.zeros(())
    return choice + path, choice, path


def choice_entropy(tool_fraction: float) -> float:
    """Entropy (nats) of calling with probability ``tool_fraction``: the floor of the choice CE."""
    f = tool_fraction
    return -(f * math.log(f) + (1 - f) * math.log(1 - f))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500, help="step cap (default 1500)")
    ap.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="stop when the mean loss of the last --window steps is <= this; 0: run --steps steps "
        "(default: entropy of --tool-fraction + --target-margin)",
    )
    ap.add_argument("--target-margin", type=float, default=0.015)
    ap.add_argument("--window", type=int, default=20)
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
    args = ap.parse_args(argv)
    if not 0 < args.tool_fraction < 1:
        ap.error(f"--tool-fraction must be in (0, 1), got {args.tool_fraction}")
    if args.target_loss is None:
        args.target_loss = round(choice_entropy(args.tool_fraction) + args.target_margin, 4)
    return args


def train(model, tokenizer, renderer, args, log) -> dict:
    """Train until the windowed mean loss is <= args.target_loss (if > 0) or args.steps steps.

    Writes one JSON line per step to ``log`` (step, loss, choice, path, windowed mean).
    Returns: {"stop_step", "reached_target", "final_loss", "window_loss"}.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    t0 = time.perf_counter()
    recent: deque[float] = deque(maxlen=args.window)
    loss, mean, reached, step = float("nan"), float("nan"), False, 0
    data = batches(tokenizer, renderer, args.steps, args.batch_size, args.tool_fraction, args.seed)
    for step, (tool_batch, direct_batch) in enumerate(data, start=1):
        loss_t, choice, path = step_loss(model, tool_batch, direct_batch)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = loss_t.item()
        recent.append(loss)
        mean = sum(recent) / len(recent)
        rec = {"step": step, "loss": round(loss, 5), "choice": round(choice.item(), 5)}
        rec.update(path=round(path.item(), 5), window_loss=round(mean, 5))
        log.write(json.dumps(rec) + "\n")
        log.flush()
        reached = args.target_loss > 0 and len(recent) == args.window and mean <= args.target_loss
        if step % 50 == 0 or reached:
            print(
                f"warm start step {step}/{args.steps} loss {loss:.4f} (mean of last "
                f"{len(recent)}: {mean:.4f}, target {args.target_loss}) "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
        if reached:
            break
    return {
        "stop_step": step,
        "reached_target": reached or args.target_loss <= 0,
        "final_loss": round(loss, 4),
        "window_loss": round(mean, 4),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.agent.tokenization import ToolTurnRenderer
    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.models.hf import check_whitespace

    src = get_builtin_model_path() if args.init in ("builtin", "builtin:tiny") else args.init
    tokenizer = AutoTokenizer.from_pretrained(src)
    check_whitespace(tokenizer, f"--init {args.init!r}")  # a folder built before 2026-12-02 drops spaces
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    renderer = ToolTurnRenderer(tokenizer)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out_dir / "warm_start_loss.jsonl", "w") as log:
        result = train(model, tokenizer, renderer, args, log)
    model.eval()
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    info = {**vars(args), **result, "seconds": round(time.perf_counter() - t0, 1)}
    (out_dir / "warm_start.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    if result["reached_target"]:
        how = "reached the target" if args.target_loss > 0 else "ran the fixed number of steps"
        print(f"warm start {how} at step {result['stop_step']}", flush=True)
    else:
        print(
            f"warm start: the mean loss of the last {min(args.window, result['stop_step'])} steps is still "
            f"{result['window_loss']} after the cap of {args.steps} steps (target "
            f"{args.target_loss}): the tool-call format is not learnt, GRPO would see zero reward. "
            "Raise --steps (AGENT_SFT_STEPS) or try another --seed.",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(3)


if __name__ == "__main__":
    main()
