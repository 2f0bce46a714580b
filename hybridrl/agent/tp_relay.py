"""The agent loops over a tensor-parallel engine: the TP leader drives, the other TP ranks replay.

The ranks of one TP engine (``rollout.tensor_model_parallel_size`` > 1) must call it collectively
with identical inputs, but the agent loops form their engine batches by timing (BatchingEngine:
whatever requests are pending when the queue drains), so two ranks running their own loops would
batch differently and the engine would hang or mix rows. Instead:

* the group's TP rank 0 (the rollout mesh's collecting rank, whose result the driver keeps) runs
  the agent loops, the tools and the interactions alone, on a :class:`TPLeaderRollout`: every
  engine call it makes (the whole GenerationRequest: prompt ids, sampling, per-request seeds,
  token budget) is first broadcast over a gloo group of the TP ranks, then run;
* the other TP ranks run :func:`follow_leader`: receive each request, run the same engine call
  (their part of the collective), discard the result, until the leader broadcasts the end.

The leader ends every rollout with ("done", None), or ("done", "<error>") when its agent loops
failed, so the followers fail with it instead of waiting for the next request until the timeout.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TPLeaderRollout", "follow_leader", "lead_rollout"]

GENERATE = "generate"
DONE = "done"


def _broadcast(message: Any, group: Any, src: int) -> Any:
    """One object from global rank `src` to every rank of `group` (gloo); returns it."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class TPLeaderRollout:
    """The leader's view of its TP engine: `generate_tokens` first hands the request to the
    followers; every other attribute (pad_token_id, eos_token_ids, dp_rank, ...) is the rollout's.

    Args:
        rollout: this rank's BaseRollout (one TP rank of the engine).
        group: a gloo process group over the engine's TP ranks.
        src: the leader's global rank (this rank).
    """

    def __init__(self, rollout: Any, group: Any, src: int) -> None:
        self.rollout = rollout
        self.group = group
        self.src = src
        self.num_relayed = 0

    def __getattr__(self, name: str) -> Any:
        if name in ("rollout", "group", "src", "num_relayed"):
            raise AttributeError(name)
        return getattr(self.rollout, name)

    def generate_tokens(self, request: Any) -> Any:
        """Broadcast `request` (a GenerationRequest), then run it on this rank's engine."""
        _broadcast((GENERATE, request), self.group, self.src)
        self.num_relayed += 1
        return self.rollout.generate_tokens(request)

    def finish(self, error: str | None = None) -> None:
        """End the followers' loop (with the leader's error, if any)."""
        _broadcast((DONE, error), self.group, self.src)


def follow_leader(rollout: Any, group: Any, src: int) -> int:
    """Replay the leader's engine calls on this TP rank until it says done.

    Returns:
        the number of engine calls replayed.

    Raises:
        RuntimeError: the leader's agent loops failed (its error is in the message).
    """
    replayed = 0
    while True:
        kind, payload = _broadcast(None, group, src)
        if kind == DONE:
            if payload is not None:
                raise RuntimeError(
                    f"the agent loops on this TP engine's leader (rank {src}) failed: {payload}"
                )
            return replayed
        if kind != GENERATE:
            raise RuntimeError(f"TP relay: unexpected message {kind!r} from rank {src}")
        rollout.generate_tokens(payload)  # this rank's part of the collective call; result unused
        replayed += 1


def lead_rollout(runner: Any, relay: TPLeaderRollout, prompts: Any) -> Any:
    """Run `runner.generate_sequences(prompts)` (an AgentLoopRunner on `relay`), then end the
    followers' loop once the engine thread is idle (an aborted trajectory's batch may still run)."""
    try:
        out = runner.generate_sequences(prompts)
    except BaseException as e:
        runner.engine.wait_idle()
        relay.finish(f"{type(e).__name__}: {e}")
        raise
    runner.engine.wait_idle()
    relay.finish()
    out.meta_info.setdefault("metrics", {})["agent/tp_relayed_engine_calls"] = float(relay.num_relayed)
    relay.num_relayed = 0
    return out
