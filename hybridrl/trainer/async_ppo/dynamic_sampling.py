"""DAPO dynamic sampling (`algorithm.filter_groups.*`) in the asynchronous trainer.

The synchronous trainer generates batch after batch until B groups with a non-constant metric
are kept. Here the manager scores every finished chunk in its background thread, drops the
groups whose `filter_groups.metric` is constant (DAPO section 3.2, `algos.filter_groups_by_metric`)
and un-commits them, so the staleness gate admits replacements; the consumer waits until it has
B kept groups, and the trainer tops the prompt queue up while it waits.
`filter_groups.max_num_gen_batches = m > 0` allows, as in the synchronous trainer, at most m
batches' worth of prompts per trained batch: more than (m - 1) * B dropped groups stop the run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridrl import algos
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.batch_steps import group_metric

__all__ = ["dynamic_sampling"]


def dynamic_sampling(config: Any) -> dict[str, Any]:
    """AsyncRolloutManager's `group_filter` / `max_dropped_per_batch` keywords for `config`."""
    fg = config.algorithm.filter_groups
    if not fg.enable:
        return {}
    metric = fg.metric

    def keep_rows(rows: DataProto) -> np.ndarray:
        return algos.filter_groups_by_metric(rows.non_tensor_batch["uid"], group_metric(rows, metric))

    b = config.data.train_batch_size
    limit = (fg.max_num_gen_batches - 1) * b if fg.max_num_gen_batches > 0 else None
    return {"group_filter": keep_rows, "max_dropped_per_batch": limit}
