"""The one training-engine interface, and the registry of engines keyed by veRL's `model_engine` names.

A training engine holds one role's model (actor, reference, critic) on this rank, with its
optimizer and lr schedule when the role is trained, and knows how the model is run: sharded
(FSDP2), split over tensor / pipeline stages (Megatron), or as is (a single process). The roles
(`workers/actor.py`, `workers/critic.py`) and the workers (`workers/engine_workers.py`) talk to
an engine only through this interface, so a new backend is one folder plus one `register_engine`.

What the interface covers (every method is a collective over the engine's ranks):

* compute: `forward(micros, request)` without gradients, and `forward_backward(micros, request,
  loss_fn)`; the request says what to compute from the model's output (`LogProbRequest`: log-probs,
  entropy, sum pi^2 of the response tokens; `ValueRequest`: values; `ScoreRequest`: a reward
  model's score of each sequence), the engine computes it its
  own way (HF head, chunked head, vocabulary-parallel logits) and hands the named result
  (`LogProbs`, or a (b, T) values tensor) to the caller, on every rank of a model replica;
* the optimizer: `optimizer_step(max_grad_norm) -> (grad_norm, stepped)`, `lr()`,
  `lr_scheduler_step()`;
* weights: `iter_params(dtype, loader)` for the weight sync and publishing (full tensors with
  HF names; `loader` is the rollout's weight loader, see rollout/parallel.weight_loader_for),
  `export_hf(dir)`, `save_checkpoint` / `load_checkpoint`, `onload` / `offload`;
* layout: `dp_size`, `dp_rank`, `dp_group` (the ranks that see distinct rows);
* `disable_adapter()`: the LoRA base model as the reference policy;
* `perf_model()`: what the update's MFU metric needs.

Which ranks hold the outputs is the dispatch mesh's business: `ParallelDims.train_mesh()`
(workers/parallel_dims.py) collects each data-parallel group's rows from one rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ENGINE_NAMES",
    "EngineBuildSpec",
    "EngineEntry",
    "LogProbRequest",
    "LogProbs",
    "PerfModel",
    "ScoreRequest",
    "TrainEngine",
    "ValueRequest",
    "canonical_engine_name",
    "get_engine",
    "register_engine",
    "unregister_engine",
]


# ----------------------------------------------------------------------------------------------
# what to compute, and the named results
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogProbRequest:
    """Log-probs (and optionally entropy, sum pi^2) of the response tokens, logits / temperature.

    Args:
        temperature: the rollout's sampling temperature (> 0).
        calculate_entropy: also the entropy of each response position.
        entropy_grad: False computes the entropy without a graph (a metric only).
        sum_pi_squared: also sum_v pi(v)^2 of each response position (no gradient).
        entropy_chunk_size: the entropy this many positions at a time (plain HF head only).
        compile_kernels: `actor.use_torch_compile` (HF engines: the head's kernels compiled).
        prefix_group: `actor.use_prefix_grouper` (HF engines: shared-prompt forward).
        topk: > 0: also the k largest log-probs and their ids per position (a distillation teacher).
        topk_ids: also the log-probs at the micro-batch's `teacher_topk_ids` (B, T, K) (the student of
            `forward_kl_topk`). Both through the full logits (engine/topk.py).
        record_routing: a mixture-of-experts model also returns the experts each token was routed
            to (`LogProbs.routed_experts`).
        replay_routing: a mixture-of-experts model routes with the micro-batch's `routed_experts`
            (routing replay, engine/moe_routing.py).
        router_aux_loss: a mixture-of-experts model also returns its router load-balancing loss and
            expert-load metrics.
    """

    temperature: float = 1.0
    calculate_entropy: bool = False
    entropy_grad: bool = True
    sum_pi_squared: bool = False
    entropy_chunk_size: int | None = None
    compile_kernels: bool = False
    prefix_group: bool = False
    topk: int = 0
    topk_ids: bool = False
    record_routing: bool = False
    replay_routing: bool = False
    router_aux_loss: bool = False


@dataclass(frozen=True)
class ValueRequest:
    """The critic's value of the state before each response token."""


@dataclass(frozen=True)
class ScoreRequest:
    """A reward model's score of each sequence: its head's output at the last valid token, (b,).

    Args:
        prefix_group: rows with the same prompt share one forward of it (HF engines: the
            shared-prompt forward, `engine.prefix_group`); the micro-batch is then in the veRL
            layout (prompts left-padded, `responses` (b, T) right-padded).
    """

    prefix_group: bool = False


@dataclass
class LogProbs:
    """Per response token (b, T) float32: log pi(a_t); entropy and sum pi^2 when requested, else None;
    with a top-k request topk_log_probs (b, T, K) float32 and topk_ids (b, T, K) long. `work`:
    (tokens, squares) the forward computed (utils/flops.work_flops) when that is not one sequence
    per row (the shared-prompt forward computes each prompt once per group), else None.
    Mixture-of-experts models, when the request asks: routed_experts (b, S, L, K) long (-1 at
    padding), router_aux_loss (scalar, differentiable) and moe_metrics (name -> float)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    work: tuple[int, int] | None = None
    routed_experts: torch.Tensor | None = None
    router_aux_loss: torch.Tensor | None = None
    moe_metrics: dict[str, float] | None = None

    def to(self, device: Any) -> LogProbs:
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return LogProbs(*(move(getattr(self, f.name)) for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class PerfModel:
    """The FLOP model of one update (see utils/flops.estimate_flops).

    num_params: parameters counted in the 6N rule; num_layers / attn_dim: attention FLOPs;
    ranks_per_sample: ranks that share one sample's FLOPs (Ulysses SP size; 1 otherwise).
    """

    num_params: int
    num_layers: int
    attn_dim: int
    ranks_per_sample: int = 1


# micro-batch, the engine's output for it (LogProbs, or values (b, T)) -> (loss to backpropagate, aux)
LossFn = Callable[[Any, Any], tuple[torch.Tensor, Any]]


# ----------------------------------------------------------------------------------------------
# the interface
# ----------------------------------------------------------------------------------------------
class TrainEngine(ABC):
    """One role's model on this rank, and how it is run (see the module docstring).

    Attributes every engine sets: `role` ("actor", "ref", "critic"), `tokenizer` (or None),
    `optimizer` / `lr_scheduler` (None for a forward-only role).
    """

    role: str
    tokenizer: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    # the rollout weight loaders `iter_params` feeds (rollout/parallel.weight_loader_for), its own first
    weight_loaders: tuple[str, ...] = ("dtensor", "hf")

    # -- layout --------------------------------------------------------------------------------
    @property
    @abstractmethod
    def dp_size(self) -> int:
        """Data-parallel ranks: the groups of ranks that see distinct rows."""

    @property
    @abstractmethod
    def dp_rank(self) -> int:
        """This rank's data-parallel index."""

    @property
    @abstractmethod
    def dp_group(self) -> Any:
        """The process group to all-reduce over the data-parallel ranks (None: one rank)."""

    # -- compute -------------------------------------------------------------------------------
    @abstractmethod
    def forward(
        self, micros: Sequence[Any], request: LogProbRequest | ValueRequest | ScoreRequest
    ) -> list[Any]:
        """The requested output of every micro-batch, without gradients, in eval mode.

        Args:
            micros: micro-batches (TensorDicts: input_ids, attention_mask, position_ids (b, S),
                responses (b, T)), on this engine's device.

        Returns:
            One `LogProbs`, values (b, T) or scores (b,) per micro-batch, on every rank of the model
            replica.
        """

    @abstractmethod
    def forward_backward(
        self, micros: Sequence[Any], request: LogProbRequest | ValueRequest | ScoreRequest, loss_fn: LossFn
    ) -> list[Any]:
        """Forward every micro-batch in train mode, `loss, aux = loss_fn(micro, output)`, backward the
        loss (gradients accumulate; the loss is already normalised by the whole mini-batch).

        Returns:
            The `aux` of every micro-batch, in order, on every rank of the model replica.
        """

    @abstractmethod
    def optimizer_step(self, max_grad_norm: float) -> tuple[float, bool]:
        """Clip the gradient norm to `max_grad_norm` (<= 0: measure only), step unless it is not
        finite, zero the gradients. Returns (grad_norm, stepped). A forward-only engine refuses
        (`require_optimizer`)."""

    def require_optimizer(self, what: str = "optimizer_step") -> None:
        """Refuse `what` on a forward-only engine (a reference) with an error that says so."""
        if self.optimizer is None:
            raise RuntimeError(
                f"{what} on the {self.role} engine ({type(self).__name__}), which was built forward-only "
                "(no optimizer): only the actor and critic roles train"
            )

    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        self.require_optimizer("lr")
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def lr_scheduler_step(self) -> None:
        """Advance the lr schedule by one trainer step (no-op without a schedule)."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    @abstractmethod
    def perf_model(self) -> PerfModel:
        """The FLOP model of this engine's model (for perf/mfu/{role})."""

    # -- weights -------------------------------------------------------------------------------
    @abstractmethod
    def iter_params(
        self, dtype: torch.dtype | None = None, loader: str | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every parameter, gathered bucket by bucket (a collective every
        rank joins). `loader`: the rollout's weight loader ("dtensor", "hf", "megatron"; None: the
        engine's own); an engine refuses one it cannot feed."""

    @abstractmethod
    def save_checkpoint(
        self, path: str, contents: Any = None, global_step: int | None = None, extra: Any = None
    ) -> None:
        """This rank's part of a checkpoint under `path` (model, optimizer, schedule, RNG, extra)."""

    @abstractmethod
    def load_checkpoint(self, path: str, contents: Any = None) -> dict[str, Any]:
        """Load what `save_checkpoint` wrote; returns its state ({"extra": ...} among others)."""

    @abstractmethod
    def export_hf(self, target_dir: str) -> None:
        """Write the whole model as a Hugging Face folder (rank 0 writes; a collective)."""

    def onload(self, with_optimizer: bool = False) -> None:
        """Bring offloaded parameters (and optimizer state) back to the device (default: nothing)."""
        return None

    def offload(self) -> None:
        """Move what the config offloads to host memory after a call (default: nothing)."""
        return None

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """A context in which the model runs without its LoRA adapter (the reference policy)."""
        raise NotImplementedError(f"{type(self).__name__} has no LoRA adapter to disable")


# ----------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineBuildSpec:
    """What an engine's `build_role(spec)` gets: the role and its config sections.

    Args:
        role: "actor", "ref" or "critic".
        model_config: the role's model section (`actor_rollout_ref.model`, `critic.model`).
        role_config: the role's section (ActorConfig, RefConfig, CriticConfig): its `fsdp_config`
            / `megatron` / Ulysses settings.
        optim_config: None for a forward-only role.
        key: the role's config path ("actor_rollout_ref.actor", "critic"), named in errors.
        model_key: the model section's path.
        mesh: the role's dispatch mesh (ParallelDims.train_mesh()); rank: this rank in it.
    """

    role: str
    model_config: Any
    role_config: Any
    optim_config: Any
    key: str
    model_key: str
    mesh: Any
    rank: int


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: its class (with `build_role(...)`) and the parallel kind of its mesh.

    Args:
        name: veRL's `model_engine` name ("dp", "megatron").
        engine_cls: the TrainEngine subclass; `engine_cls.build_role(EngineBuildSpec)` builds it
            on every rank.
        aliases: other spellings accepted for `model_engine` and `*.strategy` ("fsdp", "fsdp2").
        model_parallel: True when the engine splits one model over tp x pp ranks (the mesh and
            the data-parallel size then come from the role's `megatron` section).
    """

    name: str
    engine_cls: type
    aliases: tuple[str, ...] = ()
    model_parallel: bool = False


_ENGINES: dict[str, EngineEntry] = {}
_ALIASES: dict[str, str] = {}
ENGINE_NAMES: list[str] = []  # canonical names, in registration order


def register_engine(
    name: str, engine_cls: type, aliases: Sequence[str] = (), model_parallel: bool = False
) -> None:
    """Register `engine_cls` under `name` (and its aliases) for `model_engine` / `*.strategy`."""
    for spelling in (name, *aliases):
        if spelling in _ALIASES and _ALIASES[spelling] != name:
            raise ValueError(f"engine name {spelling!r} is already registered for {_ALIASES[spelling]!r}")
        _ALIASES[spelling] = name
    _ENGINES[name] = EngineEntry(name, engine_cls, tuple(aliases), model_parallel)
    if name not in ENGINE_NAMES:
        ENGINE_NAMES.append(name)


def unregister_engine(name: str) -> None:
    """Remove the engine registered as `name` and its aliases (tests; plug-ins that are unloaded)."""
    if name not in _ENGINES:
        raise KeyError(f"no training engine is registered as {name!r}; registered: {ENGINE_NAMES}")
    entry = _ENGINES.pop(name)
    for spelling in (name, *entry.aliases):
        _ALIASES.pop(spelling, None)
    ENGINE_NAMES.remove(name)


# the built-in backends: importing one registers it (megatron's import of megatron.core is deferred)
BUILTIN_ENGINE_MODULES = ("hybridrl.engine.fsdp", "hybridrl.engine.megatron")


def _ensure_builtin() -> None:
    import importlib

    for module in BUILTIN_ENGINE_MODULES:
        importlib.import_module(module)


def canonical_engine_name(name: str, key: str = "model_engine") -> str:
    """'dp' for 'fsdp' / 'fsdp2' / 'dp', 'megatron' for 'megatron', ...; ValueError naming `key`."""
    _ensure_builtin()
    if name not in _ALIASES:
        known = sorted(_ALIASES)
        raise ValueError(f"{key}={name!r} is not a registered training engine; use one of {known}")
    return _ALIASES[name]


def get_engine(name: str, key: str = "model_engine") -> EngineEntry:
    """The registered engine of `name` (any spelling); ValueError naming `key` when unknown."""
    return _ENGINES[canonical_engine_name(name, key)]


def all_spellings() -> tuple[str, ...]:
    """Every accepted engine spelling (canonical names and aliases)."""
    _ensure_builtin()
    return tuple(_ALIASES)
