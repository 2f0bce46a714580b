"""The micro-batched forward / backward / optimizer-step loop shared by the actor and the critic.

A role (actor, critic) supplies only its per-micro-batch loss; this module does the rest, the
same way for both:

* `prepare_mini_batch`: move a mini-batch to the device, count its loss tokens over all ranks
  (`global_loss_scale`) and split it into micro-batches (fixed size or token budget);
* `accumulate_micro_batches`: forward + backward every micro-batch (gradients accumulate), sum
  the losses and take token-weighted means of the metrics;
* `run_update`: epochs over shuffled mini-batches, one optimizer step each, then the lr
  scheduler once per call (one trainer step, as in veRL) and the throughput / MFU metrics;
* `forward_without_grad`: the forward-only pass (old log-probs, reference log-probs, values) in
  eval mode;
* `MicroBatchedRole`: the state both roles hold, with the three steps above bound to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hybridrl.algos.agg import LossScale
from hybridrl.protocol import DataProto
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.flops import attention_dims, compute_mfu, count_params, estimate_flops
from hybridrl.workers.batch_sizes import PerRankBatchSizes
from hybridrl.workers.engine.batching import (
    TokenWeightedMeans,
    append_metrics,
    default_dp_group,
    global_loss_scale,
    optimizer_step,
    response_mask_of,
    shuffle_seed,
    split_micro_batches,
)
from hybridrl.workers.engine.ulysses import SPGroup

# micro-batch, its response mask (b, T), the mini-batch's LossScale ->
#   (loss to backpropagate, {metric: value summed over micro-batches}, {metric: token-mean value})
MicroLoss = Callable[[Any, torch.Tensor, LossScale], tuple[torch.Tensor, dict[str, float], dict[str, Any]]]


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


def accumulate_micro_batches(
    micros: Iterable, loss_scale: LossScale, micro_loss: MicroLoss
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Backward every micro-batch's loss (gradients accumulate); returns (summed, token-mean) metrics.

    Each micro-batch loss is normalised by the whole mini-batch (`loss_scale`), so the
    accumulated gradient equals the gradient of the un-split mini-batch.
    """
    means = TokenWeightedMeans(loss_scale)
    sums: dict[str, float] = {}
    for micro in micros:
        mask = response_mask_of(micro)
        loss, micro_sums, micro_means = micro_loss(micro, mask, loss_scale)
        loss.backward()
        for k, v in micro_sums.items():
            sums[k] = sums.get(k, 0.0) + v
        means.add(micro_means, mask.sum())
    return sums, means.result()


def forward_without_grad(module: nn.Module, micros: Iterable, forward: Callable[[Any], Any]) -> list:
    """`forward(micro)` for every micro-batch in eval mode without gradients; the module's mode is restored."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return [forward(micro) for micro in micros]
    finally:
        module.train(was_training)


class UpdatePerf:
    """`perf/{role}/tokens`, `perf/{role}/update_s` and `perf/mfu/{role}` of one update call.

    The model's parameter count and attention shape are read once, at the first call. With
    Ulysses SP each of the `sp_size` ranks of a group does 1 / sp_size of its group's FLOPs.
    """

    def __init__(self, role: str, module: nn.Module, peak_flops: float | None, sp_size: int = 1) -> None:
        self.role, self.module, self.peak_flops, self.sp_size = role, module, peak_flops, sp_size
        self._dims: tuple[int, int, int] | None = None

    def metrics(self, seqlens: list[int], seconds: float) -> dict[str, float]:
        if self._dims is None:
            layers, attn_dim = attention_dims(self.module.config)
            self._dims = (count_params(self.module), layers, attn_dim)
        out = {f"perf/{self.role}/tokens": float(sum(seqlens)), f"perf/{self.role}/update_s": seconds}
        mfu = compute_mfu(
            estimate_flops(self._dims[0], seqlens, self._dims[1], self._dims[2]) / self.sp_size,
            seconds,
            self.peak_flops,
        )
        if mfu is not None:
            out[f"perf/mfu/{self.role}"] = mfu
        return out


def run_update(
    data: DataProto,
    *,
    role: str,
    module: nn.Module,
    batch_sizes: PerRankBatchSizes,
    forward_backward: Callable[[DataProto], dict[str, float]],
    step: Callable[[], tuple[float, bool]],
    lr_scheduler: Any,
    optimizer: Any,
    perf: UpdatePerf,
) -> dict[str, list[float]]:
    """Epochs over shuffled mini-batches of `data`: `forward_backward(mini)` then `step()` each.

    Args:
        role: metric prefix ("actor", "critic").
        module: put in training mode first.
        step: the optimizer step; returns (grad norm, whether the step was taken).
        lr_scheduler: stepped once per call (None: the optimizer's lr is reported as is).

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
    module.train()
    metrics: dict[str, list] = {}
    start = time.perf_counter()
    for mini in iterator:
        append_metrics(metrics, forward_backward(mini))
        grad_norm, stepped = step()
        append_metrics(metrics, {f"{role}/grad_norm": grad_norm, f"{role}/step_skipped": float(not stepped)})
    elapsed = time.perf_counter() - start
    if lr_scheduler is not None:
        append_metrics(metrics, {f"{role}/lr": lr_scheduler.get_last_lr()[0]})
        lr_scheduler.step()
    else:
        append_metrics(metrics, {f"{role}/lr": optimizer.param_groups[0]["lr"]})
    seqlens = data.batch["attention_mask"].sum(-1).tolist() * bs.epochs
    append_metrics(metrics, perf.metrics(seqlens, elapsed))
    return metrics


class MicroBatchedRole:
    """The state and plumbing the actor and the critic share: one trained (or frozen) model on the
    data-parallel ranks, micro-batched forward passes and the update loop above.

    A subclass sets `role`, the metric prefix ("actor", "critic").

    Args:
        config: the role's config (its `max_grad_norm` clips the update).
        module: the sharded model.
        optimizer, lr_scheduler: None for a forward-only role (the reference policy).
        dp_size: data-parallel ranks (the gradient average FSDP takes).
        batch_sizes: per-rank batch sizes (`normalize_actor_batch_sizes` / `normalize_critic_batch_sizes`).
        use_remove_padding: pack valid tokens into one row.
        dp_group: process group of the data-parallel ranks (default: WORLD when dp_size > 1).
        peak_flops: peak FLOP/s of one device for `perf/mfu/{role}` (None: not reported).
        sp: this rank's Ulysses group (`engine.ulysses`; the module went through
            `parallelize_sp`): the ranks of a group get the same rows, dp_size / dp_group then
            count the groups (world / sp), not the ranks.
    """

    role = "role"

    def __init__(
        self,
        config: Any,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        dp_size: int = 1,
        batch_sizes: PerRankBatchSizes | None = None,
        use_remove_padding: bool = False,
        dp_group: Any = None,
        peak_flops: float | None = None,
        sp: SPGroup | None = None,
    ) -> None:
        self.config = config
        self.sp = sp
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp_size = dp_size
        self.batch_sizes = batch_sizes
        self.use_remove_padding = use_remove_padding
        self.dp_group = default_dp_group(dp_size, dp_group)
        self.peak_flops = peak_flops
        self.device = get_torch_device()
        self._perf = UpdatePerf(self.role, module, peak_flops, sp.size if sp is not None else 1)

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
        """See `run_update`: one optimizer step (grad-norm clipped) per mini-batch."""
        return run_update(
            data,
            role=self.role,
            module=self.module,
            batch_sizes=self.batch_sizes,
            forward_backward=forward_backward,
            step=lambda: optimizer_step(self.module, self.optimizer, self.config.max_grad_norm),
            lr_scheduler=self.lr_scheduler,
            optimizer=self.optimizer,
            perf=self._perf,
        )
