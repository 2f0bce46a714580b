"""How many torch threads should one training worker use? Measured side by side (A B C A B C ...).

Each variant is a fresh child process that runs forward + backward + AdamW steps of a small Qwen2
(hidden 256, 4 layers, vocabulary 4096, 16 rows x 96 tokens) for `--seconds` and reports steps/s:
    t1            1 torch thread (the old default: trainer.cpus_per_worker=1)
    t<N>          N torch threads (OpenMP's default wait policy: idle threads spin for a while)
    t<N>_passive  N threads with OMP_WAIT_POLICY=PASSIVE (idle threads sleep instead of spinning)
With `--compete K` K one-thread matmul loops run beside every measurement (a loaded machine).
Ratios are to t1 per round; the load average is printed with every row.

Run:
    python bench/threads.py                       # t1, t2, t2_passive, 3 rounds x 4 s
    python bench/threads.py --compete 1           # the same with one competing busy process
    python bench/threads.py --variants t1,t2,t4,t4_passive --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

_CHILD = """
import json, sys, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
threads, seconds, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=256)
model = Qwen2ForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, 4096, (16, 96))
def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad()
step()
n, t = 0, time.perf_counter()
while time.perf_counter() - t < seconds:
    step(); n += 1
json.dump({"steps_per_s": n / (time.perf_counter() - t), "threads": torch.get_num_threads()}, open(out, "w"))
"""

_BUSY = """
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
while True:
    a = (a @ a).clamp_(-1, 1)
"""


def run_variant(name: str, seconds: float, result: str) -> dict:
    threads = int(name[1:].split("_")[0])
    env = {**os.environ, **C.ONE_THREAD_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if name.endswith("_passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    subprocess.run([sys.executable, "-c", _CHILD, str(threads), str(seconds), result], env=env, check=True)
    return json.loads(Path(result).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="t1,t2,t2_passive")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--compete", type=int, default=0, help="one-thread busy processes beside each run")
    args = p.parse_args()
    C.print_header("torch threads per worker (bench/threads.py)")
    names = args.variants.split(",")
    rates: dict[str, list[float]] = {n: [] for n in names}
    busy = [
        subprocess.Popen([sys.executable, "-c", _BUSY], env={**os.environ, **C.ONE_THREAD_ENV})
        for _ in range(args.compete)
    ]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for n in names:
                    res = run_variant(n, args.seconds, os.path.join(tmp, "r.json"))
                    rates[n].append(res["steps_per_s"])
                    print(
                        f"round {r + 1} {n}: {res['steps_per_s']:.2f} steps/s ({res['threads']} threads, "
                        f"load avg {C.load_average()[0]:.2f})",
                        flush=True,
                    )
    finally:
        for b in busy:
            b.kill()
    print(f"\n{args.compete} competing busy process(es); ratio to t1, per round and median:")
    rows = []
    for n in names:
        per = [a / b for a, b in zip(rates[n], rates[names[0]])]
        rows.append([n, C.fmt(C.median(rates[n])), ", ".join(f"{x:.2f}" for x in per), C.fmt(C.median(per))])
    C.print_table(["variant", "steps/s (median)", f"/ {names[0]} per round", "median ratio"], rows)
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
