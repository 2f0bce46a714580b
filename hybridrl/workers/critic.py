"""The PPO critic: values of response tokens and the clipped value-loss update over any training engine.

The critic is a value model behind a `TrainEngine` (an `AutoModelForTokenClassification` with
one label on the HF engines, a GPT backbone with a value head on Megatron): one value per position. The value of response token t is read at the position that predicts it (the same
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
from hybridrl.engine.base import ValueRequest
from hybridrl.engine.batching import mean_over_ranks, merge_outputs, response_mask_of
from hybridrl.engine.update_loop import MicroBatchedRole, combine_micro_metrics, micro_loss_aux
from hybridrl.protocol import DataProto

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


class PPOCritic(MicroBatchedRole):
    """Value model over a TrainEngine.

    Args:
        config: the critic config.
        engine: the engine, or a bare token-classification model with the layout keywords of
            `MicroBatchedRole` (its head runs only at the response positions unless
            `critic.model.use_fused_kernels` is False).
        batch_sizes: from `normalize_critic_batch_sizes` (defaults for both methods).
        peak_flops: peak FLOP/s of one device for `perf/mfu/critic` (None: not reported).
    """

    role = "critic"

    def __init__(self, config: Any, engine: Any, *args: Any, **kwargs: Any) -> None:
        model = getattr(config, "model", None)
        if model is not None:
            kwargs.setdefault("use_fused_kernels", bool(model.use_fused_kernels))
        super().__init__(config, engine, *args, **kwargs)

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
        values = merge_outputs(self.engine.forward(micros, ValueRequest()), indices)
        return (values * response_mask_of(batch)).cpu()

    def forward_backward(self, mini_batch: DataProto) -> dict[str, float]:
        """Accumulate the value-loss gradient of one mini-batch (no optimizer step).

        Returns the mini-batch's vf_loss, vf_clipfrac and vpred_mean (the same on every rank).
        """
        _, loss_scale, micros = self.prepare(mini_batch, "critic.ppo_max_token_len_per_gpu")
        auxes = self.engine.forward_backward(
            micros, ValueRequest(), lambda micro, vpreds: self._micro_batch_loss(micro, vpreds, loss_scale)
        )
        sums, means = combine_micro_metrics(auxes, loss_scale)
        return mean_over_ranks({**sums, **means}, self.dp_group, self.dp_size, self.device)

    def _micro_batch_loss(self, micro: Any, vpreds: torch.Tensor, loss_scale: Any):
        """(clipped value loss, micro_loss_aux of vf_loss, vf_clipfrac, vpred_mean) of one micro-batch."""
        mask = response_mask_of(micro)
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
        return vf_loss, micro_loss_aux({"critic/vf_loss": float(vf_loss.detach())}, means, mask)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """Epochs over mini-batches of `data`, one optimizer step each; the lr scheduler steps once.

        Returns:
            metric name -> list (one entry per mini-batch, or per call for lr / perf).
        """
        if self.engine.optimizer is None:
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
