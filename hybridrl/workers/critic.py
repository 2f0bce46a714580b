"""The PPO critic: values of response tokens and the clipped value-loss update over an FSDP2 model.

The critic is an `AutoModelForTokenClassification` with one label (see engine.fsdp): one value
per position. The value of response token t is read at the position that predicts it (the same
alignment as the actor's log-probs). Methods are collectives over the data-parallel ranks.

Batch keys (B rows on this rank, P prompt, T response length): input_ids (B, P+T),
attention_mask (B, P+T), position_ids (B, P+T), responses (B, T), response_mask (B, T); for the
update also values (B, T) (at rollout time) and returns (B, T).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.algos.utils import masked_mean
from hybridrl.algos.value import compute_value_loss
from hybridrl.protocol import DataProto
from hybridrl.workers.engine.batching import (
    mean_over_ranks,
    merge_outputs,
    response_mask_of,
)
from hybridrl.workers.engine.forward import forward_values
from hybridrl.workers.engine.update_loop import (
    MicroBatchedRole,
    accumulate_micro_batches,
    forward_without_grad,
)

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


class PPOCritic(MicroBatchedRole):
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
        sp: this rank's Ulysses sequence-parallel group (see `MicroBatchedRole`).
    """

    role = "critic"

    @property
    def _fused(self) -> bool:
        """`critic.model.use_fused_kernels`: the value head only at the response positions."""
        model = getattr(self.config, "model", None)
        return True if model is None else bool(model.use_fused_kernels)

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
        micros, indices = self.split(
            batch, micro_batch_size, use_dynamic_bsz, max_token_len, "critic.forward_max_token_len_per_gpu"
        )
        outs = forward_without_grad(
            self.module,
            micros,
            lambda m: forward_values(
                self.module, m, use_remove_padding=self.use_remove_padding, sp=self.sp, fused=self._fused
            ),
        )
        values = merge_outputs(outs, indices)
        return (values * response_mask_of(batch)).cpu()

    def forward_backward(self, mini_batch: DataProto) -> dict[str, float]:
        """Accumulate the value-loss gradient of one mini-batch (no optimizer step).

        Returns the mini-batch's vf_loss, vf_clipfrac and vpred_mean (the same on every rank).
        """
        _, loss_scale, micros = self.prepare(mini_batch, "critic.ppo_max_token_len_per_gpu")
        sums, means = accumulate_micro_batches(micros, loss_scale, self._micro_batch_loss)
        return mean_over_ranks({**sums, **means}, self.dp_group, self.dp_size, self.device)

    def _micro_batch_loss(self, micro: Any, mask: torch.Tensor, loss_scale: Any):
        """(clipped value loss, {vf_loss}, {vf_clipfrac, vpred_mean}) of one micro-batch."""
        vpreds = forward_values(
            self.module, micro, use_remove_padding=self.use_remove_padding, sp=self.sp, fused=self._fused
        )
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro["returns"],
            micro["values"],
            mask,
            cliprange_value=self.config.cliprange_value,
            loss_agg_mode=self.config.loss_agg_mode,
            loss_scale=loss_scale,
        )
        means = {"critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": masked_mean(vpreds.detach(), mask)}
        return vf_loss, {"critic/vf_loss": float(vf_loss.detach())}, means

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
        keys = [*_FORWARD_KEYS, "values", "returns"]
        missing = [k for k in keys if k not in data.batch.keys()]
        if missing:
            raise KeyError(f"update_critic: the batch lacks {missing}; it has {sorted(data.batch.keys())}")
        if "response_mask" in data.batch.keys():
            keys.append("response_mask")
        data = DataProto(batch=data.batch.select(*keys), meta_info=dict(data.meta_info))
        return self.run_update(data, self.forward_backward)
