"""Turn a sharded checkpoint into a plain Hugging Face folder (veRL's `model_merger` CLI shape).

    python -m hybridrl.model_merger merge --backend fsdp --local_dir CKPT --target_dir OUT
    python -m hybridrl.model_merger test  --backend fsdp --local_dir CKPT --test_hf_dir HF

CKPT is a checkpoint folder written by `hybridrl.engine.checkpoint.save_checkpoint`:
an SFT `global_step_N/`, or the `actor/` folder of a PPO `global_step_N/`. The weights are read
from its `model/` torch.distributed.checkpoint shards (any number of ranks) in this one process,
without starting torch.distributed; the HF config and tokenizer come from CKPT/huggingface/ (or
--hf_model_path). LoRA adapters (`lora_adapter/adapter_config.json` next to the shards) are
merged into the base weights. OUT gets config.json, safetensors weights, the tokenizer and the
generation config: a folder that `from_pretrained` and vLLM load. A vision-language model (its
config has a `vision_config`) is built with `AutoModelForImageTextToText`, and OUT also gets its
processor files (image processor, chat template) from the same source folder.

`test` compares the merged weights with an existing HF folder (e.g. CKPT/huggingface).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from hybridrl.utils.safe_dcp import SafeFileSystemReader, check_dcp_tree
from hybridrl.utils.safe_io import load_state_file
from hybridrl.utils.torch_utils import str_to_dtype

__all__ = ["load_sharded_state_dict", "merge_checkpoint", "merge_lora", "main"]

HF_DIR = "huggingface"
LORA_DIR = "lora_adapter"


class MergeError(ValueError):
    """A checkpoint folder that cannot be merged; the message names the path and the fix."""


def find_shard_dir(local_dir: str) -> str:
    """The folder holding the DCP `.metadata` of the model: `local_dir/model` or `local_dir` itself."""
    root = Path(local_dir).expanduser()
    if not root.is_dir():
        raise MergeError(f"--local_dir {local_dir!r} is not a folder")
    for candidate in (root / "model", root):
        if (candidate / ".metadata").exists():
            return str(candidate)
    hint = ""
    if (root / "actor" / "model" / ".metadata").exists():
        hint = f" It has an actor checkpoint: use --local_dir {root / 'actor'}."
    raise MergeError(
        f"no torch.distributed.checkpoint shards in {local_dir!r} (expected model/.metadata): point --local_dir at a "
        f"checkpoint folder written by hybridrl (e.g. .../global_step_N or .../global_step_N/actor).{hint}"
    )


def load_sharded_state_dict(shard_dir: str) -> dict[str, torch.Tensor]:
    """The full model state dict from DCP shards, read in this process (no process group needed).

    Keys are those of the saved module; the top-level "model." wrapper the engine adds is removed.
    The `.metadata` pickle is read with a restricted unpickler first (hybridrl.utils.safe_dcp).
    """
    check_dcp_tree(shard_dir)
    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict = {}
        _load_state_dict(
            state,
            storage_reader=SafeFileSystemReader(shard_dir),  # .metadata: no code runs from it
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    except ImportError:  # private helpers moved: go through the public converter and a temp file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(shard_dir, out)
            state = load_state_file(out)
    if set(state) == {"model"} and isinstance(state["model"], dict):
        state = state["model"]
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise MergeError(f"{shard_dir}: the checkpoint holds no tensors")
    return tensors


def merge_lora(
    state: dict[str, torch.Tensor], scaling: float, adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """Fold PEFT LoRA tensors into the base weights: W + scaling * B @ A, under the base names.

    Args:
        state: a PEFT model's state dict (`base_model.model.` prefix, `.base_layer.` weights and
            `.lora_A.<adapter>.weight` (r, in) / `.lora_B.<adapter>.weight` (out, r) tensors).
        scaling: lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

    Returns:
        The plain model's state dict.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name:
            continue
        if ".base_layer." in name and name.endswith(".weight"):
            prefix = name.rsplit(".base_layer.", 1)[0]
            a, b = (
                state.get(f"{prefix}.lora_A.{adapter}.weight"),
                state.get(f"{prefix}.lora_B.{adapter}.weight"),
            )
            if a is not None and b is not None:
                merged = tensor.float() + scaling * (b.float() @ a.float())
                tensor = merged.to(tensor.dtype)
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[clean] = tensor
    return out


def _lora_scaling(local_dir: Path) -> float:
    path = local_dir / LORA_DIR / "adapter_config.json"
    if not path.exists():
        raise MergeError(
            f"the checkpoint in {local_dir} holds LoRA adapter weights but {path} is missing, so the LoRA scaling "
            "(lora_alpha / r) is unknown; copy the adapter_config.json of the run there"
        )
    cfg = json.loads(path.read_text())
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    return alpha / (r**0.5) if cfg.get("use_rslora") else alpha / r


def _config_source(local_dir: Path, hf_model_path: str | None) -> str:
    if hf_model_path:
        return hf_model_path
    if (local_dir / HF_DIR / "config.json").exists():
        return str(local_dir / HF_DIR)
    raise MergeError(
        f"no Hugging Face config: {local_dir / HF_DIR / 'config.json'} is missing; pass --hf_model_path "
        "<the model folder training started from>"
    )


def _auto_class(config):
    """AutoModelForImageTextToText for a vision-language config, else AutoModelForCausalLM."""
    from hybridrl.models.vlm import is_vlm_config

    if is_vlm_config(config):
        from transformers import AutoModelForImageTextToText as cls
    else:
        from transformers import AutoModelForCausalLM as cls
    return cls


def _copy_processor(config, source: str, out: Path) -> None:
    """A VLM's processor files from `source` into `out` (nothing for a text model)."""
    from hybridrl.models.vlm import is_vlm_config, save_processor_files

    if not is_vlm_config(config):
        return
    files = ("processor_config.json", "preprocessor_config.json")
    if not any((Path(source) / f).exists() for f in files):  # transformers would build its defaults
        raise MergeError(
            f"{source} has no processor files ({' / '.join(files)}) for this vision-language model; pass "
            "--hf_model_path <the model folder training started from>"
        )
    try:
        save_processor_files(config, out, source)
    except (OSError, ValueError, TypeError) as e:
        raise MergeError(
            f"{source} has no loadable processor for this vision-language model ({e}); pass --hf_model_path "
            "<the model folder training started from> (it holds preprocessor_config.json)"
        ) from e


def _build_model(config, state: dict[str, torch.Tensor], dtype: torch.dtype | None):
    with torch.device("meta"):
        model = _auto_class(config).from_config(config)
    expected = set(model.state_dict())
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise MergeError(
            f"checkpoint tensors do not belong to {type(model).__name__}: {unexpected[:5]}; is --hf_model_path the "
            "model that was trained?"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise MergeError(f"the checkpoint has no value for {missing[:5]} ({len(missing)} parameters)")
    if dtype is not None:
        model = model.to(dtype)
        model.config.torch_dtype = dtype
    return model


def merge_checkpoint(
    local_dir: str, target_dir: str, hf_model_path: str | None = None, dtype: str | None = None
) -> str:
    """Write the HF folder of the checkpoint in `local_dir` to `target_dir`; returns target_dir.

    Args:
        local_dir: checkpoint folder with `model/` DCP shards.
        target_dir: output folder (created; existing files are overwritten).
        hf_model_path: where config/tokenizer come from (default `local_dir/huggingface`).
        dtype: cast the weights ("fp32", "bf16", "fp16"); default: as saved.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    root = Path(local_dir).expanduser().resolve()
    state = load_sharded_state_dict(find_shard_dir(str(root)))
    if any(".lora_A." in k for k in state):
        state = merge_lora(state, _lora_scaling(root))
    source = _config_source(root, hf_model_path)
    config = AutoConfig.from_pretrained(source)
    model = _build_model(config, state, str_to_dtype(dtype) if dtype else None)
    out = Path(target_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    try:
        GenerationConfig.from_pretrained(source).save_pretrained(str(out))
    except OSError:
        pass  # no generation_config.json at the source
    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(str(out))
    except (OSError, ValueError, TypeError) as e:
        print(
            f"[hybridrl model_merger] no tokenizer copied from {source} ({e}); add one to {out}",
            file=sys.stderr,
        )
    _copy_processor(config, source, out)
    n = sum(t.numel() for t in model.state_dict().values())
    print(
        f"[hybridrl model_merger] merged {len(state)} tensors ({n / 1e6:.2f}M values) into {out}", flush=True
    )
    return str(out)


def compare_with_hf(
    local_dir: str, test_hf_dir: str, hf_model_path: str | None = None, atol: float = 1e-6
) -> None:
    """Raise MergeError unless the merged weights equal those of `test_hf_dir` (within atol)."""
    from transformers import AutoConfig

    cls = _auto_class(AutoConfig.from_pretrained(test_hf_dir))
    with tempfile.TemporaryDirectory() as tmp:
        merge_checkpoint(local_dir, tmp, hf_model_path=hf_model_path or None)
        merged = cls.from_pretrained(tmp, dtype=torch.float32).state_dict()
    reference = cls.from_pretrained(test_hf_dir, dtype=torch.float32).state_dict()
    if set(merged) != set(reference):
        raise MergeError(f"parameter names differ: {sorted(set(merged) ^ set(reference))[:5]}")
    for name, value in merged.items():
        if not torch.allclose(value, reference[name], atol=atol, rtol=0):
            diff = (value - reference[name]).abs().max().item()
            raise MergeError(f"{name} differs from {test_hf_dir} by up to {diff:.3g}")
    print(f"[hybridrl model_merger] {len(merged)} tensors match {test_hf_dir}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hybridrl.model_merger", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("merge", "test"):
        p = sub.add_parser(name)
        p.add_argument(
            "--backend",
            default="fsdp",
            choices=["fsdp", "megatron"],
            help="checkpoint format (fsdp: DCP shards; megatron: dist_checkpointing, docs/megatron.md)",
        )
        p.add_argument("--local_dir", required=True, help="checkpoint folder with model/ shards")
        p.add_argument(
            "--hf_model_path", default=None, help="config/tokenizer source (default local_dir/huggingface)"
        )
        if name == "merge":
            p.add_argument("--target_dir", required=True, help="output Hugging Face folder")
            p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="cast the weights")
        else:
            p.add_argument("--test_hf_dir", required=True, help="HF folder to compare against")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "merge" and args.backend == "megatron":
            from hybridrl.engine.megatron.merge import merge_megatron_checkpoint

            merge_megatron_checkpoint(args.local_dir, args.target_dir, args.hf_model_path, args.dtype)
        elif args.backend == "megatron":
            raise MergeError("`test` supports --backend fsdp only; merge, then compare the folders")
        elif args.command == "merge":
            merge_checkpoint(args.local_dir, args.target_dir, args.hf_model_path, args.dtype)
        else:
            compare_with_hf(args.local_dir, args.test_hf_dir, args.hf_model_path)
    except MergeError as e:
        print(f"[hybridrl model_merger] error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
