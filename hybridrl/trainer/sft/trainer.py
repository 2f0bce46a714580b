"""The SFT trainer: one model behind any training engine (FSDP2, Megatron), token-mean loss over the global batch, exact resume.

Every rank runs the same loop (no Ray, no driver). Each optimizer step draws one global batch
of `data.train_batch_size` rows from a resumable sampler (same indices on every rank); data-parallel
rank r of D keeps rows `r::D` (with Megatron, the tp x pp ranks of one model replica share theirs)
and runs them in micro-batches of `data.micro_batch_size_per_gpu`. The step is the RL roles'
update loop (engine/update_loop.run_update: the engine's forward_backward, optimizer_step
and lr schedule) with the SFT loss of algos/sft.py: the mean negative log-likelihood over all loss
tokens of the global batch, so gradient accumulation and the number of ranks do not change the
gradient. The engine computes the next-token log-probs as a log-prob request on
`responses = input_ids[:, 1:]`.

Checkpoint layout (`trainer.default_local_dir/global_step_N/`, written to `.tmp` and renamed):
    the engine's checkpoint     FSDP2: model/ optimizer/ extra_state_rank*.pt meta.json (DCP shards,
                                RNG, lr); Megatron: dist/ extra_state_rank*.pt meta.json
    huggingface/                full HF model + tokenizer ('hf_model')
    data.pt                     data loader state and global step
    lora_adapter/adapter_config.json   LoRA settings (LoRA runs only, FSDP2)
and `latest_checkpointed_iteration.txt` names the newest step.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.algos.agg import LossScale
from hybridrl.algos.sft import sft_loss, sft_nll_sum, sft_token_loss
from hybridrl.config.batch import PerRankBatchSizes
from hybridrl.data.rl_dataset import as_messages, read_rows, render_prompt
from hybridrl.data.sampler import ResumableSampler, RLDataLoader
from hybridrl.engine.base import LogProbRequest, LogProbs
from hybridrl.engine.update_loop import UpdatePerf, combine_micro_metrics, micro_loss_aux, run_update
from hybridrl.protocol import DataProto
from hybridrl.trainer.offline.evaluation import GreedyEval, dig
from hybridrl.trainer.sft.config import SFTConfig
from hybridrl.trainer.sft.data import (
    IndexDataset,
    build_dataset,
    micro_batches,
    resolve_data_files,
    stack_rows,
)
from hybridrl.trainer.sft.engine import build_sft_engine, sft_lr_factor, use_lr_schedule
from hybridrl.trainer.sft.preemption import SFTStepGuard
from hybridrl.utils import checkpointing as ckpt_io
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.safe_io import load_state_file
from hybridrl.utils.tracking import Tracking

__all__ = ["SFTTrainer", "sft_token_loss", "resolve_data_files"]

LOG_PREFIX = "[hybridrl sft]"
NEXT_TOKEN = LogProbRequest(temperature=1.0)  # log p of `responses` = input_ids[:, 1:]
VAL_CHUNK_MICROS = 16  # validation stacks this many micro-batches of rows at a time


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
        self.engine, self.dims = build_sft_engine(config)
        self.dp_rank, self.dp_size = self.engine.dp_rank, self.engine.dp_size
        self.tokenizer = self.engine.tokenizer
        self.train_files, self.val_files = resolve_data_files(config)
        self.train_dataset = build_dataset(config, self.train_files, "train", self.tokenizer)
        self.val_dataset = (
            build_dataset(config, self.val_files, "val", self.tokenizer) if self.val_files else None
        )
        self.loader = self._build_loader()
        self.total_steps = self._total_steps()
        use_lr_schedule(self.engine, sft_lr_factor(config, self.total_steps))
        self._perf = UpdatePerf("train", self.engine, None)
        self.tracker = self._build_tracker()
        self._gen_eval = None  # GreedyEval, False when unavailable
        self.step_guard = SFTStepGuard(self)  # SIGTERM / SIGUSR1: finish the step, save it, exit

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    @property
    def _same_width(self) -> bool:
        """Pipelined models pass activations of one shape: one width for all micro-batches of a call."""
        return self.dims.pp > 1

    def _build_loader(self):

        d = self.config.data
        if d.train_batch_size % self.dp_size:
            raise ConfigError(
                f"data.train_batch_size={d.train_batch_size} must be divisible by the number of data-parallel "
                f"ranks ({self.dp_size}: the ranks / (tensor * pipeline parallel size)); make it a multiple of "
                f"{self.dp_size}"
            )
        micros = -(-d.train_batch_size // self.dp_size // d.micro_batch_size_per_gpu)
        if (self.dims.vpp or 1) > 1 and micros % self.dims.pp:
            raise ConfigError(
                f"model.megatron.virtual_pipeline_model_parallel_size needs a number of micro-batches per step "
                f"divisible by pipeline_model_parallel_size={self.dims.pp}, got {micros}; change "
                "data.micro_batch_size_per_gpu or data.train_batch_size"
            )
        n = len(self.train_dataset)
        if n < d.train_batch_size:
            raise ConfigError(
                f"data.train_files has {n} rows, fewer than one batch (data.train_batch_size="
                f"{d.train_batch_size}); lower data.train_batch_size or add data"
            )
        sampler = ResumableSampler(n, shuffle=d.shuffle, seed=self.config.trainer.seed)
        return RLDataLoader(IndexDataset(n), d.train_batch_size, sampler, collate_fn=list, drop_last=True)

    def _total_steps(self) -> int:
        t = self.config.trainer
        return int(t.total_training_steps) if t.total_training_steps else len(self.loader) * t.total_epochs

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

    def _rank_rows(self, indices: list[int]) -> DataProto:
        """This data-parallel rank's rows `indices[dp_rank::dp_size]`, stacked (B, L)."""
        return DataProto.from_dict(stack_rows(indices[self.dp_rank :: self.dp_size], self.train_dataset))

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().to(self.device, torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(value, group=self.engine.dp_group)
        return value

    # -- one step -------------------------------------------------------------------------------
    def _forward_backward(self, mini: DataProto) -> dict[str, float]:
        """Forward/backward every micro-batch of this rank's rows `mini` (no optimizer step).

        Leaves in the gradients that of the token-mean loss over the whole global batch.
        """
        micros = micro_batches(
            mini.batch, self.config.data.micro_batch_size_per_gpu, self.device, self._same_width
        )
        local_tokens = sum(mb["loss_mask"][:, 1:].sum() for mb in micros)
        total_tokens = float(self._all_reduce(torch.as_tensor(local_tokens)))
        scale = LossScale(num_tokens=max(total_tokens, 1.0), dp_size=self.dp_size)

        def loss_fn(mb: dict[str, torch.Tensor], out: LogProbs):
            loss, nll = sft_loss(out.log_probs, mb["loss_mask"], scale)
            return loss, micro_loss_aux({"train/loss": float(nll.detach())}, {}, mb["loss_mask"][:, 1:])

        sums, _ = combine_micro_metrics(self.engine.forward_backward(micros, NEXT_TOKEN, loss_fn), scale)
        seen = self._all_reduce(torch.as_tensor(sum(float(mb["attention_mask"].sum()) for mb in micros)))
        return {
            "train/loss": float(self._all_reduce(torch.as_tensor(sums.get("train/loss", 0.0)))),
            "train/loss_tokens": total_tokens,
            "train/tokens": float(seen),
        }

    def accumulate_gradients(self, indices: list[int]) -> dict[str, float]:
        """Forward/backward this rank's rows of the global batch `indices` (see `_forward_backward`)."""
        return self._forward_backward(self._rank_rows(indices))

    def train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step on the global batch `indices`: gradients, clipping, AdamW, lr schedule."""

        start = time.perf_counter()
        data = self._rank_rows(indices)
        micro = self.config.data.micro_batch_size_per_gpu
        sizes = PerRankBatchSizes(
            mini_batch_size=len(data), micro_batch_size=micro, use_dynamic_bsz=False, max_token_len=0,
            forward_micro_batch_size=micro, forward_max_token_len=0, epochs=1, shuffle=False, seed=None,
            dp_size=self.dp_size, rollout_n=1,
        )  # fmt: skip
        out = run_update(
            data,
            role="train",
            engine=self.engine,
            batch_sizes=sizes,
            forward_backward=self._forward_backward,
            max_grad_norm=self.config.optim.clip_grad,
            perf=self._perf,
        )
        metrics = {k: v[0] for k, v in out.items()}
        metrics["train/skipped_step"] = metrics.pop("train/step_skipped")
        seconds = time.perf_counter() - start
        metrics.update(
            {
                "train/epoch": self.loader.sampler.epoch,
                "perf/step_s": seconds,
                "perf/tokens_per_s": metrics["train/tokens"] / max(seconds, 1e-9),
            }
        )
        return metrics

    # -- validation -----------------------------------------------------------------------------
    def _val_rows(self) -> list[int | None]:
        """This rank's validation rows, padded (None) to the same count on every rank (collectives)."""
        n, micro = len(self.val_dataset), self.config.data.micro_batch_size_per_gpu
        per_rank = -(-n // self.dp_size)
        if (self.dims.vpp or 1) > 1:  # virtual stages: a multiple of pp micro-batches per call
            per_rank = -(-per_rank // (micro * self.dims.pp)) * micro * self.dims.pp
        rows: list[int | None] = list(range(self.dp_rank, n, self.dp_size))
        return rows + [None] * (per_rank - len(rows))

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Token-mean NLL over every loss token of the validation set (all ranks take part)."""
        rows, micro = self._val_rows(), self.config.data.micro_batch_size_per_gpu
        chunk = micro * VAL_CHUNK_MICROS * self.dims.pp
        nll = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for lo in range(0, len(rows), chunk):
            batch = stack_rows(rows[lo : lo + chunk], self.val_dataset)
            micros = micro_batches(batch, micro, self.device, self._same_width)
            for mb, out in zip(micros, self.engine.forward(micros, NEXT_TOKEN)):
                nll += sft_nll_sum(out.log_probs, mb["loss_mask"]).to(torch.float64)
                tokens += mb["loss_mask"][:, 1:].sum()
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
            peft_config = getattr(getattr(self.engine, "module", None), "peft_config", None)
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
                self.engine.lr_scheduler_step()
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
        self.step_guard.arm()
        try:
            last_val = self._fit_steps(last_val, stop_at_step)
        finally:
            self.step_guard.disarm()
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(last_val.items()) if k.startswith("val/"))
        self._print(
            f"stopped at step {self.global_step} after {time.perf_counter() - started:.1f} s; {shown}"
        )
        return last_val

    def _fit_steps(self, last_val: dict[str, float], stop_at_step: int | None) -> dict[str, float]:
        t = self.config.trainer
        while self.global_step < self.total_steps:
            metrics = self.train_step(self._next_indices())
            self.global_step += 1
            last = self.global_step == self.total_steps
            if self.val_dataset is not None and (
                last or t.test_freq > 0 and self.global_step % t.test_freq == 0
            ):
                last_val = self.validate()
                metrics.update(last_val)
            saved = None
            if t.save_freq > 0 and (last or self.global_step % t.save_freq == 0):
                saved = self.save_checkpoint()
            self._log(metrics, self.global_step)
            self.step_guard.after_step(saved)  # a preemption signal: the step is saved, the run exits
            if stop_at_step is not None and self.global_step >= stop_at_step:
                break
        return last_val

    def _print(self, text: str) -> None:
        if self.rank == 0:
            print(f"{LOG_PREFIX} {text}", flush=True)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()
        if self._gen_eval:
            self._gen_eval.shutdown()
