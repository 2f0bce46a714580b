"""Rollout (generation) engines of the hybrid engine (the weight sync into them: hybridrl.weight_sync).

`get_rollout_class(config.name)` imports an engine only when it is asked for, so importing
hybridrl never imports vllm or sglang. See base.py for the batch contract.
"""

from hybridrl.config.rollout import EngineKwargs, RolloutConfig, SamplingOverrides
from hybridrl.rollout.base import (
    BaseRollout,
    GenerationRequest,
    GenerationResult,
    SamplingSpec,
    build_rollout_output,
    create_rollout,
    derive_seed,
    get_rollout_class,
    list_rollouts,
    register_rollout,
    resolve_sampling,
)

__all__ = [
    "BaseRollout",
    "EngineKwargs",
    "GenerationRequest",
    "GenerationResult",
    "RolloutConfig",
    "SamplingOverrides",
    "SamplingSpec",
    "build_rollout_output",
    "create_rollout",
    "derive_seed",
    "get_rollout_class",
    "list_rollouts",
    "register_rollout",
    "resolve_sampling",
]
