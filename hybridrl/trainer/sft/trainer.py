"""The SFT trainer: FSDP2 engine, token-mean loss over the global batch, exact resume.

Every rank runs the same loop (no Ray, no driver). Each optimizer step draws one global batch
of `data.train_batch_size` rows from a resumable sampler (same indices on every rank); a rank
keeps rows `rank::world` and runs them in micro-batches of `data.micro_batch_size_per_gpu`.
The loss of the step is the mean negative log-likelihood over all loss tokens of the global
batch, so gradient accumulation and the number of ranks do not change the gradient.

Checkpoint layout (`trainer.default_local_dir/global_step_N/`, written to `.tmp` and renamed):
    model/ optimizer/ extra_state_rank*.pt meta.json   engine checkpoint (DCP shards, RNG, lr)
    huggingface/                                       full HF model + tokenizer ('hf_model')
    data.pt                                            data loader state and global step
    lora_adapter/adapter_config.json                   LoRA settings (LoRA runs only)
and `latest_checkpointed_iteration.txt` names the newest step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.data.builtin_task import ensure_builtin_data
from hybridrl.data.rl_dataset import as_messages, read_rows, render_prompt
from hybridrl.data.sampler import ResumableSampler, RLDataLoader
from hybridrl.data.sft_dataset import MultiTurnSFTDataset, SFTDataConfig, SFTDataset
from hybridrl.models.builtin import resolve_model_path
from hybridrl.models.hf import load_tokenizer
from hybridrl.trainer.offline.evaluation import GreedyEval, dig
from hybridrl.trainer.sft.config import SFTConfig, is_builtin_model
from hybridrl.utils import checkpointing as ckpt_io
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.safe_io import load_state_file
from hybridrl.utils.tracking import Tracking
from hybridrl.workers.config import ModelConfig, OptimConfig
from hybridrl.workers.engine.fsdp import FSDPEngine, clip_grad_norm
from hybridrl.workers.engine.optim import build_optimizer, lr_factor

__all__ = ["SFTTrainer", "sft_token_loss", "resolve_data_files"]

LOG_PREFIX = "[hybridrl sft]"


# ----------------------------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------------------------
def sft_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the loss tokens.

    Token t is predicted from position t - 1, so `logits[:, :-1]` is scored against
    `input_ids[:, 1:]` where `loss_mask[:, 1:]` is 1. Divide by the number of loss tokens of the
    whole (global) batch to get the token-mean loss.

    Args:
        logits: (B, L, V) next-token logits.
        input_ids: (B, L) token ids.
        loss_mask: (B, L) 1 on tokens the model must learn to produce.

    Returns:
        Scalar float32 tensor: sum over (b, t >= 1) of -log p(input_ids[b, t]) * loss_mask[b, t].
    """
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(torch.float32)
    nll = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view_as(mask)
    return (nll * mask).sum()


def resolve_data_files(config: SFTConfig) -> tuple[Any, Any]:
    """(train_files, val_files): the configured files, or the built-in task's SFT files.

    The built-in files are used only when `data.train_files` is null (then `data.val_files`
    null means the built-in val file as well).
    """
    d = config.data
    if d.train_files is not None:
        return d.train_files, d.val_files
    if not is_builtin_model(config.model.partial_pretrain):
        raise ConfigError("data.train_files is not set; point it at parquet/jsonl file(s)")

    paths = ensure_builtin_data(d.builtin_data_dir)
    return paths["sft_train"], (d.val_files if d.val_files is not None else paths["sft_val"])


class _IndexDataset:
    """Yields row indices, so each rank tokenises only the rows it trains on."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _stack(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the right-padding columns no row of the micro-batch uses."""
    width = max(1, int(batch["attention_mask"].sum(-1).max()))
    return {k: v[:, :width] for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------
class SFTTrainer:
    """Builds the engine, data and tracker from an `SFTConfig`; `fit()` trains.

    Call after `hybridrl.trainer.sft.launch.init_distributed` (every rank constructs one).
    """

    def __init__(self, config: SFTConfig) -> None:

        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = get_torch_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.global_step = 0
        self._seed_everything(config.trainer.seed)
        self.engine = self._build_engine()
        self.tokenizer = self.engine.tokenizer
        self.train_files, self.val_files = resolve_data_files(config)
        self.train_dataset = self._build_dataset(self.train_files, "train")
        self.val_dataset = self._build_dataset(self.val_files, "val") if self.val_files else None
        self.loader = self._build_loader()
        self.total_steps = self._total_steps()
        self._build_optimizer()
        self.tracker = self._build_tracker()
        self._gen_eval = None  # GreedyEval, False when unavailable

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _build_engine(self):

        m, d = self.config.model, self.config.data
        path = resolve_model_path(m.partial_pretrain, key="model.partial_pretrain")
        tok_path = (
            resolve_model_path(m.tokenizer_path, key="model.tokenizer_path") if m.tokenizer_path else None
        )
        model_config = ModelConfig(
            path=path,
            tokenizer_path=tok_path,
            trust_remote_code=m.trust_remote_code,
            override_config=dict(m.override_config),
            external_lib=m.external_lib,
            enable_gradient_checkpointing=m.enable_gradient_checkpointing,
            lora_rank=m.lora_rank,
            lora_alpha=m.lora_alpha,
            target_modules=m.target_modules,
            custom_chat_template=d.chat_template,
        )
        fsdp = m.fsdp_config
        if fsdp.cpu_offload or fsdp.offload_params:  # veRL's names for FSDP2's CPUOffloadPolicy
            fsdp = dataclasses.replace(fsdp, offload_policy=True)
        engine = FSDPEngine.build(model_config, fsdp, None, role="actor", key="model")
        if engine.tokenizer is None:
            engine.tokenizer = load_tokenizer(model_config, key="model")  # raises the loading error
        return engine

    def _build_dataset(self, files: Any, split: str):

        d = self.config.data
        data_config = SFTDataConfig(
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            prompt_dict_keys=tuple(d.prompt_dict_keys) if d.prompt_dict_keys else None,
            response_dict_keys=tuple(d.response_dict_keys) if d.response_dict_keys else None,
            messages_key=d.multiturn.messages_key,
            max_length=d.max_length,
            truncation=d.truncation,
            max_samples=d.train_max_samples if split == "train" else d.val_max_samples,
            use_chat_template=d.use_chat_template,
            apply_chat_template_kwargs=dict(d.apply_chat_template_kwargs),
        )
        cls = MultiTurnSFTDataset if d.multiturn.enable else SFTDataset
        dataset = cls(files, self.tokenizer, data_config, files_key=f"data.{split}_files")
        return _CachedItems(dataset, check_all=d.truncation == "error")

    def _build_loader(self):

        d = self.config.data
        if d.train_batch_size % self.world:
            raise ConfigError(
                f"data.train_batch_size={d.train_batch_size} must be divisible by the number of ranks "
                f"({self.world}); make it a multiple of {self.world}"
            )
        n = len(self.train_dataset)
        if n < d.train_batch_size:
            raise ConfigError(
                f"data.train_files has {n} rows, fewer than one batch (data.train_batch_size="
                f"{d.train_batch_size}); lower data.train_batch_size or add data"
            )
        sampler = ResumableSampler(n, shuffle=d.shuffle, seed=self.config.trainer.seed)
        return RLDataLoader(_IndexDataset(n), d.train_batch_size, sampler, collate_fn=list, drop_last=True)

    def _total_steps(self) -> int:
        t = self.config.trainer
        return int(t.total_training_steps) if t.total_training_steps else len(self.loader) * t.total_epochs

    def _build_optimizer(self) -> None:

        o = self.config.optim
        optim_config = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=list(o.betas), eps=o.eps)
        self.optimizer = build_optimizer(self.engine.module, optim_config)
        warmup = (
            o.lr_warmup_steps if o.lr_warmup_steps > 0 else int(o.lr_warmup_steps_ratio * self.total_steps)
        )
        self._lr_fn = functools.partial(
            lr_factor,
            scheduler_type=o.lr_scheduler,
            warmup_steps=warmup,
            total_steps=self.total_steps,
            min_lr_ratio=o.min_lr_ratio,
            num_cycles=o.num_cycles,
            stable_ratio=o.stable_ratio,
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_fn)
        self.engine.optimizer, self.engine.lr_scheduler = self.optimizer, self.lr_scheduler

    def _build_tracker(self):
        """The Tracking fan-out for every logger except `console` (the trainer prints its own line)."""
        logger = self.config.trainer.logger
        backends = [logger] if isinstance(logger, str) else list(logger)
        self._console = "console" in backends
        backends = [b for b in backends if b != "console"]
        if self.rank != 0 or not backends:
            return None
        from omegaconf import OmegaConf

        t = self.config.trainer
        return Tracking(
            t.project_name,
            t.experiment_name,
            backends,
            config=OmegaConf.structured(self.config),
            log_dir=t.log_dir,
        )

    # -- batches --------------------------------------------------------------------------------
    def _next_indices(self) -> list[int]:
        if not hasattr(self, "_iter"):
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.loader)
            return next(self._iter)

    def _micro_batches(self, rows: list[int | None], dataset) -> list[dict[str, torch.Tensor]]:
        """Stacked, trimmed micro-batches of `rows` (None: a padding row with an all-zero loss mask)."""
        size = self.config.data.micro_batch_size_per_gpu
        out = []
        for start in range(0, len(rows), size):
            items = []
            for i in rows[start : start + size]:
                item = dataset[0 if i is None else i]
                if i is None:
                    item = {**item, "loss_mask": torch.zeros_like(item["loss_mask"])}
                items.append(item)
            out.append({k: v.to(self.device) for k, v in _trim(_stack(items)).items()})
        return out

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().to(self.device, torch.float64)
        if self.world > 1:
            dist.all_reduce(value)
        return value

    def _forward_loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.engine.module(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            use_cache=False,
        )
        return sft_token_loss(out.logits, mb["input_ids"], mb["loss_mask"])

    # -- one step -------------------------------------------------------------------------------
    def accumulate_gradients(self, indices: list[int]) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank's rows `indices[rank::world]`.

        Leaves in `.grad` the gradient of the token-mean loss over the whole global batch.
        """
        module = self.engine.module
        module.train()
        micro = self._micro_batches(indices[self.rank :: self.world], self.train_dataset)
        local_tokens = sum(mb["loss_mask"][:, 1:].sum() for mb in micro)
        total_tokens = float(self._all_reduce(torch.as_tensor(local_tokens)))
        normalizer = max(total_tokens, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in micro:
            loss = self._forward_loss(mb) / normalizer
            # FSDP averages gradients over ranks; scale so the result is the global token mean's gradient
            (loss * self.world).backward()
            loss_sum += loss.detach()
        seen = self._all_reduce(torch.as_tensor(sum(float(mb["attention_mask"].sum()) for mb in micro)))
        return {
            "train/loss": float(self._all_reduce(loss_sum)),
            "train/loss_tokens": total_tokens,
            "train/tokens": float(seen),
        }

    def train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step on the global batch `indices`: gradients, clipping, AdamW, lr schedule."""

        start = time.perf_counter()
        metrics = self.accumulate_gradients(indices)
        grad_norm = clip_grad_norm(self.engine.module, self.config.optim.clip_grad)
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        seconds = time.perf_counter() - start
        metrics.update(
            {
                "train/lr": lr,
                "train/grad_norm": grad_norm,
                "train/epoch": self.loader.sampler.epoch,
                "train/skipped_step": float(not math.isfinite(grad_norm)),
                "perf/step_s": seconds,
                "perf/tokens_per_s": metrics["train/tokens"] / max(seconds, 1e-9),
            }
        )
        return metrics

    # -- validation -----------------------------------------------------------------------------
    @torch.no_grad()
    def validation_loss(self) -> float:
        """Token-mean NLL over every loss token of the validation set (all ranks take part)."""
        ds = self.val_dataset
        n = len(ds)
        per_rank = -(-n // self.world)
        mine: list[int | None] = list(range(self.rank, n, self.world))
        mine += [None] * (per_rank - len(mine))  # equal forward counts on every rank (FSDP collectives)
        module = self.engine.module
        module.eval()
        nll = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in self._micro_batches(mine, ds):
            nll += self._forward_loss(mb).to(torch.float64)
            tokens += mb["loss_mask"][:, 1:].sum()
        module.train()
        return float(self._all_reduce(nll) / self._all_reduce(tokens).clamp(min=1))

    def _greedy_eval(self):
        """The GreedyEval of the val prompts (built once; None when disabled or the columns are missing)."""
        if self._gen_eval is not None:
            return self._gen_eval or None

        g, d = self.config.generation_eval, self.config.data
        self._gen_eval = False
        if not (g.enable and self.val_files):
            return None
        rows, _ = read_rows(self.val_files, "data.val_files", [])
        need = [d.prompt_key, g.data_source_key, g.ground_truth_key]
        rows = [r for r in rows[: g.max_samples] if all(dig(r, k) is not None for k in need)]
        if not rows:
            self._print(
                f"generation_eval skipped: data.val_files rows lack one of the columns {need} "
                "(set generation_eval.*_key, or generation_eval.enable=false)"
            )
            return None
        prompts = [self._render(r[d.prompt_key], f"data.val_files row {i}") for i, r in enumerate(rows)]
        self._gen_eval = GreedyEval(
            rows,
            prompts,
            self.tokenizer,
            self.engine.model_config.path,
            data_source_key=g.data_source_key,
            ground_truth_key=g.ground_truth_key,
            max_new_tokens=g.max_new_tokens,
            batch_size=g.batch_size,
            device=self.device,
        )
        return self._gen_eval

    def _render(self, prompt: Any, where: str) -> str:

        d = self.config.data
        if isinstance(prompt, str) and not d.use_chat_template:
            return prompt
        if as_messages(prompt, where) is None:
            prompt = [{"role": "user", "content": prompt}]
        return render_prompt(self.tokenizer, prompt, where, d.apply_chat_template_kwargs)

    def generation_metrics(self) -> dict[str, float]:
        """Greedy accuracy on the validation prompts, scored by data source (generated on rank 0).

        The full weights are gathered from the shards on every rank (a collective) and loaded
        into rank 0's GreedyEval (an HFRollout).
        """
        evaluator = self._greedy_eval()
        if evaluator is None:
            return {}
        stream = self.engine.iter_full_params()
        if self.rank == 0:
            evaluator.update_weights(stream)
        else:
            for _ in stream:  # take part in the all-gathers
                pass
        result: list[Any] = [evaluator.score() if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(result, src=0)
        return result[0]

    def validate(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.val_dataset is not None:
            metrics["val/loss"] = self.validation_loss()
            metrics.update(self.generation_metrics())
        return metrics

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str:
        return os.path.abspath(os.path.expanduser(self.config.trainer.default_local_dir))

    def save_checkpoint(self) -> str:
        """Write `global_step_N` atomically (every rank takes part); returns its path."""
        t = self.config.trainer
        root, step = self.checkpoint_root, self.global_step
        tmp = ckpt_io.tmp_step_dir(root, step)
        self.engine.save_checkpoint(tmp, contents=list(t.checkpoint.save_contents), global_step=step)
        final = ckpt_io.step_dir(root, step)
        if self.rank == 0:
            torch.save(
                {"dataloader": self.loader.state_dict(), "global_step": step}, os.path.join(tmp, "data.pt")
            )
            peft_config = getattr(self.engine.module, "peft_config", None)
            if peft_config:
                peft_config["default"].save_pretrained(os.path.join(tmp, "lora_adapter"))
            final = ckpt_io.finalize(root, step)
            ckpt_io.prune(root, t.max_ckpt_to_keep)
        dist.barrier()
        return final

    def _resume_path(self) -> str | None:
        t = self.config.trainer
        if t.resume_mode == "disable":
            return None
        if t.resume_mode == "resume_path":
            path = os.path.abspath(os.path.expanduser(t.resume_from_path))
            if not os.path.isdir(path):
                raise FileNotFoundError(f"trainer.resume_from_path={t.resume_from_path!r} does not exist")
            return path
        return ckpt_io.find_latest(self.checkpoint_root)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, lr schedule, RNG and data position from `path`."""
        contents = list(self.config.trainer.checkpoint.load_contents)
        self.engine.load_checkpoint(path, contents=contents)
        data_file = os.path.join(path, "data.pt")
        if not os.path.exists(data_file):
            raise FileNotFoundError(f"{data_file} is missing: {path} is not an SFT checkpoint of hybridrl")
        state = load_state_file(data_file)
        self.loader.load_state_dict(state["dataloader"])
        self.global_step = int(state["global_step"])
        if "extra" not in contents:  # lr schedule not restored: move it to the step
            for _ in range(self.global_step):
                self.lr_scheduler.step()
        if hasattr(self, "_iter"):
            del self._iter

    # -- the loop -------------------------------------------------------------------------------
    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)
        if self._console and self.rank == 0:
            shown = [
                ("train/loss", "loss"),
                ("train/lr", "lr"),
                ("train/grad_norm", "grad_norm"),
                ("perf/step_s", "step_s"),
                ("val/loss", "val_loss"),
                ("val/greedy_acc", "greedy_acc"),
            ]
            parts = [f"step {step}/{self.total_steps}"]
            parts += [f"{label} {metrics[key]:.4g}" for key, label in shown if key in metrics]
            print(" | ".join(parts), flush=True)

    def fit(self, stop_at_step: int | None = None) -> dict[str, float]:
        """Train to `total_steps` (or until `stop_at_step`); returns the last validation metrics.

        Args:
            stop_at_step: end after this global step, as if interrupted (checkpoints per save_freq).
        """
        t = self.config.trainer
        started = time.perf_counter()
        path = self._resume_path()
        if path is not None:
            self.load_checkpoint(path)
            self._print(f"resumed from {path} at step {self.global_step}")
        last_val: dict[str, float] = {}
        validate_now = t.val_before_train and self.global_step == 0 or self.global_step >= self.total_steps
        if validate_now and self.val_dataset is not None:
            last_val = self.validate()
            self._log(last_val, self.global_step)
        self._print(
            f"{len(self.train_dataset)} train rows, {self.total_steps} steps of {self.config.data.train_batch_size} "
            f"on {self.world} rank(s), device {self.device.type}"
        )
        while self.global_step < self.total_steps:
            metrics = self.train_step(self._next_indices())
            self.global_step += 1
            last = self.global_step == self.total_steps
            if self.val_dataset is not None and (
                last or t.test_freq > 0 and self.global_step % t.test_freq == 0
            ):
                last_val = self.validate()
                metrics.update(last_val)
            if t.save_freq > 0 and (last or self.global_step % t.save_freq == 0):
                self.save_checkpoint()
            self._log(metrics, self.global_step)
            if stop_at_step is not None and self.global_step >= stop_at_step:
                break
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(last_val.items()) if k.startswith("val/"))
        self._print(
            f"stopped at step {self.global_step} after {time.perf_counter() - started:.1f} s; {shown}"
        )
        return last_val

    def _print(self, text: str) -> None:
        if self.rank == 0:
            print(f"{LOG_PREFIX} {text}", flush=True)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()
        if self._gen_eval:
            self._gen_eval.shutdown()


class _CachedItems:
    """A view of an SFT dataset that tokenises each row once.

    With `check_all`, every row is tokenised at construction, so an over-long sample
    (data.truncation=error) fails at start-up with the dataset's message naming file and row.
    """

    MAX_CACHED_TOKENS = 1 << 24

    def __init__(self, dataset, check_all: bool) -> None:
        self.dataset = dataset
        self.cache_enabled = len(dataset) * dataset.config.max_length <= self.MAX_CACHED_TOKENS
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        if check_all:
            for i in range(len(dataset)):
                self[i]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self._cache.get(i)
        if item is None:
            item = self.dataset[i]
            if self.cache_enabled:
                self._cache[i] = item
        return item
