"""Asynchronous rollouts (AReaL-style): staleness control and the rollout manager.

`staleness` holds the pure rules (producer gate, consumer rule, metrics); `manager` drives Ray
rollout workers with them. docs/async.md describes the design.
"""

from hybridrl.async_rollout.staleness import StalenessError, StalenessManager, select_batch, staleness_metrics

__all__ = ["StalenessError", "StalenessManager", "select_batch", "staleness_metrics"]
