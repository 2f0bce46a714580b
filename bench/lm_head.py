"""The chunked head at the response positions vs the plain full-logits path, alternating in one process.

One forward + backward of `forward_log_probs` (the actor update's pass, with entropy) on the
real-vocabulary model of bench/real_model.py (~100M Qwen2, 32k vocabulary): 16 rows of a ~53-token
prompt and `--response-length` response tokens. Prints seconds per pass and the peak of the
process's resident memory growth for each path, and the ratios (DESIGN.md principle 10).

Run:
    python bench/lm_head.py                      # 48 response tokens, 3 rounds
    python bench/lm_head.py --response-length 256 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _batch(rows: int, prompt: int, response: int, vocab: int):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    b = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:]}
    return TensorDict(b, batch_size=[rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument("--prompt-length", type=int, default=53)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import psutil
    import torch
    from real_model import ensure_real_model
    from transformers import AutoModelForCausalLM

    from hybridrl.workers.engine.forward import forward_log_probs

    torch.set_num_threads(args.threads)
    C.print_header("chunked head vs full logits (bench/lm_head.py)")
    model = AutoModelForCausalLM.from_pretrained(ensure_real_model()["model"], dtype=torch.float32)
    batch = _batch(args.rows, args.prompt_length, args.response_length, model.config.vocab_size)
    proc = psutil.Process()
    res: dict[str, list[tuple[float, float]]] = {"fused": [], "plain": []}

    def one(fused: bool) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        base = proc.memory_info().rss
        peak = [base]
        t = time.perf_counter()
        lp, ent = forward_log_probs(model, batch, calculate_entropy=True, fused=fused)
        peak.append(proc.memory_info().rss)
        (lp.mean() + 0.01 * ent.mean()).backward()
        peak.append(proc.memory_info().rss)
        return time.perf_counter() - t, (max(peak) - base) / 2**20

    one(True), one(False)  # warm-up
    for r in range(args.rounds):
        for name in ("fused", "plain"):
            s, mib = one(name == "fused")
            res[name].append((s, mib))
            print(
                f"round {r + 1} {name}: {s:.2f} s, +{mib:.0f} MiB RSS (load avg {C.load_average()[0]:.2f})",
                flush=True,
            )
    per = [a[0] / b[0] for a, b in zip(res["fused"], res["plain"])]
    print(
        f"\n{args.rows} rows x ({args.prompt_length} + {args.response_length}) tokens, fwd+bwd: "
        f"fused {C.median([x[0] for x in res['fused']]):.2f} s vs plain {C.median([x[0] for x in res['plain']]):.2f} s "
        f"(fused / plain per round: {', '.join(f'{x:.2f}' for x in per)}); RSS growth during the pass "
        f"{C.median([x[1] for x in res['fused']]):.0f} vs {C.median([x[1] for x in res['plain']]):.0f} MiB"
    )
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
