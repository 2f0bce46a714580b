"""actor.use_prefix_grouper: one forward+backward of a GRPO micro-batch, plain vs shared-prompt.

The micro-batch is `--prompts` prompts x `--n` responses of the real-vocabulary model of
bench/real_model.py (~100M Qwen2, 32k vocabulary; random weights), prompts of `--prompt-len`
tokens, responses of each length in `--response-lengths`; the loss is the actor's (log-probs and
entropy through the chunked head). Layouts: `padded` (the default, use_remove_padding=False),
`packed` (use_remove_padding=True: one row, a block-causal mask) and `grouped`
(use_prefix_grouper). Runs alternate the layouts `--rounds` times; prints the median seconds,
the ratios to `padded`, and the tokens each layout runs.

    python bench/prefix_grouper.py --threads 2 --response-lengths 48,256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_batch(prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompts, prompt_len), generator=g).repeat_interleave(n, 0)
    resp = torch.randint(3, vocab, (prompts * n, response_len), generator=g)
    ids = torch.cat([prompt, resp], 1)
    mask = torch.ones_like(ids)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1),
        "responses": resp,
        "response_mask": mask[:, -response_len:],
    }


MODES = {  # name -> forward_log_probs layout arguments
    "padded": dict(use_remove_padding=False),  # hybridrl's (and veRL's) default layout
    "packed": dict(use_remove_padding=True),
    "grouped": dict(prefix_group=True),
}


def step(model, batch, mode: str) -> float:
    from hybridrl.engine.forward import forward_log_probs

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = forward_log_probs(model, batch, calculate_entropy=True, **MODES[mode])
    lp, ent = out.log_probs, out.entropy
    ((lp + 0.01 * ent) * batch["response_mask"]).sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=60)
    ap.add_argument("--response-lengths", default="48,256")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from real_model import ensure_real_model
    from transformers import AutoModelForCausalLM

    from hybridrl.engine.prefix_group import build_prefix_layout

    model = AutoModelForCausalLM.from_pretrained(ensure_real_model()["model"], dtype=torch.float32)
    vocab = model.config.vocab_size
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}; "
          f"{args.prompts} prompts x {args.n}, prompt {args.prompt_len} tokens; forward+backward s")  # fmt: skip
    modes = list(MODES)
    print(f"{'response':>8s} {'tokens':>7s} {'grouped':>8s} " + " ".join(f"{m + ' s':>9s}" for m in modes)
          + " " + " ".join(f"{'padded/' + m:>14s}" for m in modes[1:]))  # fmt: skip
    for t in (int(x) for x in args.response_lengths.split(",")):
        batch = make_batch(args.prompts, args.n, args.prompt_len, t, vocab)
        layout = build_prefix_layout(batch["input_ids"], batch["attention_mask"], t)
        for mode in modes:  # warm-up
            step(model, batch, mode)
        times = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                times[mode].append(step(model, batch, mode))
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"{t:8d} {int(batch['attention_mask'].sum()):7d} {layout.num_tokens:8d} "
              + " ".join(f"{med[m]:9.2f}" for m in modes) + " "
              + " ".join(f"{med['padded'] / med[m]:13.2f}x" for m in modes[1:]))  # fmt: skip


if __name__ == "__main__":
    main()
