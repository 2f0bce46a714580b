"""The chunked head at the response positions vs the plain full-logits path, alternating in one process.

One forward + backward of `forward_log_probs` (the actor update's pass, with entropy) on the
real-vocabulary model of bench/real_model.py (~100M Qwen2, 32k vocabulary): 16 rows of a ~53-token
prompt and `--response-length` response tokens. Prints seconds per pass and the peak of the
process's resident memory growth for each path, and the ratios.

`--variants fused,keep` compares the chunked head recomputing its logits in the backward (`fused`,
`lm_head.KEEP_LOGITS_BYTES = 0`) with the chunked head keeping them (`keep`, 1 GiB budget), and
prints CPU seconds too (the robust number on a loaded machine).

Run:
    python bench/lm_head.py                      # 48 response tokens, 3 rounds
    python bench/lm_head.py --response-length 256 --rounds 2
    python bench/lm_head.py --variants fused,keep --rounds 4
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
    p.add_argument("--variants", default="fused,plain", help="two or more of fused, keep, plain")
    args = p.parse_args()
    names = [v for v in args.variants.split(",") if v]
    if len(names) < 2 or set(names) - {"fused", "keep", "plain"}:
        p.error(f"--variants: two or more of fused, keep, plain; got {args.variants!r}")
    import psutil
    import torch
    from real_model import ensure_real_model
    from transformers import AutoModelForCausalLM

    from hybridrl.engine import lm_head
    from hybridrl.engine.forward import forward_log_probs

    torch.set_num_threads(args.threads)
    C.print_header("chunked head vs full logits (bench/lm_head.py)")
    model = AutoModelForCausalLM.from_pretrained(ensure_real_model()["model"], dtype=torch.float32)
    batch = _batch(args.rows, args.prompt_length, args.response_length, model.config.vocab_size)
    proc = psutil.Process()
    res: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}

    def one(name: str) -> tuple[float, float, float]:
        """(wall s, CPU s, peak RSS growth MiB) of one forward + backward of variant `name`."""
        lm_head.KEEP_LOGITS_BYTES = 2**30 if name == "keep" else 0
        model.zero_grad(set_to_none=True)
        base = proc.memory_info().rss
        peak = [base]
        t, c = time.perf_counter(), time.process_time()
        out = forward_log_probs(model, batch, calculate_entropy=True, fused=name != "plain")
        lp, ent = out.log_probs, out.entropy
        peak.append(proc.memory_info().rss)
        (lp.mean() + 0.01 * ent.mean()).backward()
        peak.append(proc.memory_info().rss)
        return time.perf_counter() - t, time.process_time() - c, (max(peak) - base) / 2**20

    for name in names:  # warm-up
        one(name)
    for r in range(args.rounds):
        for name in names:
            s, cpu, mib = one(name)
            res[name].append((s, cpu, mib))
            print(
                f"round {r + 1} {name}: {s:.2f} s, {cpu:.2f} CPU s, +{mib:.0f} MiB RSS "
                f"(load avg {C.load_average()[0]:.2f})",
                flush=True,
            )
    a, b = names[0], names[1]
    per = [x[0] / y[0] for x, y in zip(res[a], res[b])]
    per_cpu = [x[1] / y[1] for x, y in zip(res[a], res[b])]
    med = {n: [C.median([x[i] for x in res[n]]) for i in range(3)] for n in names}
    print(
        f"\n{args.rows} rows x ({args.prompt_length} + {args.response_length}) tokens, fwd+bwd, medians: "
        + "; ".join(f"{n} {m[0]:.2f} s / {m[1]:.2f} CPU s / +{m[2]:.0f} MiB" for n, m in med.items())
        + f"\n{a} / {b} per round: wall {', '.join(f'{x:.2f}' for x in per)}; "
        f"CPU {', '.join(f'{x:.2f}' for x in per_cpu)}"
    )
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
