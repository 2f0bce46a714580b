"""SFT warm start of the built-in model on guess-the-number (recipes/env/run.sh, step 1).

Starts from `builtin:tiny` (which answers `#### N`) and trains on whole games of two teachers:
70% of the games (`--bisect-fraction` 0.3) scan upwards (1, 2, 3, ... : with 4 turns on 1-8 that
wins half the games), 30% bisect (guess the middle of what is left after "higher" / "lower": that
wins every game). The two differ from the first guess on, so the model learns both strategies but
opens with the scan 70% of the time: greedy decoding scans and wins about half the games, sampling
bisects in about a third of them. GRPO then has to learn that bisecting earns the reward.

The games are tokenised exactly as the `env_agent` loop builds them at rollout time (the prompt,
each generated turn + EOS, each observation as a chat-template user turn) and the loss covers the
assistant turns only. At the end the greedy win rate on the validation secrets is measured
in-process against the environment and written to warm_start.json (`--eval-every` also prints it
during training).

    python recipes/env/warm_start.py --out outputs/env/warm_start [--steps 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import torch

from hybridrl.env.guess_number import GuessNumber


def teacher_game(
    secret: int, high: int, max_turns: int, rng: random.Random, bisect: bool
) -> list[tuple[str, str]]:
    """(assistant text, observation) per turn of one teacher game; the last observation is ''.

    bisect: guess the middle of what is left (the lower or upper middle at random); otherwise scan
    upwards from the lowest number still possible (1, 2, 3, ...)."""
    lo, hi, turns = 1, high, []
    for _ in range(max_turns):
        guess = rng.choice(sorted({(lo + hi) // 2, (lo + hi + 1) // 2})) if bisect else lo
        if guess == secret:
            turns.append((f"#### {guess}", ""))
            break
        obs = "higher" if guess < secret else "lower"
        turns.append((f"#### {guess}", obs))
        lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
    return turns


def encode_game(tokenizer, renderer, first: str, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 off the assistant turns), as env_agent builds them."""
    from hybridrl.agent.tokenization import conversation_ids

    ids = list(conversation_ids(tokenizer, [{"role": "user", "content": first}], True, None))
    labels = [-100] * len(ids)
    for action, obs in turns:
        turn = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += turn
        labels += turn
        if obs:
            user = renderer.ids([obs], role="user")
            ids += user
            labels += [-100] * len(user)
    return ids, labels


def batch_tensors(seqs, pad_id):
    width = max(len(x) for x, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)], lab[i, : len(y)], att[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, att, lab


@torch.no_grad()
def greedy_win_rate(model, tokenizer, renderer, secrets: list[int], high: int, max_turns: int) -> float:
    """Fraction of games won by greedy decoding, played against GuessNumber turn by turn."""
    from hybridrl.agent.tokenization import conversation_ids

    model.eval()
    wins = 0
    for secret in secrets:
        env = GuessNumber(high=high, max_turns=max_turns)
        obs = asyncio.run(env.reset({"extra_info": {"secret": secret}}))
        ids = list(conversation_ids(tokenizer, [{"role": "user", "content": obs}], True, None))
        for _ in range(max_turns):
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            gen = out[0, len(ids) :].tolist()
            ids += gen
            obs, reward, done, _ = asyncio.run(env.step(tokenizer.decode(gen, skip_special_tokens=True)))
            if reward > 0:
                wins += 1
            if done:
                break
            ids += renderer.ids([obs], role="user")
    model.train()
    return wins / len(secrets)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--high", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--bisect-fraction", type=float, default=0.3, help="share of teacher games that bisect")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="greedy win rate every N steps (0: at the end)")
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.agent.tokenization import ToolTurnRenderer
    from hybridrl.env.guess_number import make_rows
    from hybridrl.models.builtin import get_builtin_model_path

    src = get_builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    renderer = ToolTurnRenderer(tokenizer)
    rng = random.Random(args.seed)
    first = f"guess 1-{args.high}"
    val_secrets = [r["extra_info"]["secret"] for r in make_rows(args.n_eval, 1, args.high, args.max_turns)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    curve, t0 = [], time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        games = [
            encode_game(
                tokenizer, renderer, first, teacher_game(secret, args.high, args.max_turns, rng, bisect)
            )
            for secret, bisect in (
                (rng.randint(1, args.high), rng.random() < args.bisect_fraction)
                for _ in range(args.batch_size)
            )
        ]
        ids, att, lab = batch_tensors(games, tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            win = greedy_win_rate(model, tokenizer, renderer, val_secrets, args.high, args.max_turns)
            curve.append({"step": step, "loss": round(loss.item(), 4), "greedy_win": round(win, 4)})
            print(
                f"warm start step {step} loss {loss.item():.4f} greedy win {win:.3f} ({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    info = {**vars(args), "curve": curve, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "warm_start.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
