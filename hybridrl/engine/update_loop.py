"""The micro-batched update loop shared by the actor, the critic and SFT, over any TrainEngine.

A role (actor, critic, SFT) supplies only its per-micro-batch loss; the engine runs the forward
and backward (engine/base.py); this module does the rest, the same way for every role and engine:

* `prepare_mini_batch`: move a mini-batch to the device, count its loss tokens over all ranks
  (`global_loss_scale`) and split it into micro-batches (fixed size or token budget);
* `micro_loss_aux` / `combine_micro_metrics`: what each micro-batch's loss function returns
  beside its loss, and the mini-batch's summed losses and token-weighted metric means from them;
* `run_update`: epochs over shuffled mini-batches, one optimizer step each, then the lr
  scheduler once per call (one trainer step, as in veRL) and the throughput / MFU metrics;
* `MicroBatchedRole`: the state both RL roles hold (config, engine, per-rank batch sizes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hybridrl.algos.agg import LossScale
from hybridrl.config.batch import PerRankBatchSizes
from hybridrl.engine.base import TrainEngine
from hybridrl.engine.batching import (
    TokenWeightedMeans,
    append_metrics,
    global_loss_scale,
    response_mask_of,
    shuffle_seed,
    split_micro_batches,
)
from hybridrl.engine.ulysses import SPGroup
from hybridrl.protocol import DataProto
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.flops import compute_mfu, estimate_flops, work_flops


def prepare_mini_batch(
    mini_batch: DataProto,
    *,
    device: Any,
    batch_sizes: PerRankBatchSizes | None,
    dp_size: int,
    dp_group: Any,
    token_budget_key: str,
) -> tuple[Any, LossScale, list]:
    """(batch on `device`, the mini-batch's global LossScale, its micro-batches).

    Args:
        token_budget_key: the config key named when a row exceeds the dynamic token budget.
    """
    bs = batch_sizes
    batch = mini_batch.batch.to(device)
    mask = response_mask_of(batch)
    loss_scale = global_loss_scale(
        mask,
        dp_size=dp_size,
        dp_group=dp_group,
        max_response_length=mini_batch.meta_info.get("max_response_length", mask.shape[-1]),
    )
    micros, _ = split_micro_batches(
        batch,
        micro_batch_size=bs.micro_batch_size if bs else len(mini_batch),
        use_dynamic_bsz=bs.use_dynamic_bsz if bs else False,
        max_token_len=bs.max_token_len if bs else None,
        dp_group=dp_group,
        key=token_budget_key,
    )
    return batch, loss_scale, micros


def micro_loss_aux(
    sums: dict[str, float], means: dict[str, Any], mask: torch.Tensor
) -> tuple[dict[str, float], dict[str, float], float]:
    """The aux a micro-batch's loss function returns beside its loss (plain floats, so that an
    engine can hand it between pipeline stages): summed losses, token-mean metrics, loss tokens."""
    return dict(sums), {k: float(v) for k, v in means.items()}, float(mask.sum())


def combine_micro_metrics(
    auxes: Iterable, loss_scale: LossScale
) -> tuple[dict[str, float], dict[str, float]]:
    """(summed, token-mean) metrics of a mini-batch from its micro-batches' `micro_loss_aux`.

    Each micro-batch's means weigh by its loss tokens over the whole mini-batch's (`loss_scale`),
    so that after `mean_over_ranks` every rank reports the exact token mean of the mini-batch.
    """
    means = TokenWeightedMeans(loss_scale)
    sums: dict[str, float] = {}
    for micro_sums, micro_means, num_tokens in auxes:
        for k, v in micro_sums.items():
            sums[k] = sums.get(k, 0.0) + v
        means.add(micro_means, num_tokens)
    return sums, means.result()


class UpdatePerf:
    """`perf/{role}/tokens`, `perf/{role}/update_s` and `perf/mfu/{role}` of one update call.

    The FLOPs are those of one sequence per row (the rows' lengths, every epoch), unless the
    micro-batch forwards reported what they computed instead (`record`: the shared-prompt forward
    computes each prompt once per group, so counting every row's prompt overstated its MFU, by
    ~1.1x at 256 new tokens and ~1.5x at 48 on the 4 x 4 bench workload). `perf/{role}/tokens`
    stays the rows' tokens. The engine's FLOP model (`TrainEngine.perf_model`) is read once, at
    the first call.
    """

    def __init__(self, role: str, engine: TrainEngine, peak_flops: float | None) -> None:
        self.role, self.engine, self.peak_flops = role, engine, peak_flops
        self._model = None
        self._work: list[int] | None = None  # recorded (tokens, squares) of this update call

    def record(self, out: Any) -> None:
        """Add a micro-batch forward's own count (`LogProbs.work`) when it reported one."""
        work = getattr(out, "work", None)
        if work is not None:
            self._work = [a + b for a, b in zip(self._work or [0, 0], work)]

    def metrics(self, seqlens: list[int], seconds: float) -> dict[str, float]:
        if self._model is None:
            self._model = self.engine.perf_model()
        pm = self._model
        out = {f"perf/{self.role}/tokens": float(sum(seqlens)), f"perf/{self.role}/update_s": seconds}
        if self._work is not None:
            flops = work_flops(pm.num_params, *self._work, pm.num_layers, pm.attn_dim)
            self._work = None
        else:
            flops = estimate_flops(pm.num_params, seqlens, pm.num_layers, pm.attn_dim)
        flops /= pm.ranks_per_sample
        mfu = compute_mfu(flops, seconds, self.peak_flops)
        if mfu is not None:
            out[f"perf/mfu/{self.role}"] = mfu
        return out


def run_update(
    data: DataProto,
    *,
    role: str,
    engine: TrainEngine,
    batch_sizes: PerRankBatchSizes,
    forward_backward: Callable[[DataProto], dict[str, float]],
    max_grad_norm: float,
    perf: UpdatePerf,
) -> dict[str, list[float]]:
    """Epochs over shuffled mini-batches of `data`: `forward_backward(mini)` then one optimizer step.

    Args:
        role: metric prefix ("actor", "critic").
        max_grad_norm: the step's gradient clip (<= 0: measure only).

    Returns:
        metric name -> list (one entry per mini-batch, or one per call for lr / perf).
    """
    bs = batch_sizes
    iterator = data.make_iterator(
        mini_batch_size=bs.mini_batch_size,
        epochs=bs.epochs,
        seed=shuffle_seed(bs.seed, bs.shuffle, data.meta_info),
        dataloader_kwargs={"shuffle": bs.shuffle},
    )
    metrics: dict[str, list] = {}
    start = time.perf_counter()
    for mini in iterator:
        append_metrics(metrics, forward_backward(mini))
        grad_norm, stepped = engine.optimizer_step(max_grad_norm)
        append_metrics(metrics, {f"{role}/grad_norm": grad_norm, f"{role}/step_skipped": float(not stepped)})
    elapsed = time.perf_counter() - start
    append_metrics(metrics, {f"{role}/lr": engine.lr()})
    engine.lr_scheduler_step()
    seqlens = data.batch["attention_mask"].sum(-1).tolist() * bs.epochs
    append_metrics(metrics, perf.metrics(seqlens, elapsed))
    return metrics


class MicroBatchedRole:
    """The state the actor and the critic share: one trained (or frozen) model behind a TrainEngine,
    micro-batched passes and the update loop above.

    A subclass sets `role`, the metric prefix ("actor", "critic").

    Args:
        config: the role's config (its `max_grad_norm` clips the update).
        engine: the role's TrainEngine. A bare nn.Module (a test, a notebook) is wrapped in a
            `ModuleEngine` with the keyword arguments below (ignored for an engine).
        optimizer, lr_scheduler: the bare module's (None for a forward-only role).
        dp_size, dp_group, sp, use_remove_padding, use_fused_kernels: the bare module's layout
            (see ModuleEngine).
        batch_sizes: per-rank batch sizes (`normalize_actor_batch_sizes` / `normalize_critic_batch_sizes`).
        peak_flops: peak FLOP/s of one device for `perf/mfu/{role}` (None: not reported).
    """

    role = "role"

    def __init__(
        self,
        config: Any,
        engine: TrainEngine | nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        dp_size: int = 1,
        batch_sizes: PerRankBatchSizes | None = None,
        use_remove_padding: bool = False,
        dp_group: Any = None,
        peak_flops: float | None = None,
        sp: SPGroup | None = None,
        use_fused_kernels: bool = True,
    ) -> None:
        if not isinstance(engine, TrainEngine):
            from hybridrl.engine.module_engine import ModuleEngine

            engine = ModuleEngine(
                engine,
                optimizer,
                lr_scheduler,
                role=self.role,
                dp_size=dp_size,
                dp_group=dp_group,
                sp=sp,
                use_remove_padding=use_remove_padding,
                use_fused_kernels=use_fused_kernels,
            )
        self.config = config
        self.engine = engine
        self.batch_sizes = batch_sizes
        self.peak_flops = peak_flops
        self.device = get_torch_device()
        self._perf = UpdatePerf(self.role, engine, peak_flops)

    @property
    def dp_size(self) -> int:
        return self.engine.dp_size

    @property
    def dp_group(self) -> Any:
        return self.engine.dp_group

    def split(
        self, batch: Any, micro_batch_size: int, use_dynamic_bsz: bool, max_token_len: int | None, key: str
    ):
        """(micro-batches, row indices or None) of `batch`, see batching.split_micro_batches."""
        return split_micro_batches(
            batch,
            micro_batch_size=micro_batch_size,
            use_dynamic_bsz=use_dynamic_bsz,
            max_token_len=max_token_len,
            dp_group=self.dp_group,
            key=key,
        )

    def prepare(self, mini_batch: DataProto, token_budget_key: str) -> tuple[Any, LossScale, list]:
        """See `prepare_mini_batch`."""
        return prepare_mini_batch(
            mini_batch,
            device=self.device,
            batch_sizes=self.batch_sizes,
            dp_size=self.dp_size,
            dp_group=self.dp_group,
            token_budget_key=token_budget_key,
        )

    def run_update(self, data: DataProto, forward_backward: Callable[[DataProto], dict[str, float]]):
        """See `run_update`: one optimizer step (clipped at config.max_grad_norm) per mini-batch."""
        return run_update(
            data,
            role=self.role,
            engine=self.engine,
            batch_sizes=self.batch_sizes,
            forward_backward=forward_backward,
            max_grad_norm=self.config.max_grad_norm,
            perf=self._perf,
        )
