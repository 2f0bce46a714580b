"""Offline generation: N responses per prompt to a parquet file (`main_generation` runs it).

The command and its keys are described in hybridrl/trainer/main_generation.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from hybridrl.config.roles import ModelConfig
from hybridrl.data.builtin_task import ensure_builtin_data
from hybridrl.data.rl_dataset import as_messages, compute_position_ids, read_rows, render_prompt
from hybridrl.models.builtin import resolve_model_path
from hybridrl.models.hf import load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.rollout.base import list_rollouts
from hybridrl.trainer.offline.checks import check_model_folder, check_output_path
from hybridrl.utils import plugins
from hybridrl.utils.config_loader import ConfigError, load_structured
from hybridrl.utils.device import get_torch_device

CONFIG_DIR = Path(__file__).parent.parent / "config"


@dataclass
class GenDataSection:
    path: Any = None  # parquet/jsonl; null -> the built-in task's validation prompts
    prompt_key: str = "prompt"
    n_samples: int = 1
    output_path: str | None = None  # null -> outputs/<input name>_responses.parquet
    batch_size: int = 128
    max_samples: int = -1
    use_chat_template: bool = True
    # extra keyword arguments of tokenizer.apply_chat_template
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


# registered engines this single-process generator does not run (sglang is not wired here)
UNSUPPORTED_ROLLOUTS = ("sglang",)


@dataclass
class GenModelSection:
    path: str = "builtin:tiny"
    tokenizer_path: str | None = None  # tokenizer to load (null: the model's path)
    trust_remote_code: bool = False  # allow the model's and tokenizer's remote code
    external_lib: Any = None  # a module name or a list of them (hybridrl.utils.plugins)


@dataclass
class GenRolloutSection:
    name: str = "hf"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0  # nucleus sampling top-p (1: off)
    do_sample: bool = True
    prompt_length: int = 512
    response_length: int = 512
    dtype: str = "fp32"
    seed: int = 0  # seed of the sampling
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    enforce_eager: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256


@dataclass
class GenTrainerSection:
    nnodes: int = 1  # only 1: generation runs in this one process
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
    config: GenerationConfig = load_structured(
        GenerationConfig, cfg, "hybridrl/trainer/config/generation.yaml", CONFIG_DIR / "generation.yaml"
    )
    r, d = config.rollout, config.data
    # The user's modules first: rollout.name is checked against the rollout registry they may extend.
    plugins.import_external_libs(plugins.external_lib_entries(config, ["model"]))
    known = [n for n in list_rollouts() if n not in UNSUPPORTED_ROLLOUTS]
    if r.name not in known:
        raise ConfigError(
            f"rollout.name={r.name!r} is not a registered rollout engine; registered: {known}. Register one "
            "with @register_rollout in a module named by model.external_lib, or fix the name"
        )
    for key, value in (
        ("data.n_samples", d.n_samples),
        ("data.batch_size", d.batch_size),
        ("rollout.response_length", r.response_length),
        ("rollout.prompt_length", r.prompt_length),
    ):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if r.temperature < 0:
        raise ConfigError(f"rollout.temperature must be >= 0 (0 = greedy), got {r.temperature}")
    t = config.trainer
    if (t.nnodes, t.n_gpus_per_node) != (1, 1):
        raise ConfigError(
            f"trainer.nnodes={t.nnodes}, trainer.n_gpus_per_node={t.n_gpus_per_node}: accepted for veRL "
            "compatibility, but generation runs in this one process on one device; set both to 1 "
            "(for more throughput use rollout.name=vllm with rollout.tensor_model_parallel_size)"
        )
    from hybridrl.trainer.offline.checks import check_generation_values

    check_generation_values(config)
    return config


# ----------------------------------------------------------------------------------------------
# generation through the rollout engines (hybridrl.rollout)
# ----------------------------------------------------------------------------------------------
def build_rollout(config: GenerationConfig, model_path: str, tokenizer, device: Any = None):
    """A standalone, single-rank HFRollout / VLLMRollout with the generation settings of `config`."""
    from hybridrl.rollout import RolloutConfig, create_rollout

    r, d = config.rollout, config.data
    rollout_config = RolloutConfig(
        name=r.name,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        do_sample=r.do_sample,
        n=d.n_samples,
        prompt_length=r.prompt_length,
        response_length=r.response_length,
        # full names: VLLMRollout hands the dtype to vLLM, which rejects the short ones
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(r.dtype, r.dtype),
        gpu_memory_utilization=r.gpu_memory_utilization,
        ignore_eos=r.ignore_eos,
        enforce_eager=r.enforce_eager,
        load_format="auto",
        tensor_model_parallel_size=r.tensor_model_parallel_size,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_num_seqs=r.max_num_seqs,
        log_prob_micro_batch_size_per_gpu=d.batch_size * d.n_samples,
        seed=r.seed,
    )
    if r.name == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine
        return create_rollout(rollout_config, model_path, tokenizer)
    return create_rollout(rollout_config, model_path, tokenizer, device=device)


def generate_responses(
    rollout, tokenizer, prompts: list[str], *, n: int = 1, batch_size: int = 64, validate: bool = False
) -> list[list[str]]:
    """`n` decoded responses to each rendered prompt text, from a rollout engine.

    Each prompt is tokenised without special tokens (the chat template added them), repeated n
    times, and sent in left-padded batches of `batch_size` prompts (`batch_size * n` rows).

    Returns:
        One list of n responses (special tokens skipped) per prompt, in order.
    """

    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(n)]
    texts: list[str] = []
    step = max(1, batch_size) * n
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        width = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), width), rollout.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        batch = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)},
            meta_info={"validate": validate},
        )
        out = rollout.generate_sequences(batch)
        for resp, m in zip(out.batch["responses"], out.batch["response_mask"]):
            texts.append(tokenizer.decode(resp[m.bool()].tolist(), skip_special_tokens=True))
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]


# ----------------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------------
def render_prompts(rows: list[dict], tokenizer, config: GenerationConfig, files_key: str) -> list[str]:
    """Prompt texts with the generation prompt; errors name the file key and row."""

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

    config = load_generation_config(cfg)
    d, r, m = config.data, config.rollout, config.model
    path = d.path
    if path is None:
        path = ensure_builtin_data()["val"]
    rows, _ = read_rows(path, "data.path", [d.prompt_key])
    if d.max_samples > 0:
        rows = rows[: d.max_samples]
    output = d.output_path or os.path.join("outputs", f"{Path(str(path)).stem}_responses.parquet")
    check_output_path(output, "data.output_path")  # written last: refuse a bad one before generating
    check_model_folder(m.path, "model.path")
    model_path = resolve_model_path(m.path, key="model.path")
    tok_path = resolve_model_path(m.tokenizer_path, key="model.tokenizer_path") if m.tokenizer_path else None
    tokenizer = load_tokenizer(
        ModelConfig(path=model_path, tokenizer_path=tok_path, trust_remote_code=m.trust_remote_code),
        key="model",
    )
    texts = render_prompts(rows, tokenizer, config, "data.path")
    _check_prompt_lengths(texts, tokenizer, r.prompt_length, str(path))
    device = torch.device("cpu") if config.trainer.device == "cpu" else get_torch_device()
    rollout = build_rollout(config, model_path, tokenizer, device=device)
    try:
        responses = generate_responses(rollout, tokenizer, texts, n=d.n_samples, batch_size=d.batch_size)
    finally:
        rollout.shutdown()
    written = _write_parquet(rows, responses, output)
    print(f"[hybridrl] wrote {len(rows)} prompts x {d.n_samples} responses to {written}", flush=True)
    return written
