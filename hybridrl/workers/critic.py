"""The PPO critic: values of response tokens and the clipped value-loss update over an FSDP2 model.

The critic is an `AutoModelForTokenClassification` with one label (see engine.fsdp): one value
per position. The value of response token t is read at the position that predicts it (the same
alignment as the actor's log-probs). Methods are collectives over the data-parallel ranks.

Batch keys (B rows on this rank, P prompt, T response length): input_ids (B, P+T),
attention_mask (B, P+T), position_ids (B, P+T), responses (B, T), response_mask (B, T); for the
update also values (B, T) (at rollout time) and returns (B, T).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hybridrl.algos.utils import masked_mean
from hybridrl.algos.value import compute_value_loss
from hybridrl.protocol import DataProto
from hybridrl.utils.device import get_torch_device
from hybridrl.utils.flops import attention_dims, compute_mfu, count_params, estimate_flops
from hybridrl.workers.config import CriticConfig, PerRankBatchSizes
from hybridrl.workers.engine.batching import (
    TokenWeightedMeans,
    append_metrics,
    default_dp_group,
    global_loss_scale,
    mean_over_ranks,
    merge_outputs,
    optimizer_step,
    response_mask_of,
    shuffle_seed,
    split_micro_batches,
)
from hybridrl.workers.engine.forward import forward_values

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


class PPOCritic:
    """Value model over an FSDP2-sharded token-classification model.

    Args:
        config: the critic config.
        module: the sharded model (FSDPEngine.module).
        optimizer, lr_scheduler: from the engine.
        dp_size: data-parallel ranks.
        batch_sizes: from `normalize_critic_batch_sizes` (defaults for both methods).
        use_remove_padding: pack valid tokens into one row (`critic.model.use_remove_padding`).
        dp_group: process group of the data-parallel ranks (default: WORLD when dp_size > 1).
        peak_flops: peak FLOP/s of one device for `perf/mfu/critic` (None: not reported).
    """

    def __init__(
        self,
        config: CriticConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        dp_size: int = 1,
        batch_sizes: PerRankBatchSizes | None = None,
        use_remove_padding: bool = False,
        dp_group: Any = None,
        peak_flops: float | None = None,
    ) -> None:
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp_size = dp_size
        self.batch_sizes = batch_sizes
        self.use_remove_padding = use_remove_padding
        self.dp_group = default_dp_group(dp_size, dp_group)
        self.peak_flops = peak_flops
        self.device = get_torch_device()
        self._flops_dims: tuple[int, int, int] | None = None

    def compute_values(
        self,
        data: DataProto,
        *,
        micro_batch_size: int | None = None,
        use_dynamic_bsz: bool | None = None,
        max_token_len: int | None = None,
    ) -> torch.Tensor:
        """Values (B, T) of `data`'s response tokens, 0 where response_mask is 0 (float32, CPU).

        Micro-batching defaults to the forward sizes of `batch_sizes` (one micro-batch without).
        """
        bs = self.batch_sizes
        if use_dynamic_bsz is None:
            use_dynamic_bsz = bs.use_dynamic_bsz if bs else False
        micro_batch_size = micro_batch_size or (bs.forward_micro_batch_size if bs else None) or len(data)
        max_token_len = max_token_len or (bs.forward_max_token_len if bs else None)
        keys = [*_FORWARD_KEYS] + (["response_mask"] if "response_mask" in data.batch.keys() else [])
        batch = data.batch.select(*keys).to(self.device)
        micros, indices = split_micro_batches(
            batch,
            micro_batch_size=micro_batch_size,
            use_dynamic_bsz=use_dynamic_bsz,
            max_token_len=max_token_len,
            dp_group=self.dp_group,
            key="critic.forward_max_token_len_per_gpu",
        )
        was_training = self.module.training
        self.module.eval()
        outs = []
        try:
            with torch.no_grad():
                for micro in micros:
                    outs.append(
                        forward_values(self.module, micro, use_remove_padding=self.use_remove_padding)
                    )
        finally:
            self.module.train(was_training)
        values = merge_outputs(outs, indices)
        return (values * response_mask_of(batch)).cpu()

    def forward_backward(self, mini_batch: DataProto) -> dict[str, float]:
        """Accumulate the value-loss gradient of one mini-batch (no optimizer step).

        Returns the mini-batch's vf_loss, vf_clipfrac and vpred_mean (the same on every rank).
        """
        bs = self.batch_sizes
        batch = mini_batch.batch.to(self.device)
        mask = response_mask_of(batch)
        loss_scale = global_loss_scale(
            mask,
            dp_size=self.dp_size,
            dp_group=self.dp_group,
            max_response_length=mini_batch.meta_info.get("max_response_length", mask.shape[-1]),
        )
        micros, _ = split_micro_batches(
            batch,
            micro_batch_size=bs.micro_batch_size if bs else len(mini_batch),
            use_dynamic_bsz=bs.use_dynamic_bsz if bs else False,
            max_token_len=bs.max_token_len if bs else None,
            dp_group=self.dp_group,
            key="critic.ppo_max_token_len_per_gpu",
        )
        means = TokenWeightedMeans(loss_scale)
        vf_loss_sum = 0.0
        for micro in micros:
            m_mask = response_mask_of(micro)
            vpreds = forward_values(self.module, micro, use_remove_padding=self.use_remove_padding)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds,
                micro["returns"],
                micro["values"],
                m_mask,
                cliprange_value=self.config.cliprange_value,
                loss_agg_mode=self.config.loss_agg_mode,
                loss_scale=loss_scale,
            )
            vf_loss.backward()
            vf_loss_sum += float(vf_loss.detach())
            vpred_mean = masked_mean(vpreds.detach(), m_mask)
            means.add({"critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": vpred_mean}, m_mask.sum())
        result = {"critic/vf_loss": vf_loss_sum, **means.result()}
        return mean_over_ranks(result, self.dp_group, self.dp_size, self.device)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """Epochs over mini-batches of `data`, one optimizer step each; the lr scheduler steps once.

        Returns:
            metric name -> list (one entry per mini-batch, or per call for lr / perf).
        """
        if self.optimizer is None:
            raise RuntimeError("update_critic needs an optimizer")
        if self.batch_sizes is None:
            raise ValueError(
                "update_critic needs batch_sizes=normalize_critic_batch_sizes(...) at construction"
            )
        bs = self.batch_sizes
        keys = [*_FORWARD_KEYS, "values", "returns"]
        missing = [k for k in keys if k not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_critic: the batch lacks {missing}; it has {sorted(data.batch.keys())}")
        if "response_mask" in data.batch.keys():
            keys.append("response_mask")
        data = DataProto(batch=data.batch.select(*keys), meta_info=dict(data.meta_info))
        seed = shuffle_seed(bs.seed, bs.shuffle, data.meta_info)
        iterator = data.make_iterator(
            mini_batch_size=bs.mini_batch_size,
            epochs=bs.epochs,
            seed=seed,
            dataloader_kwargs={"shuffle": bs.shuffle},
        )
        self.module.train()
        metrics: dict[str, list] = {}
        start = time.perf_counter()
        for mini in iterator:
            append_metrics(metrics, self.forward_backward(mini))
            grad_norm, stepped = optimizer_step(self.module, self.optimizer, self.config.max_grad_norm)
            append_metrics(
                metrics, {"critic/grad_norm": grad_norm, "critic/step_skipped": float(not stepped)}
            )
        elapsed = time.perf_counter() - start
        if self.lr_scheduler is not None:
            append_metrics(metrics, {"critic/lr": self.lr_scheduler.get_last_lr()[0]})
            self.lr_scheduler.step()
        else:
            append_metrics(metrics, {"critic/lr": self.optimizer.param_groups[0]["lr"]})
        seqlens = data.batch["attention_mask"].sum(-1).tolist() * bs.epochs
        if self._flops_dims is None:
            layers, attn_dim = attention_dims(self.module.config)
            self._flops_dims = (count_params(self.module), layers, attn_dim)
        flops = estimate_flops(self._flops_dims[0], seqlens, self._flops_dims[1], self._flops_dims[2])
        perf = {"perf/critic/tokens": float(sum(seqlens)), "perf/critic/update_s": elapsed}
        mfu = compute_mfu(flops, elapsed, self.peak_flops)
        if mfu is not None:
            perf["perf/mfu/critic"] = mfu
        append_metrics(metrics, perf)
        return metrics
