"""SFT warm start of the built-in model on the code task (recipes/code_env/run.sh, step 1).

Starts from `builtin:tiny` and trains (AdamW, learning rate decaying linearly to 0) on (spec, program) pairs of two teachers: for a bracketed
spec such as `f(x)=3(x+2)`, 70% of the programs (`--bug-fraction`) have the precedence bug
(`return 3*x+2`, fails every test) and 30% are right (`return 3*(x+2)`); plain specs are always
right. The two differ at one character, so greedy decoding writes the bug for bracketed specs and
passes about half the validation specs, while sampling writes the bracket about a third of the
time. GRPO then has to find that the bracket makes the tests pass.

The pairs are tokenised as main_ppo renders a prompt (the chat template with the generation
prompt) followed by the program and EOS; the loss covers the program only. At the end the greedy
pass rate on the validation specs is measured in-process, every program run against its tests in
the local sandbox, and written to warm_start.json.

    python recipes/code_env/warm_start.py --out outputs/code_env/warm_start [--steps 250]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import task  # noqa: E402


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def encode_pair(tokenizer, spec, bracket: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 on the prompt) of one teacher program."""
    ids = list(prompt_ids(tokenizer, task.prompt_text(spec)))
    resp = tokenizer(task.program(spec, bracket), add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    return ids + resp, [-100] * len(ids) + resp


def batch_tensors(seqs, pad_id):
    width = max(len(x) for x, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)], lab[i, : len(y)], att[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, att, lab


@torch.no_grad()
def greedy_pass_rate(model, tokenizer, specs, sandbox) -> dict[str, float]:
    """Share of specs whose greedy program passes all its tests, overall and per kind."""
    from hybridrl.reward.scorers.code_tests import score_with_sandbox

    model.eval()
    passed = {k: [] for k in task.KINDS}
    for spec in specs:
        ids = torch.tensor([prompt_ids(tokenizer, task.prompt_text(spec))])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        passed[spec[0]].append(score_with_sandbox(sandbox, text, task.tests(spec))["acc"])
    model.train()
    every = [p for v in passed.values() for p in v]
    return {"all": sum(every) / len(every), **{k: sum(v) / max(1, len(v)) for k, v in passed.items()}}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--bug-fraction", type=float, default=0.7, help="share of bracketed programs with the bug"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eval-every", type=int, default=0, help="greedy pass rate every N steps (0: at the end)"
    )
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.models.builtin import get_builtin_model_path
    from hybridrl.sandbox import Sandbox

    src = get_builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sandbox = Sandbox()
    rng = random.Random(args.seed)
    train = [s for s in task.all_specs() if task.spec_split(s) == "train"]
    val = [s for s in task.all_specs() if task.spec_split(s) == "val"]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    # linear decay to 0: at a constant 1e-3 the loss spikes late and the digits are copied wrong again
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - i / args.steps)
    curve, t0 = [], time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        pairs = [
            encode_pair(tokenizer, rng.choice(train), rng.random() >= args.bug_fraction)
            for _ in range(args.batch_size)
        ]
        ids, att, lab = batch_tensors(pairs, tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            rate = greedy_pass_rate(model, tokenizer, val, sandbox)
            curve.append(
                {"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in rate.items()}}
            )
            print(
                f"warm start step {step} loss {loss.item():.4f} greedy pass {rate} ({time.perf_counter() - t0:.0f}s)"
            )
            sys.stdout.flush()
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
