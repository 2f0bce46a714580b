"""veRL's reward loop (`reward_model.use_reward_loop=True`), colocate mode.

After the rollout the driver's `RewardLoopManager.compute_rm_score(batch)` splits the batch into
`reward_model.num_workers` contiguous chunks, one per `RewardLoopWorker` (a Ray actor; in the
driver with `trainer.backend=local`), and the workers score their chunks concurrently:

* `reward_model.enable=True` (a discriminative reward model): each row's RM input is built exactly
  as the legacy RewardModelWorker builds it (`rm.rm_inputs`: the batch's own tokens, or the text
  re-templated with the RM's chat template when the policy tokenizer differs), and the token ids
  go to a `RewardModelServer` replica (Ray actor, `reward_model.rollout.*`: vLLM's pooling
  runner or the HF forward; one replica per `rollout.tensor_model_parallel_size` slots, workers
  round-robin over them).
* `reward_model.enable=True` with `custom_reward_function.path` (a generative reward model, GenRM):
  the judge is served by `GenRMServer` replicas (`reward_model.rollout.*`: HF generate or vLLM),
  and the reward manager's score function receives `reward_model_client` (a `GenRMClient`) and
  `reward_model_tokenizer` (genrm.py); the workers score their chunks with it, and so do the
  driver's train and validation reward managers. Parse failures and the function's `genrm_*`
  extras become metrics (`genrm_metrics`).
* otherwise the rule-based reward manager of the run (`reward_model.reward_manager`,
  `custom_reward_function`) scores the chunk, as the driver's reward function would.

The result is `rm_scores` (B, T), each row's score on its last valid response token (plus the
reward manager's per-row extras): the reward manager then returns these scores as they are, so
the token-level scores equal the legacy path's (tests/reward/test_reward_loop.py).
  A function that takes veRL's `reward_router_address` gets the address of an OpenAI-compatible
  HTTP router in front of the same replicas (genrm_router.py; started only then, shut down with
  the loop); a timeout there fails the batch naming `reward_model.rollout.request_timeout_s`.
Not here: veRL's standalone mode (`enable_resource_pool`), sleep/wake of the served model.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from hybridrl.config.roles import ModelConfig, RewardModelConfig
from hybridrl.models.hf import load_tokenizer
from hybridrl.protocol import DataProto
from hybridrl.reward.genrm import TIMEOUT_KEY, GenRMClient, GenRMServer, attach_client, wants_router
from hybridrl.reward.rm import place_on_last_token, rm_inputs, token_lists
from hybridrl.reward.rm_server import RewardModelServer
from hybridrl.utils import plugins
from hybridrl.utils.batch_ops import row_parts


def policy_tokenizer_source(config: RewardModelConfig, policy_tokenizer_path: str | None) -> str | None:
    """The tokenizer responses are decoded with before re-templating, or None when it is the RM's own
    (then the batch's token ids are scored directly): the legacy RewardModelWorker's rule."""
    src = config.model.input_tokenizer or policy_tokenizer_path
    if src and os.path.abspath(str(src)) != os.path.abspath(str(config.model.path)):
        return str(src)
    return None


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [lo, hi) ranges covering range(n), sizes differing by at most one (some may be empty)."""
    return row_parts(n, parts, keep_empty=True)


SCORE_TIMEOUT_KEY = "reward_model.rollout.request_timeout_s"


def _call(server: Any, seqs: list[list[int]], timeout_s: float) -> list[float]:
    """The served reward model's scores of `seqs`, waited on for at most `timeout_s`
    (`reward_model.rollout.request_timeout_s`): past it the call fails naming that key.

    Raises:
        WorkerHungError: a replica (a Ray actor) did not answer in time.
        DeadlineError: the in-process replica did not answer in time.
    """
    from hybridrl.utils.deadlines import call_with_deadline

    if not hasattr(getattr(server, "score", None), "remote"):  # the replica object itself
        return call_with_deadline(
            server.score, seqs, timeout_s=timeout_s, key=SCORE_TIMEOUT_KEY, what="reward model server score"
        )
    from hybridrl.single_controller.ray.base import gather_refs

    return gather_refs(
        [server.score.remote(seqs)],
        group="reward_model_server",
        method="score",
        ranks=[0],
        timeout_s=timeout_s,
        timeout_key=SCORE_TIMEOUT_KEY,
    )[0]


def _wait_workers(refs: list[Any]) -> list[Any]:
    """The reward loop workers' results; a worker with no result for the deadline fails naming it."""
    from hybridrl.single_controller.ray.base import gather_refs
    from hybridrl.utils import deadlines

    limit, key = deadlines.reward_timeout(), deadlines.REWARD_KEY
    if limit <= 0:
        limit, key = deadlines.step_timeout(), deadlines.STEP_KEY
    return gather_refs(
        refs,
        group="reward_loop",
        method="compute_scores",
        ranks=list(range(len(refs))),
        timeout_s=limit,
        timeout_key=key,
    )


_ACTOR_IDS = itertools.count()


class RewardLoopWorker:
    """Scores one chunk of a batch (the body of a Ray actor).

    Args:
        config: `reward_model`.
        policy_tokenizer_path: the policy's tokenizer (`actor_rollout_ref.model.path`).
        reward_fn: the rule-based reward manager (used when the reward model is off).
        server: a RewardModelServer replica (an actor handle, or the object itself); None without RM.
        num_threads: torch threads of this process.
    """

    def __init__(
        self,
        config: RewardModelConfig,
        policy_tokenizer_path: str | None,
        reward_fn: Any,
        server: Any = None,
        num_threads: int | None = None,
    ) -> None:
        plugins.import_worker_libs()  # the driver's model.external_lib modules (named error if one fails)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config, self.reward_fn, self.server = config, reward_fn, server
        self.policy_tok = self.rm_tok = None
        if config.enable and server is not None:
            m = config.model
            self.rm_tok = load_tokenizer(
                ModelConfig(path=m.path, trust_remote_code=m.trust_remote_code), key="reward_model.model"
            )
            src = policy_tokenizer_source(config, policy_tokenizer_path)
            if src:
                self.policy_tok = load_tokenizer(
                    ModelConfig(path=src), key="reward_model.model.input_tokenizer"
                )

    def compute_scores(self, data: DataProto) -> dict[str, Any]:
        """{"reward_tensor": (b, T) float32, "reward_extra_info": dict of lists} for this chunk."""
        if len(data) == 0:
            return {"reward_tensor": torch.zeros(data.batch["responses"].shape), "reward_extra_info": {}}
        if self.server is None:
            return self.reward_fn(data, return_dict=True)
        seqs = token_lists(rm_inputs(data, self.policy_tok, self.rm_tok, self.config.max_length))
        scores = torch.tensor(
            _call(self.server, seqs, self.config.rollout.request_timeout_s), dtype=torch.float32
        )
        return {
            "reward_tensor": place_on_last_token(scores, data.batch["response_mask"]),
            "reward_extra_info": {},
        }


def merge_extras(parts: list[dict[str, list]], sizes: list[int]) -> dict[str, list]:
    """Per-chunk extras (lists aligned with each chunk) -> lists aligned with the whole batch (None where a
    chunk lacks a key)."""
    keys: dict[str, None] = {}
    for p in parts:
        keys.update(dict.fromkeys(p))
    return {k: [v for p, n in zip(parts, sizes) for v in p.get(k, [None] * n)] for k in keys}


def genrm_metrics(extras: dict[str, list]) -> dict[str, float]:
    """Metrics of a GenRM-scored batch from the score function's per-row extras:
    reward/genrm_parse_failures (rows whose `genrm_parse_failure` is true) and
    reward/genrm_<name>/mean for every other numeric `genrm_<name>` extra (None rows skipped)."""
    out = {"reward/genrm_parse_failures": float(sum(bool(v) for v in extras.get("genrm_parse_failure", [])))}
    for key, values in extras.items():
        if not key.startswith("genrm_") or key == "genrm_parse_failure":
            continue
        nums = [float(v) for v in values if isinstance(v, (bool, int, float)) and v is not None]
        if nums:
            out[f"reward/{key}/mean"] = sum(nums) / len(nums)
    return out


class RewardLoopManager:
    """The driver's side of the reward loop: starts the RM replicas and the workers, scores batches.

    Args:
        config: `reward_model` (use_reward_loop, num_workers, rollout.*, enable, model.*).
        policy_tokenizer_path: `actor_rollout_ref.model.path`.
        reward_fn: the run's reward manager (scored by the workers when the RM is off or is a GenRM).
        slots: trainer.nnodes * trainer.n_gpus_per_node (colocate mode: the RM replicas share them).
        use_ray: Ray actors (True), or the workers and the replica as objects in this process.
        num_threads: torch threads of each worker / replica process.
        genrm: the reward model is a generative judge (enable + custom_reward_function.path).
        val_reward_fn: the validation reward manager (given the GenRM client too).
    """

    def __init__(
        self,
        config: RewardModelConfig,
        policy_tokenizer_path: str | None,
        reward_fn: Any,
        *,
        slots: int = 1,
        use_ray: bool = True,
        num_threads: int | None = None,
        genrm: bool = False,
        val_reward_fn: Any = None,
    ) -> None:
        if config.num_workers < 1:
            raise ValueError(f"reward_model.num_workers must be >= 1, got {config.num_workers}")
        self.use_ray, self.genrm, self._metrics = use_ray, genrm and config.enable, {}
        self.router: Any = (
            None  # the GenRM's HTTP router (genrm_router.py), when a function takes its address
        )
        self.timeout_s = config.rollout.request_timeout_s
        self.servers = self._start_servers(config, slots, num_threads) if config.enable else []
        if self.genrm:
            m = config.model
            tok = load_tokenizer(
                ModelConfig(path=m.path, trust_remote_code=m.trust_remote_code), "reward_model.model"
            )
            self.client = GenRMClient(self.servers, config.rollout, tok)
            if wants_router(reward_fn) or wants_router(val_reward_fn):  # veRL's reward_router_address
                from hybridrl.reward.genrm_router import RouterHandle

                self.router = RouterHandle(self.servers, config.rollout, m.path, m.trust_remote_code, use_ray)
            for fn in (reward_fn, val_reward_fn):
                attach_client(fn, self.client, tok, self.router.address if self.router else None)
        self.workers = []
        for i in range(config.num_workers):
            server = self.servers[i % len(self.servers)] if self.servers and not self.genrm else None
            args = (config, policy_tokenizer_path, reward_fn, server, num_threads)
            self.workers.append(self._actor(RewardLoopWorker, f"reward_loop_worker_{i}", args))

    def _actor(self, cls: type, name: str, args: tuple) -> Any:
        if not self.use_ray:
            return cls(*args)
        import ray

        # Colocate mode: these processes share the training slots' resources (num_cpus=0).
        unique = f"hybridrl_{name}_{os.getpid()}_{next(_ACTOR_IDS)}"
        from hybridrl.utils import deadlines  # the driver's trainer.*_timeout_s in these processes too

        env = {"env_vars": {**deadlines.worker_env(), **plugins.worker_env()}}
        return ray.remote(cls).options(num_cpus=0, name=unique, runtime_env=env).remote(*args)

    def _start_servers(self, config: RewardModelConfig, slots: int, num_threads: int | None) -> list[Any]:
        tp = config.rollout.tensor_model_parallel_size
        if tp < 1 or slots % tp:
            raise ValueError(
                f"reward_model.rollout.tensor_model_parallel_size={tp} must divide the {slots} slots "
                "(trainer.nnodes * trainer.n_gpus_per_node)"
            )
        m = config.model
        if self.genrm:
            cls, name, args = (
                GenRMServer,
                "genrm_server",
                (m.path, config.rollout, m.trust_remote_code, num_threads),
            )
        else:
            cls, name = RewardModelServer, "reward_model_server"
            args = (m.path, config.rollout, m.trust_remote_code, config.micro_batch_size_per_gpu, num_threads)
        servers = [self._actor(cls, f"{name}_{i}", args) for i in range(slots // tp)]
        if self.use_ray:  # surface a start-up error here, not at the first batch
            import ray

            from hybridrl.single_controller.ray.base import gather_refs

            try:  # a replica that never finishes loading fails after trainer.step_timeout_s
                gather_refs(
                    [(s.generate.remote([], {}) if self.genrm else s.score.remote([])) for s in servers],
                    group=name,
                    method="start",
                    ranks=list(range(len(servers))),
                )
            except Exception:
                for server in servers:
                    ray.kill(server)
                raise
        return servers

    def compute_rm_score(self, batch: DataProto) -> tuple[DataProto, dict[str, list]]:
        """rm_scores (B, T) of `batch` (and the reward manager's extras, lists of len B)."""
        bounds = [b for b in chunk_bounds(len(batch), len(self.workers)) if b[1] > b[0]]
        chunks = [batch.slice(lo, hi) for lo, hi in bounds]
        workers = self.workers[: len(chunks)]
        try:
            if self.use_ray:
                outs = _wait_workers([w.compute_scores.remote(c) for w, c in zip(workers, chunks)])
            else:
                outs = [w.compute_scores(c) for w, c in zip(workers, chunks)]
        except Exception as e:
            self._check_router(e)
            raise
        self._check_router(None)
        if not outs:
            return DataProto.from_dict({"rm_scores": torch.zeros(batch.batch["responses"].shape)}), {}
        scores = torch.cat([o["reward_tensor"].float() for o in outs])
        extras = merge_extras([o.get("reward_extra_info", {}) for o in outs], [len(c) for c in chunks])
        if self.genrm:
            for k, v in genrm_metrics(extras).items():
                self._metrics[k] = self._metrics.get(k, 0.0) + v if k.endswith("failures") else v
        return DataProto.from_dict({"rm_scores": scores}), extras

    def _check_router(self, cause: Exception | None) -> None:
        """TimeoutError naming reward_model.rollout.request_timeout_s when the router timed out requests
        of this batch (whether or not the reward function passed the 504 on)."""
        n = self.router.pop_timeouts() if self.router is not None else 0
        if n:
            raise TimeoutError(
                f"the generative reward model did not answer {n} request(s) to the GenRM router within "
                f"{TIMEOUT_KEY}={self.timeout_s:g} s; raise {TIMEOUT_KEY}, ask for fewer tokens, or check that "
                "the judge's engine is alive"
            ) from cause

    def pop_metrics(self) -> dict[str, float]:
        """The GenRM metrics of the batches scored since the last call (parse failures summed)."""
        out, self._metrics = self._metrics, {}
        return out

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.shutdown()
            self.router = None
        if not self.use_ray:
            return
        import ray

        for actor in self.workers + self.servers:
            ray.kill(actor)
        self.workers, self.servers = [], []
