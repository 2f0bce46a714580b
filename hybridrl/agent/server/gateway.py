"""The rollout server's front door: one HTTP server (aiohttp) in a Ray actor, in front of every replica.

HTTP API (OpenAI's paths under `/v1`, hybridrl's task paths under `/v1/hybridrl`):

    POST /v1/hybridrl/tasks               {"wait_s": 10}  -> 200 a task, or 204 none within wait_s
    POST /v1/chat/completions             OpenAI chat (wire.py); the trajectory is named by the
    POST /v1/completions                  header `X-Trajectory-Id` or the body's `user` field
    POST /v1/hybridrl/trajectories/{id}/finish   {"reward": 1.0 | null}  -> 200
    GET  /v1/models, GET /health

A task is one trajectory of the trainer's batch: `{"trajectory_id", "messages", "extra_info",
"validate"}`. Its rollout replica (the worker whose batch holds the row) answers every request of the
trajectory (sticky sessions); tasks are handed out from the replica with the fewest trajectories in
progress (the load balancer). At most `agent_server.max_in_flight` generation requests are served at
once; one more gets 429 with `Retry-After` (back-pressure). A request for a trajectory that is not
open gets 404; a second request while one of the same trajectory is running gets 409.

The replica side (external_loop.py) talks to this actor through Ray calls: `add_task`, then
`next_event` (the next request of the trajectory, or its finish) and `reply`, then `drop`. Without
Ray (`trainer.backend` running the worker in the driver) the same object runs in a thread with its
own event loop, called the same way.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
import types
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridrl.agent.server.wire import error_body
from hybridrl.utils import deadlines

__all__ = ["GATEWAY_NAME", "RolloutGateway", "get_gateway", "shutdown_gateway"]

GATEWAY_NAME = "hybridrl_agent_server"
_GEN_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclass
class _Trajectory:
    replica: int
    payload: dict[str, Any]
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    claimed: bool = False
    busy: bool = False
    finished: bool = False  # its finish was answered: not open any more, even before the replica drops it


class RolloutGateway:
    """The HTTP server and the routing state (runs as an async Ray actor; see get_gateway).

    Args:
        host, port: where to listen (port 0: a free port).
        max_in_flight: generation requests served at once (429 beyond).
        request_timeout_s: seconds to wait for a replica's answer (504 then).
        model_name: the model id /v1/models reports (requests may name any model: one policy).
    """

    def __init__(self, host: str, port: int, max_in_flight: int, request_timeout_s: float, model_name: str):
        self.host, self.port = host, port
        self.max_in_flight, self.request_timeout_s, self.model_name = (
            max_in_flight,
            request_timeout_s,
            model_name,
        )
        self.trajs: dict[str, _Trajectory] = {}
        self.pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.waiting: dict[str, asyncio.Future] = {}
        self.in_flight = 0
        self.counts = collections.Counter()
        self._new_task: asyncio.Condition | None = None
        self._runner = None
        self.url: str | None = None

    # ---------------------------------------------------------------- life cycle
    async def start(self) -> str:
        """Start listening (idempotent); returns the base URL `http://host:port/v1`."""
        if self.url is not None:
            return self.url
        from aiohttp import web

        self._new_task = asyncio.Condition()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/hybridrl/tasks", self._claim)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/hybridrl/trajectories/{tid}/finish", self._finish)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}/v1"
        return self.url

    async def stop(self) -> None:
        """Stop listening (open requests are cut)."""
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self.url = None

    async def stats(self) -> dict[str, Any]:
        """Counters (requests served, refused with 429, ...) and the current load."""
        return {
            **self.counts,
            "open_trajectories": len(self.trajs),
            "pending_tasks": sum(len(q) for q in self.pending.values()),
            "in_flight": self.in_flight,
        }

    # ---------------------------------------------------------------- replica side (Ray calls)
    async def add_task(self, tid: str, replica: int, payload: dict[str, Any]) -> None:
        self.trajs[tid] = _Trajectory(replica, {"trajectory_id": tid, **payload})
        self.pending[replica].append(tid)
        async with self._new_task:
            self._new_task.notify_all()

    async def next_event(self, tid: str, timeout_s: float) -> dict[str, Any]:
        """The trajectory's next request or finish; {"kind": "timeout", "claimed": ...} after timeout_s."""
        traj = self.trajs[tid]
        try:
            return await asyncio.wait_for(traj.inbox.get(), timeout_s)
        except asyncio.TimeoutError:
            return {"kind": "timeout", "claimed": traj.claimed}

    async def reply(self, req_id: str, status: int, body: dict[str, Any]) -> None:
        fut = self.waiting.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_result((status, body))

    async def drop(self, tid: str) -> None:
        """The trajectory ended on the replica: later requests for it get 404."""
        traj = self.trajs.pop(tid, None)
        if traj is None:
            return
        with_task = self.pending.get(traj.replica)
        if with_task and tid in with_task:
            with_task.remove(tid)
        while not traj.inbox.empty():  # requests that arrived after the end
            ev = traj.inbox.get_nowait()
            await self.reply(ev["req_id"], 409, error_body(409, f"trajectory {tid} has already ended"))

    # ---------------------------------------------------------------- HTTP
    @staticmethod
    def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        from aiohttp import web

        return web.json_response(body, status=status, headers=headers)

    def _pick_replica(self) -> int | None:
        """The replica with pending tasks and the fewest claimed trajectories in progress."""
        load = collections.Counter(t.replica for t in self.trajs.values() if t.claimed)
        ready = [r for r, q in self.pending.items() if q]
        return min(ready, key=lambda r: (load[r], r)) if ready else None

    async def _claim(self, request):
        body = await _read_json(request, default={})
        wait_s = body.get("wait_s", 10.0) if isinstance(body, dict) else None
        if not isinstance(wait_s, int | float) or not 0 <= wait_s <= 300:
            return self._json(400, error_body(400, "wait_s must be seconds in [0, 300]", "wait_s"))
        async with self._new_task:
            try:
                await asyncio.wait_for(
                    self._new_task.wait_for(lambda: self._pick_replica() is not None), wait_s
                )
            except asyncio.TimeoutError:
                from aiohttp import web

                return web.Response(status=204)
            tid = self.pending[self._pick_replica()].popleft()
        traj = self.trajs[tid]
        traj.claimed = True
        self.counts["tasks_claimed"] += 1
        return self._json(200, traj.payload)

    async def _generate(self, request):
        kind = _GEN_PATHS[request.path]
        body = await _read_json(request)
        if body is None:
            return self._json(400, error_body(400, "the request body is not valid JSON"))
        tid = request.headers.get("X-Trajectory-Id") or (body.get("user") if isinstance(body, dict) else None)
        if not tid:
            return self._json(400, error_body(400, "name the trajectory: header X-Trajectory-Id or the field "
                                             "`user` (ids come from POST /v1/hybridrl/tasks)", "user"))  # fmt: skip
        if isinstance(body, dict):
            body.pop("user", None)
        if self.in_flight >= self.max_in_flight:
            self.counts["refused_429"] += 1
            msg = f"the server is full ({self.max_in_flight} requests in flight, agent_server.max_in_flight); retry"
            return self._json(429, error_body(429, msg), {"Retry-After": "1"})
        return await self._forward(tid, kind, body)

    async def _finish(self, request):
        body = await _read_json(request, default={})
        if not isinstance(body, dict):
            return self._json(400, error_body(400, 'the body must be a JSON object, e.g. {"reward": 1.0}'))
        return await self._forward(request.match_info["tid"], "finish", body)

    async def _forward(self, tid: str, kind: str, body: Any):
        traj = self.trajs.get(tid)
        if traj is None or traj.finished:
            self.counts["refused_404"] += 1
            return self._json(404, error_body(404, f"trajectory {tid!r} is not open (finished, timed out, or "
                                             "never handed out by POST /v1/hybridrl/tasks)", "user"))  # fmt: skip
        if traj.busy:
            return self._json(409, error_body(409, f"trajectory {tid!r} already has a request running; "
                                             "a trajectory's requests are sequential"))  # fmt: skip
        if not traj.claimed and tid in self.pending[traj.replica]:  # used without being handed out
            self.pending[traj.replica].remove(tid)
        req_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.waiting[req_id] = fut
        traj.claimed = traj.busy = True
        self.in_flight += kind != "finish"
        try:
            await traj.inbox.put({"kind": kind, "req_id": req_id, "body": body})
            status, out = await asyncio.wait_for(fut, self.request_timeout_s)
        except asyncio.TimeoutError:
            self.waiting.pop(req_id, None)
            status, out = 504, error_body(504, f"no answer from the rollout replica within {self.request_timeout_s:g}s "
                                          "(agent_server.request_timeout_s)")  # fmt: skip
        finally:
            traj.busy = False
            self.in_flight -= kind != "finish"
        traj.finished = traj.finished or (kind == "finish" and status == 200)
        self.counts[f"{kind}_{status}"] += 1
        return self._json(status, out)

    async def _models(self, request):
        return self._json(200, {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                            "owned_by": "hybridrl"}]})  # fmt: skip

    async def _health(self, request):
        return self._json(200, {"status": "ok", **(await self.stats())})


async def _read_json(request, default: Any = None) -> Any:
    if not request.can_read_body:
        return default
    try:
        return await request.json()
    except Exception:
        return None


class _InThread:
    """`handle.method.remote(*args)` of a RolloutGateway that runs in a thread of this process (no Ray:
    trainer.backend runs the worker in the driver); returns an awaitable, like a Ray ObjectRef."""

    def __init__(self, gateway: RolloutGateway) -> None:
        self._gateway = gateway
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="hybridrl-agent-server", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._gateway, name)
        submit = functools.partial(asyncio.run_coroutine_threadsafe, loop=self._loop)
        return types.SimpleNamespace(
            remote=lambda *a: asyncio.wrap_future(submit(method(*a))),
            # binding a local socket: bounded anyway (trainer.step_timeout_s) like every start-up wait
            sync=lambda *a: submit(method(*a)).result(timeout=deadlines.step_timeout()),
        )


_IN_PROCESS: dict[str, _InThread] = {}


def get_gateway(cfg: Any, model_name: str) -> tuple[Any, str]:
    """The run's gateway (created by the first caller) and its base URL: a Ray actor on this node when
    Ray is running, else a thread of this process.

    Args:
        cfg: AgentServerConfig (`actor_rollout_ref.rollout.agent_server`).
        model_name: what /v1/models reports.
    """
    import ray

    args = (cfg.host, int(cfg.port), int(cfg.max_in_flight), float(cfg.request_timeout_s), model_name)
    if not ray.is_initialized():
        if GATEWAY_NAME not in _IN_PROCESS:
            _IN_PROCESS[GATEWAY_NAME] = _InThread(RolloutGateway(*args))
        handle = _IN_PROCESS[GATEWAY_NAME]
        return handle, handle.start.sync()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(RolloutGateway).options(
        name=GATEWAY_NAME, get_if_exists=True, num_cpus=0, max_concurrency=10000, scheduling_strategy=here
    )
    handle = actor.remote(*args)
    return handle, deadlines.get_refs(
        handle.start.remote(), what="the agent-server gateway's start", timeout_s=deadlines.step_timeout()
    )


def shutdown_gateway() -> None:
    """Stop this run's gateway (the in-process one, or the Ray actor), if there is one."""
    import ray

    local = _IN_PROCESS.pop(GATEWAY_NAME, None)
    if local is not None:
        local.stop.sync()
        local._loop.call_soon_threadsafe(local._loop.stop)
    if ray.is_initialized():
        try:
            ray.kill(ray.get_actor(GATEWAY_NAME))
        except ValueError:  # no such actor
            pass
