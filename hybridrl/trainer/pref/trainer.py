"""The preference trainers: reward model (Bradley-Terry) and DPO-family, on the shared engine and update loop.

They are the SFT trainer (trainer/sft/trainer.py: resumable sampler, data-parallel split, the update
loop `run_update`, checkpoints, tracking) with preference pairs as rows and a pair loss:

* `RewardModelTrainer` trains the engines' critic model (a per-token head, num_labels=1) and reads
  each sequence's score at its last token (a `ScoreRequest`); the loss is
  `algos.preference.bradley_terry_loss`; `huggingface/` of every checkpoint is the exported
  sequence-classification model (trainer/pref/export.py).
* `DPOTrainer` trains the causal LM; each completion's summed log-prob comes from a `LogProbRequest`
  on the completion tokens; the loss is `algos.preference.dpo_loss`. The
  reference log-probs are computed once before training (from the model at step 0, the frozen
  base with LoRA, or `dpo.ref_model_path`) and kept in every checkpoint, or live beside each step.

One micro-batch holds b pairs as 2b rows (the b chosen, then the b rejected) in the veRL layout
(`data.preference.pair_batch`: prompt left-padded, completion right-padded); with
`model.use_prefix_grouper` (auto: on where the model can take it) a pair's two completions share one
forward of their prompt (engine/prefix_group.py). A pair's loss weighs 1 / (pairs of the global
batch), so micro-batching and the number of ranks leave the gradient unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.algos.preference import bradley_terry_loss, dpo_loss, sequence_log_probs
from hybridrl.config.roles import OptimConfig
from hybridrl.data.preference import pair_batch
from hybridrl.data.sampler import ResumableSampler, RLDataLoader
from hybridrl.engine.base import EngineBuildSpec, LogProbRequest, ScoreRequest, get_engine
from hybridrl.engine.update_loop import UpdatePerf
from hybridrl.protocol import DataProto
from hybridrl.trainer.pref.export import export_reward_model
from hybridrl.trainer.sft.config import uses_megatron
from hybridrl.trainer.sft.data import IndexDataset
from hybridrl.trainer.sft.engine import sft_lr_factor, sft_model_config, use_lr_schedule
from hybridrl.trainer.sft.preemption import SFTStepGuard
from hybridrl.trainer.sft.trainer import SFTTrainer
from hybridrl.utils.config_loader import ConfigError
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.safe_io import load_state_file
from hybridrl.workers.parallel_dims import ParallelDims

__all__ = ["DPOTrainer", "RewardModelTrainer", "build_pref_engine"]


def build_pref_engine(config: Any, role: str, *, path: str | None = None, trained: bool = True):
    """(engine, parallel dims) of the `model` section as `role` ("critic": the reward model with its
    per-token head; "actor": the policy; "ref": a frozen copy), on every rank (a collective)."""
    o = config.optim
    section = config.model
    if section.fsdp_config.cpu_offload or section.fsdp_config.offload_params:  # veRL SFT's names
        section = dataclasses.replace(
            section, fsdp_config=dataclasses.replace(section.fsdp_config, offload_policy=True)
        )
    entry = get_engine(section.strategy, "model.strategy")
    dims = ParallelDims.for_role(dist.get_world_size(), section, "model")
    model_config = sft_model_config(config)
    if path is not None:
        model_config = dataclasses.replace(model_config, path=path, lora_rank=0)
    optim = (
        OptimConfig(lr=o.lr, weight_decay=o.weight_decay, betas=list(o.betas), eps=o.eps) if trained else None
    )
    spec = EngineBuildSpec(
        role=role, model_config=model_config, role_config=section, optim_config=optim, key="model",
        model_key="model", mesh=dims.train_mesh(), rank=dist.get_rank(),
    )  # fmt: skip
    return entry.engine_cls.build_role(spec), dims


class _PairTrainer(SFTTrainer):
    """The SFT trainer's loop over preference pairs; subclasses give the role, the loss and validation."""

    ROLE = "actor"
    LOG_NAME = "pref"
    SHOWN: tuple[tuple[str, str], ...] = ()

    def __init__(
        self, config: Any, train_dataset: Any, val_dataset: Any, tokenizer: Any, val_files: Any = None
    ) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = get_torch_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.global_step = 0
        self._seed_everything(config.trainer.seed)
        self.engine, self.dims = build_pref_engine(config, self.ROLE)
        if self.engine.tokenizer is None:
            self.engine.tokenizer = tokenizer
        self.tokenizer = self.engine.tokenizer
        self.dp_rank, self.dp_size = self.engine.dp_rank, self.engine.dp_size
        self.request = self._request(shared_prompt_forward(config, getattr(self.engine, "module", None)))
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.val_files = val_files
        self.loader = self._build_loader()
        self.total_steps = self._total_steps()
        use_lr_schedule(self.engine, sft_lr_factor(config, self.total_steps))
        self._perf = UpdatePerf("train", self.engine, None)
        self.tracker = self._build_tracker()
        self._gen_eval = None
        self.step_guard = SFTStepGuard(self)  # SIGTERM / SIGUSR1: finish the step, save it, exit

    # -- rows and micro-batches -----------------------------------------------------------------
    @property
    def _same_width(self) -> bool:
        return False

    def _build_loader(self):
        d = self.config.data
        if d.train_batch_size % self.dp_size:
            raise ConfigError(
                f"data.train_batch_size={d.train_batch_size} must be divisible by the {self.dp_size} data-parallel ranks"
            )
        n = len(self.train_dataset)
        if n < d.train_batch_size:
            raise ConfigError(
                f"data.train_files has {n} pairs, fewer than one batch (data.train_batch_size={d.train_batch_size}); "
                "lower data.train_batch_size or add data"
            )
        sampler = ResumableSampler(n, shuffle=d.shuffle, seed=self.config.trainer.seed)
        return RLDataLoader(IndexDataset(n), d.train_batch_size, sampler, collate_fn=list, drop_last=True)

    def _rank_rows(self, indices: list[int]) -> DataProto:
        """This rank's pairs `indices[dp_rank::dp_size]` as 2B rows (the chosen sequences, then the
        rejected): `row` (2B,) the pair, `attention_mask` (2B, W) each sequence's tokens (the
        update loop's FLOP count)."""
        mine = indices[self.dp_rank :: self.dp_size]
        lengths = [len(self.train_dataset[i][f"{name}_ids"]) for name in ("chosen", "rejected") for i in mine]
        mask = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
        for j, n in enumerate(lengths):
            mask[j, :n] = 1
        return DataProto.from_dict({"row": torch.tensor(mine + mine), "attention_mask": mask})

    def _micros(self, dataset: Any, rows: list[int | None]) -> list[dict[str, torch.Tensor]]:
        """b pairs per micro-batch as (2b, P + T) tensors on the device (`pair_batch`)."""
        micro = self.config.data.micro_batch_size_per_gpu
        out = []
        for lo in range(0, len(rows), micro):
            items = [None if r is None else dataset[r] for r in rows[lo : lo + micro]]
            mb = pair_batch(items, self.tokenizer.pad_token_id)
            mb["margin"] = mb["margin"].repeat(2)
            out.append({k: v.to(self.device) for k, v in mb.items()})
        return out

    def _request(self, shared_prompt: bool) -> Any:
        raise NotImplementedError

    def _pair_loss(
        self, mb: dict[str, torch.Tensor], out: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    # -- one step -------------------------------------------------------------------------------
    def _forward_backward(self, mini: DataProto) -> dict[str, float]:
        rows = mini.batch["row"].tolist()
        rows = rows[: len(rows) // 2]
        micros = self._micros(self.train_dataset, rows)
        total = float(self._all_reduce(torch.as_tensor(float(len(rows)))))

        def loss_fn(mb, out):
            b = mb["input_ids"].shape[0] // 2
            loss, metrics = self._pair_loss(mb, out)
            weight = b / total
            return loss * weight * self.dp_size, {
                k: float(v.detach()) * weight for k, v in {"loss": loss, **metrics}.items()
            }

        self._before_micros(micros)
        auxes = self.engine.forward_backward(micros, self.request, loss_fn)
        sums: dict[str, float] = {}
        for aux in auxes:
            for k, v in aux.items():
                sums[k] = sums.get(k, 0.0) + v
        names = sorted(sums)
        reduced = self._all_reduce(torch.tensor([sums[k] for k in names]))
        tokens = self._all_reduce(torch.as_tensor(sum(float(mb["attention_mask"].sum()) for mb in micros)))
        metrics = {f"train/{k}": float(v) for k, v in zip(names, reduced)}
        metrics["train/tokens"] = float(tokens)
        return metrics

    def _before_micros(self, micros: list[dict[str, torch.Tensor]], dataset: Any = None) -> None:
        """Hook: add what the loss needs beside the engine's output (the DPO reference log-probs)."""

    # -- validation -----------------------------------------------------------------------------
    def _padded_rows(self, n: int) -> list[int | None]:
        """This rank's rows of n (`dp_rank::dp_size`), padded with None to the same whole number of
        micro-batches on every rank (each forward is a collective)."""
        micro = self.config.data.micro_batch_size_per_gpu
        per_rank = -(-n // self.dp_size)
        per_rank = -(-per_rank // micro) * micro
        rows: list[int | None] = list(range(self.dp_rank, n, self.dp_size))
        return rows + [None] * (per_rank - len(rows))

    @torch.no_grad()
    def pair_metrics(self, dataset: Any) -> dict[str, float]:
        """Pair-mean loss and metrics over every pair of `dataset` (all ranks take part)."""
        n = len(dataset)
        rows = self._padded_rows(n)
        sums: dict[str, float] = {}
        micros = self._micros(dataset, rows)
        self._before_micros(micros, dataset)
        for mb, out in zip(micros, self.engine.forward(micros, self.request)):
            b = mb["input_ids"].shape[0] // 2
            valid = mb["valid"][:b].bool()
            if not valid.any():
                continue
            keep = torch.cat([valid, valid])
            part = {k: v[keep] for k, v in mb.items()}
            out = (
                out[keep]
                if isinstance(out, torch.Tensor)
                else dataclasses.replace(out, log_probs=out.log_probs[keep])
            )
            loss, metrics = self._pair_loss(part, out)
            count = float(valid.sum())
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * count
        names = sorted(self._metric_names())
        reduced = self._all_reduce(torch.tensor([sums.get(k, 0.0) for k in names]))
        return {f"val/{k}": float(v) / n for k, v in zip(names, reduced)}

    def _metric_names(self) -> list[str]:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.val_dataset is not None:
            metrics.update(self.pair_metrics(self.val_dataset))
        return metrics

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)
        if self._console and self.rank == 0:
            parts = [f"step {step}/{self.total_steps}"]
            parts += [f"{label} {metrics[key]:.4g}" for key, label in self.SHOWN if key in metrics]
            print(" | ".join(parts), flush=True)

    def _print(self, text: str) -> None:
        if self.rank == 0:
            print(f"[hybridrl {self.LOG_NAME}] {text}", flush=True)


class RewardModelTrainer(_PairTrainer):
    """Bradley-Terry reward model; see the module docstring. `fit()` returns the last val metrics."""

    ROLE = "critic"
    LOG_NAME = "rm"
    SHOWN = (
        ("train/loss", "loss"),
        ("train/accuracy", "acc"),
        ("train/margin", "margin"),
        ("train/lr", "lr"),
        ("perf/step_s", "step_s"),
        ("val/loss", "val_loss"),
        ("val/accuracy", "val_acc"),
        ("val/margin", "val_margin"),
    )

    def __init__(
        self, config: Any, train_dataset: Any, val_dataset: Any, tokenizer: Any, val_files: Any = None
    ) -> None:
        super().__init__(config, train_dataset, val_dataset, tokenizer, val_files)
        head = _reward_head(self.engine)
        if head is None:  # a Megatron pipeline stage without the head
            return
        if getattr(head, "out_features", head.weight.shape[0]) != 1:
            raise ConfigError(
                f"the reward head must output one score (num_labels=1), got {head.weight.shape[0]}"
            )
        if head.bias is not None:  # the pairwise loss does not depend on it; the export has none
            with torch.no_grad():
                head.bias.zero_()
            head.bias.requires_grad_(False)  # frozen: AdamW would turn rounding noise into steps

    def _metric_names(self) -> list[str]:
        return ["loss", "accuracy", "margin", "chosen_reward", "rejected_reward"]

    def _request(self, shared_prompt: bool) -> ScoreRequest:
        return ScoreRequest(prefix_group=shared_prompt)

    def _pair_loss(self, mb, scores):
        """scores (2b,): each sequence's reward, the head at its last token."""
        b = scores.shape[0] // 2
        margin = mb["margin"][:b]
        return bradley_terry_loss(
            scores[:b],
            scores[b:],
            margin=margin if bool(margin.any()) else None,
            center_rewards_coefficient=self.config.rm.center_rewards_coefficient,
        )

    def save_checkpoint(self) -> str:
        """The SFT checkpoint (engine state, data position), its `huggingface/` folder the
        sequence-classification export."""
        t = self.config.trainer
        contents = list(t.checkpoint.save_contents)
        export = "hf_model" in contents
        t.checkpoint.save_contents = [c for c in contents if c != "hf_model"]
        try:
            final = super().save_checkpoint()
        finally:
            t.checkpoint.save_contents = contents
        if export:
            export_reward_model(self.engine, os.path.join(final, "huggingface"), self.tokenizer)
        return final

    def export(self, out_dir: str) -> None:
        """Write the reward model as a Hugging Face sequence-classification folder (a collective)."""
        export_reward_model(self.engine, out_dir, self.tokenizer)


def shared_prompt_forward(config: Any, module: torch.nn.Module) -> bool:
    """`model.use_prefix_grouper` resolved for `module`: auto is on when the model can take the
    shared-prompt forward (`prefix_group.model_refusal`); true where it cannot is an error."""
    value = config.model.use_prefix_grouper
    if value is False:
        return False
    if uses_megatron(config):
        if value is True:
            raise ConfigError(
                "model.use_prefix_grouper=true: the shared-prompt forward is built for the FSDP engine; "
                "set it to false (or auto) with model.strategy=megatron"
            )
        return False
    from hybridrl.engine.prefix_group import model_refusal

    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    refusal = model_refusal(base.config)
    if refusal is not None and value is True:
        raise ConfigError(f"model.use_prefix_grouper=true: {refusal}; set it to false (or auto)")
    return refusal is None


def _reward_head(engine: Any) -> torch.nn.Module | None:
    """The reward model's score head: the HF model's `score` (FSDP2), or the Megatron critic's value
    head on the last pipeline stage (None on the other stages)."""
    module = getattr(engine, "module", None)
    if module is not None:
        return _score_layer(module)
    last = getattr(engine.chunks[-1], "module", engine.chunks[-1])  # inside megatron-core's DDP
    return getattr(last, "output_layer", None)


def _score_layer(module: torch.nn.Module) -> torch.nn.Module:
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    head = getattr(base, "score", None) or getattr(base, "classifier", None)
    if head is None:
        raise ConfigError(
            f"{type(base).__name__} has no 'score' / 'classifier' head to train as a reward head"
        )
    if hasattr(head, "modules_to_save"):  # LoRA: PEFT trains a copy of the head beside the adapter
        name = head.active_adapter
        head = head.modules_to_save[name if isinstance(name, str) else name[0]]
    return head


class DPOTrainer(_PairTrainer):
    """DPO / IPO / SimPO on the policy; see the module docstring. `fit()` returns the last val metrics."""

    ROLE = "actor"
    LOG_NAME = "dpo"
    SHOWN = (
        ("train/loss", "loss"),
        ("train/rewards/accuracies", "acc"),
        ("train/rewards/margins", "margin"),
        ("train/lr", "lr"),
        ("perf/step_s", "step_s"),
        ("val/loss", "val_loss"),
        ("val/rewards/accuracies", "val_acc"),
        ("val/greedy_acc", "greedy_acc"),
    )

    def __init__(
        self, config: Any, train_dataset: Any, val_dataset: Any, tokenizer: Any, val_files: Any = None
    ) -> None:
        super().__init__(config, train_dataset, val_dataset, tokenizer, val_files)
        p = config.dpo
        self.ref_engine = None
        self.uses_ref = p.loss_type != "simpo"
        self._ref_cache: dict[int, torch.Tensor] = {}  # id(dataset) -> (N, 2) reference log-probs
        if (
            self.uses_ref
            and config.model.lora_rank == 0
            and (p.ref_model_path or not p.precompute_ref_log_probs)
        ):
            self.ref_engine, _ = build_pref_engine(
                config, "ref", path=p.ref_model_path or self.engine.model_config.path, trained=False
            )

    def _request(self, shared_prompt: bool) -> LogProbRequest:
        return LogProbRequest(temperature=1.0, prefix_group=shared_prompt)

    def _metric_names(self) -> list[str]:
        return [
            "loss",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
        ]

    # -- reference log-probs --------------------------------------------------------------------
    def _reference_forward(self, micros: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """(2b,) summed reference log-probs of each micro-batch's completions."""
        if self.ref_engine is not None:
            outs = self.ref_engine.forward(micros, self.request)
        else:
            lora = self.config.model.lora_rank > 0
            with self.engine.disable_adapter() if lora else contextlib.nullcontext():
                outs = self.engine.forward(micros, self.request)
        return [sequence_log_probs(o.log_probs, mb["response_mask"])[0] for mb, o in zip(micros, outs)]

    def precompute_reference(self, dataset: Any) -> torch.Tensor:
        """(N, 2) reference log-probs (chosen, rejected) of every pair of `dataset` (all ranks take part)."""
        n, micro = len(dataset), self.config.data.micro_batch_size_per_gpu
        rows = self._padded_rows(n)
        table = torch.zeros((n, 2), dtype=torch.float64, device=self.device)
        micros = self._micros(dataset, rows)
        for lo, logps in zip(range(0, len(rows), micro), self._reference_forward(micros)):
            chunk = rows[lo : lo + micro]
            b = len(chunk)
            for j, r in enumerate(chunk):
                if r is not None:
                    table[r, 0], table[r, 1] = logps[j], logps[b + j]
        return self._all_reduce(table).float().cpu()

    def _reference_table(self, dataset: Any) -> torch.Tensor:
        key = id(dataset)
        if key not in self._ref_cache:
            self._ref_cache[key] = self.precompute_reference(dataset)
        return self._ref_cache[key]

    def _before_micros(self, micros, dataset=None) -> None:
        if not self.uses_ref:
            return
        dataset = dataset if dataset is not None else self.train_dataset
        if self.config.dpo.precompute_ref_log_probs:
            table = self._reference_table(dataset)
            for mb in micros:
                rows = mb["row"].tolist()
                b = len(rows) // 2
                ref = table[rows[:b]].to(self.device)
                mb["ref_logps"] = torch.cat([ref[:, 0], ref[:, 1]])
            return
        for mb, ref in zip(micros, self._reference_forward(micros)):
            mb["ref_logps"] = ref

    def _micros(self, dataset, rows):
        micros = super()._micros(dataset, rows)
        micro = self.config.data.micro_batch_size_per_gpu
        for lo, mb in zip(range(0, len(rows), micro), micros):
            chunk = [0 if r is None else r for r in rows[lo : lo + micro]]
            mb["row"] = torch.tensor(chunk + chunk, device=self.device)
        return micros

    def _pair_loss(self, mb, out):
        p = self.config.dpo
        logps, lengths = sequence_log_probs(out.log_probs, mb["response_mask"])
        b = logps.shape[0] // 2
        ref = mb.get("ref_logps")
        return dpo_loss(
            logps[:b], logps[b:],
            None if ref is None else ref[:b], None if ref is None else ref[b:],
            chosen_lengths=lengths[:b], rejected_lengths=lengths[b:],
            loss_type=p.loss_type, beta=p.beta, label_smoothing=p.label_smoothing, simpo_gamma=p.simpo_gamma,
        )  # fmt: skip

    def validate(self) -> dict[str, float]:
        metrics = super().validate()
        if self.val_dataset is not None:
            metrics.update(self.generation_metrics())
        return metrics

    # -- checkpoints: the reference table travels with them --------------------------------------
    def save_checkpoint(self) -> str:
        if self.uses_ref and self.config.dpo.precompute_ref_log_probs:
            self._reference_table(self.train_dataset)
        final = super().save_checkpoint()
        if self.rank == 0 and self._ref_cache:
            tables = {"train": self._ref_cache.get(id(self.train_dataset))}
            if self.val_dataset is not None:
                tables["val"] = self._ref_cache.get(id(self.val_dataset))
            torch.save(tables, os.path.join(final, "ref_logps.pt"))
        if dist.is_initialized():
            dist.barrier()
        return final

    def load_checkpoint(self, path: str) -> None:
        super().load_checkpoint(path)
        ref_file = os.path.join(path, "ref_logps.pt")
        if self.uses_ref and self.config.dpo.precompute_ref_log_probs:
            if not os.path.exists(ref_file):
                raise FileNotFoundError(
                    f"{ref_file} is missing: the reference log-probs of this run cannot be recomputed from a "
                    "trained model; resume with the checkpoint written by main_dpo"
                )
            tables = load_state_file(ref_file)
            for name, dataset in (("train", self.train_dataset), ("val", self.val_dataset)):
                table = tables.get(name)
                if dataset is None or table is None:
                    continue
                if table.shape[0] != len(dataset):
                    raise ValueError(f"{ref_file} holds reference log-probs of another {name} data set")
                self._ref_cache[id(dataset)] = table

    def fit(self, stop_at_step: int | None = None) -> dict[str, float]:
        if self.uses_ref and self.config.dpo.precompute_ref_log_probs and self._resume_path() is None:
            start = time.perf_counter()
            self._reference_table(self.train_dataset)
            if self.val_dataset is not None:
                self._reference_table(self.val_dataset)
            self._print(
                f"reference log-probs of {len(self.train_dataset)} pairs in {time.perf_counter() - start:.1f} s"
            )
        return super().fit(stop_at_step)
