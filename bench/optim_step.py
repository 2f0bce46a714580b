"""One AdamW step on CPU: torch's per-parameter loop vs foreach vs the fused kernel, alternating.

The same parameters and gradients (random, seed 0) step with three AdamW instances built like
`hybridrl.engine.optim.build_optimizer` (lr 1e-5, weight decay 0.01): `single`
(foreach=False, torch's CPU default), `foreach` and `fused` (what build_optimizer picks on CPU).
Each round runs the three in turn; printed: milliseconds per step (median over rounds after one
warm-up round), each form over `single`, and the largest difference of the weights after the
rounds between `fused` and `single` started from the same copy.

Run:
    python bench/optim_step.py                      # tiny and the real-vocabulary ~100M model
    python bench/optim_step.py --models tiny --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

FORMS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def model_path(name: str) -> str:
    if name == "real100m":
        from real_model import ensure_real_model

        return ensure_real_model()["model"]
    return C.resolve_bench_model(name)


def measure(name: str, rounds: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path(name)).float()
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in base.parameters()]
    copies, opts = {}, {}
    for form, kw in FORMS.items():
        m = copy.deepcopy(base)
        for p, gr in zip(m.parameters(), grads):
            p.grad = gr.clone()
        copies[form] = m
        opts[form] = torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.01, **kw)
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    for r in range(rounds + 1):
        order = list(FORMS) if r % 2 == 0 else list(reversed(FORMS))
        for form in order:
            t = time.perf_counter()
            opts[form].step()
            if r:  # round 0 is the warm-up (state allocation)
                times[form].append(time.perf_counter() - t)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(copies["fused"].parameters(), copies["single"].parameters())
    )
    numel = sum(p.numel() for p in base.parameters())
    return {
        "model": name,
        "params": numel,
        "ms": {f: [t * 1e3 for t in ts] for f, ts in times.items()},
        "max_diff": diff,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models", default="tiny,real100m", help="comma-separated: tiny, 30m, real100m or a folder"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write all numbers to this file")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    info = C.print_header(f"AdamW step on CPU, {args.threads} thread(s) (bench/optim_step.py)")
    results = [measure(m, args.rounds) for m in args.models.split(",") if m]
    rows = []
    for res in results:
        med = {f: C.median(v) for f, v in res["ms"].items()}
        rows.append(
            [res["model"], f"{res['params']:,}"]
            + [C.fmt(med[f]) for f in FORMS]
            + [C.fmt(med[f] / med["single"]) for f in ("foreach", "fused")]
            + [f"{res['max_diff']:.2g}"]
        )
    C.print_table(
        ["model", "params", "single ms", "foreach ms", "fused ms", "foreach / single", "fused / single",
         "max |fused - single|"],
        rows,
    )  # fmt: skip
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")
    C.write_json(args.json, {"info": info, "threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
