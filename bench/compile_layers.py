"""torch.compile of the decoder layers vs eager: the actor update's step, same weights and batch, alternating.

Two copies of one plain model (the one-rank path of `fsdp_config.shard_one_rank`): A runs eager,
B has every decoder layer compiled in place (`nn.Module.compile`, so parameter names and the
checkpoint keys stay the same; Inductor's CPU backend fuses RMSNorm, rotary, SiLU-mul and the
residual adds around the matmuls). The step is bench/fsdp_vs_module.py's: `forward_log_probs` with
entropy through `ModuleEngine`, a token-mean loss, backward, clip, AdamW.

Printed: B's first step (the compile) against A's, the seconds per step of each per round and the
ratio compiled / eager per round and its median (below 1: compiling pays per step), the steps it
takes to earn the compile back, the first step at a second response length (`--second-length`:
a recompile, or with `--dynamic` a dynamic-shape graph), and the largest loss difference.

Run:
    python bench/compile_layers.py --threads 2                       # real-vocabulary model, 48 tokens
    python bench/compile_layers.py --threads 2 --response-length 256 --rounds 3 --steps 1
    python bench/compile_layers.py --model tiny --dynamic
    python bench/compile_layers.py --threads 2 --dynamic --group 4       # GRPO's shared-prompt forward
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import fsdp_vs_module as F  # noqa: E402


def _decoder_layers(module):
    classes = set()
    for m in module.modules():
        classes.update(getattr(m, "_no_split_modules", None) or [])
    return [m for m in module.modules() if type(m).__name__ in classes]


def _shared_prompts(batch, prompt_length: int, group: int) -> None:
    """Give every `group` consecutive rows the prompt of the first (in place)."""
    ids = batch["input_ids"]
    first = ids[::group, :prompt_length].repeat_interleave(group, 0)[: ids.shape[0]]
    ids[:, :prompt_length] = first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="real100m", help="real100m (bench/real_model.py), tiny, 30m or a folder"
    )
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument("--second-length", type=int, default=0, help="default: response length - 7")
    p.add_argument("--prompt-length", type=int, default=53)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per model per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--dynamic", action="store_true", help="compile with dynamic=True (one graph for all lengths)"
    )
    p.add_argument(
        "--group",
        type=int,
        default=0,
        help="rows per prompt, with the shared-prompt forward (GRPO's layout; 0: padded, every row its own prompt)",
    )
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    C.print_header(f"compiled decoder layers vs eager (bench/compile_layers.py), {args.threads} thread(s)")
    eager_model, compiled_model = F._models(args.model)
    layers = _decoder_layers(compiled_model)
    for layer in layers:
        layer.compile(dynamic=True if args.dynamic else False)
    engines = {"eager": F._engine(eager_model, 1e-5), "compiled": F._engine(compiled_model, 1e-5)}
    vocab = eager_model.config.vocab_size
    batch = F._batch(args.rows, args.prompt_length, args.response_length, vocab)
    if args.group:  # each prompt repeated for `group` rows, computed once per group
        import dataclasses

        for name, (engine, request) in engines.items():
            engines[name] = (engine, dataclasses.replace(request, prefix_group=True))
        _shared_prompts(batch, args.prompt_length, args.group)
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    first = {}
    for name in ("eager", "compiled"):  # the first step of each: allocator warm-up, and B's compile
        first[name], loss = F._step(*engines[name], batch)
        losses[name].append(loss)
    print(f"first step: eager {first['eager']:.2f} s, compiled {first['compiled']:.2f} s "
          f"({len(layers)} layers, dynamic={args.dynamic})", flush=True)  # fmt: skip
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(args.rounds):
        for name in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            secs = []
            for _ in range(args.steps):
                s, loss = F._step(*engines[name], batch)
                secs.append(s)
                losses[name].append(loss)
            times[name].append(C.median(secs))
            print(f"round {r + 1} {name}: {times[name][-1]:.3f} s/step (load avg {C.load_average()[0]:.2f})",
                  flush=True)  # fmt: skip
    ratios = [b / a for a, b in zip(times["eager"], times["compiled"])] or [float("nan")]
    eager_s, comp_s = C.median(times["eager"]), C.median(times["compiled"])
    compile_s = first["compiled"] - first["eager"]
    gain = eager_s - comp_s
    breakeven = f"{compile_s / gain:.0f} steps" if gain > 0 else "never (no gain per step)"
    second = args.second_length or max(1, args.response_length - 7)
    batch2 = F._batch(args.rows, args.prompt_length, second, vocab)
    if args.group:
        _shared_prompts(batch2, args.prompt_length, args.group)
    new_len = {name: F._step(*engines[name], batch2)[0] for name in ("eager", "compiled")}
    diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
    print(f"\n{args.rows} rows x ({args.prompt_length} + {args.response_length}) tokens, {args.model}: "
          f"eager {eager_s:.3f} s vs compiled {comp_s:.3f} s per step; compiled / eager per round "
          f"{', '.join(f'{x:.3f}' for x in ratios)} (median {C.median(ratios):.3f})")  # fmt: skip
    print(f"compile: {compile_s:.1f} s more on the first step; earned back after {breakeven}")
    print(f"first step at {second} response tokens: eager {new_len['eager']:.2f} s, compiled "
          f"{new_len['compiled']:.2f} s (a new shape: {'dynamic graph' if args.dynamic else 'recompile'})")  # fmt: skip
    print(f"max |loss difference| over {len(losses['eager'])} steps: {diff:.2e}")
    print(f"load average at the end: {[round(x, 2) for x in C.load_average()]}")


if __name__ == "__main__":
    main()
