"""The per-rank batch sizes of a training role: what the engines' update loop and the workers read.

Derived once on the driver by `hybridrl.workers.batch_sizes.normalize_actor_batch_sizes` /
`normalize_critic_batch_sizes`, which validate the role's config against the engines and the
world size.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PerRankBatchSizes"]


@dataclass(frozen=True)
class PerRankBatchSizes:
    """Batch sizes one rank uses, derived once from a role's config (see normalize_*).

    mini_batch_size: rows (responses) per optimizer step on this rank.
    micro_batch_size: rows per forward/backward (None with dynamic batch size).
    max_token_len: token budget of one micro-batch with dynamic batch size.
    forward_micro_batch_size / forward_max_token_len: the same for forward-only passes.
    """

    mini_batch_size: int
    micro_batch_size: int | None
    use_dynamic_bsz: bool
    max_token_len: int
    forward_micro_batch_size: int | None
    forward_max_token_len: int
    epochs: int
    shuffle: bool
    seed: int | None
    dp_size: int
    rollout_n: int
