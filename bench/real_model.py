"""The real-vocabulary workload of bench/compare_trl.py: a ~100M Qwen2 with a 32k BPE vocabulary.

No pretrained chat model ships on these machines, so the pieces are built offline and cached:
- a byte-level BPE tokenizer with 32,768 tokens, trained with `tokenizers` on the Python and
  Markdown sources of the installed packages (English prose and code; seconds), with ChatML
  special tokens (`<|endoftext|>` pad, `<|im_start|>`, `<|im_end|>` eos) and a ChatML chat template;
- a Qwen2 (hidden 768, 12 layers, 12 heads of 64 with 4 KV heads, MLP 2048, tied embeddings:
  ~100M parameters) with random weights (seed 0): throughput does not depend on what it learned,
  and a random model rarely emits EOS, so every response runs to the limit in both libraries;
- the built-in arithmetic prompts with a system message, ~60 tokens after the chat template.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

VOCAB = 32768
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = (
    "You are a careful assistant that solves arithmetic problems. Read the question, add the two "
    "numbers step by step and write the final answer as a number after four hash marks."
)
MODEL = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def _root() -> Path:
    return (
        Path(os.environ.get("HYBRIDRL_BENCH_DIR", Path.home() / ".cache" / "hybridrl" / "bench")) / "real100m"
    )


def _corpus(limit_bytes: int = 12 * 2**20):
    """Text of the installed packages' .py/.md files, up to `limit_bytes` (deterministic order)."""
    import site

    roots = [Path(p) for p in site.getsitepackages()]
    total = 0
    for root in roots:
        for pkg in ("transformers", "torch", "numpy", "pandas", "ray"):
            for path in sorted((root / pkg).rglob("*.py")) + sorted((root / pkg).rglob("*.md")):
                try:
                    text = path.read_text(errors="ignore")
                except OSError:
                    continue
                total += len(text)
                yield text
                if total >= limit_bytes:
                    return


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def build_data(folder: Path, tokenizer_dir: Path) -> dict[str, str]:
    """The built-in train/val prompts with the system message; returns the parquet paths."""
    import pandas as pd

    from hybridrl.data.builtin_task import ensure_builtin_data

    src = ensure_builtin_data()
    out = {}
    for split in ("train", "val"):
        df = pd.read_parquet(src[split])
        df["prompt"] = [[{"role": "system", "content": SYSTEM}, *[dict(m) for m in p]] for p in df["prompt"]]
        path = folder / f"{split}.parquet"
        df.to_parquet(path)
        out[split] = str(path)
    return out


def ensure_real_model(seed: int = 0) -> dict[str, str]:
    """Build (once) and return {'model': folder, 'train': parquet, 'val': parquet}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    root = _root()
    model_dir = root / f"qwen2_100m_seed{seed}"
    done = root / "DONE.json"
    if done.exists():
        return json.loads(done.read_text())
    tmp = root.with_name(f".real100m.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / model_dir.name).mkdir(parents=True)
    build_tokenizer(tmp / model_dir.name)
    tok = AutoTokenizer.from_pretrained(tmp / model_dir.name)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **MODEL,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(tmp / model_dir.name)
    paths = build_data(tmp, tmp / model_dir.name)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    result = {
        "model": str(model_dir),
        "train": paths["train"].replace(str(tmp), str(root)),
        "val": paths["val"].replace(str(tmp), str(root)),
    }
    done.write_text(json.dumps(result))
    return result


def describe(paths: dict[str, str]) -> str:
    """Parameters, vocabulary and the mean templated prompt length (one line)."""
    import pandas as pd
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(paths["model"])
    tok = AutoTokenizer.from_pretrained(paths["model"])
    h, layers, inter, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    params = v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    prompts = pd.read_parquet(paths["train"])["prompt"][:64]
    texts = [
        tok.apply_chat_template([dict(m) for m in p], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return f"Qwen2 ~{params / 1e6:.0f}M params, vocab {v:,} (BPE), prompts {sum(lens) / len(lens):.0f} tokens"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    p = ensure_real_model()
    print(p)
    print(describe(p))
