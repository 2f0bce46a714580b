"""`trainer.log_floors`: each step's update and generation against this machine's floors
(hybridrl/utils/floors.py), measured once at start-up; logged as `perf/floor/*`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.utils.floors import Floors, measure_floors, phase_fractions


@dataclass(frozen=True)
class StepFloors:
    """The measured floors and how a step's times map onto them.

    ranks: training ranks (slots); rollout_ranks: rollout data-parallel ranks (world / rollout TP);
    epochs: the actor's ppo_epochs; shared_prompts: the actor runs the shared-prompt forward
    (`actor.use_prefix_grouper`, resolved), which computes each distinct prompt once.
    """

    floors: Floors
    ranks: int
    rollout_ranks: int
    epochs: int
    shared_prompts: bool = False

    def metrics(
        self,
        all_tokens: int,
        response_tokens: int,
        timing: Mapping[str, float],
        update_tokens: int | None = None,
    ) -> dict[str, float]:
        """`perf/floor/*` of one step from its token counts and `timing_s` sections (`update_actor`,
        `gen` less the weight sync `update_weights`). `update_tokens`: the tokens the update's
        forward computes when that is fewer than `all_tokens` (the shared-prompt forward: each
        distinct prompt once); None: `all_tokens`."""
        tokens = all_tokens if update_tokens is None else update_tokens
        out = phase_fractions(
            self.floors, all_tokens=tokens, response_tokens=response_tokens,
            update_s=timing.get("update_actor"), gen_s=None, ranks=self.ranks, epochs=self.epochs,
        )  # fmt: skip
        gen_s = timing.get("gen", 0.0) - timing.get("update_weights", 0.0)
        gen = phase_fractions(
            self.floors, all_tokens=all_tokens, response_tokens=response_tokens,
            update_s=None, gen_s=gen_s, ranks=self.rollout_ranks,
        )  # fmt: skip
        out.update({k: v for k, v in gen.items() if k.startswith("perf/floor/gen_")})
        return out


def _dtypes(config: Any) -> tuple[torch.dtype, torch.dtype]:
    from hybridrl.utils.torch_utils import str_to_dtype

    mp = config.actor_rollout_ref.actor.fsdp_config
    train = mp.mixed_precision.param_dtype if mp.model_dtype in ("fp32", "float32") else mp.model_dtype
    return str_to_dtype(train), str_to_dtype(config.actor_rollout_ref.rollout.dtype)


def measure_step_floors(config: Any, seconds: float = 1.0) -> StepFloors | None:
    """Measure the floors for this run when `trainer.log_floors` is on (None otherwise); CPU: with
    one slot's thread count (`trainer.cpus_per_worker`). Prints them once."""
    if not config.trainer.log_floors:
        return None
    from transformers import AutoConfig

    arr, tr = config.actor_rollout_ref, config.trainer
    world = tr.nnodes * tr.n_gpus_per_node
    rollout_ranks = max(1, world // max(1, arr.rollout.tensor_model_parallel_size))
    rows = max(1, config.data.train_batch_size * arr.rollout.n // rollout_ranks)
    hf_config = AutoConfig.from_pretrained(arr.model.path, trust_remote_code=arr.model.trust_remote_code)
    train_dtype, decode_dtype = _dtypes(config)
    gpu = torch.cuda.is_available()
    threads = torch.get_num_threads()
    if not gpu:
        torch.set_num_threads(max(1, int(tr.cpus_per_worker)))
    try:
        floors = measure_floors(
            hf_config, decode_rows=rows, train_dtype=train_dtype, decode_dtype=decode_dtype,
            device="cuda" if gpu else "cpu", seconds=seconds,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    print(
        f"[hybridrl] trainer.log_floors: GEMM peak {floors.gemm_peak_flops / 1e9:.1f} GFLOP/s ({train_dtype}) "
        f"per slot; decode bound {floors.decode_bound_tokens_per_s:.0f} tokens/s at {rows} rows ({decode_dtype}, "
        f"{floors.decode_form}); logged as perf/floor/*"
    )
    return StepFloors(
        floors, world, rollout_ranks, arr.actor.ppo_epochs, arr.actor.use_prefix_grouper is True
    )
