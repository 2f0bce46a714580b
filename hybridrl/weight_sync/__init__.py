"""Every weight movement from the training engines to the rollout engines, in one package.

    buckets.py     a named-tensor stream in bounded buckets; packing a bucket into one buffer
    gather.py      the one gather routine: training shards -> full tensors through the rollout's
                   weight loader (used by every path below)
    colocated.py   the hybrid engine's sync into the rollout engine of the same process (and the
                   last step of every path: a rollout engine loads a stream bucket by bucket)
    component.py   `WeightSync`: the object a worker composes for all of it (trainer side and
                   rollout side)
    collective.py  the weight-update group of trainer rank 0 and the rollout workers (sender,
                   receiver thread, staging)
    wire.py        the group's metadata in its store: JSON of a fixed shape, checked on read
    tp_shards.py   which slice of each tensor a tensor-parallel rollout rank keeps
    publisher.py   the driver's side of the asynchronous trainer's updates (object store or
                   the collective group)

The package sits below the worker classes (hybridrl/workers) and the trainers: it imports none
of them, nor the rollout manager (hybridrl/async_rollout). It drives the training and rollout
engines through their interfaces and imports neither package, so a rollout engine may use its
bucketing (the SGLang engine does).
"""

from hybridrl.weight_sync.buckets import iter_buckets, tensor_nbytes
from hybridrl.weight_sync.colocated import sync_weights, wake_and_sync, weight_sync_step_metrics
from hybridrl.weight_sync.gather import gathered

__all__ = [
    "gathered",
    "iter_buckets",
    "sync_weights",
    "tensor_nbytes",
    "wake_and_sync",
    "weight_sync_step_metrics",
]
