"""veRL's GenRM router: an OpenAI-compatible HTTP server (aiohttp) in front of the judge's replicas.

veRL's reward loop calls a custom reward function with `reward_router_address` ("host:port" of a
router in front of the judge's vLLM/SGLang servers) and `reward_model_tokenizer`; the function POSTs
to `http://{reward_router_address}/v1/chat/completions` (or `/v1/completions`) and parses the answer
(veRL's tests/experimental/reward_loop/reward_fn.py). This is that router, in front of the
`GenRMServer` replicas (genrm.py) that also serve `reward_model_client`, so both kinds of functions
see the same judge:

    POST /v1/chat/completions   {"model", "messages", "max_tokens" | "max_completion_tokens",
                                 "temperature", "top_p", "top_k", "n": 1, "stream": false,
                                 "chat_template_kwargs", "user"}
    POST /v1/completions        {"model", "prompt": text | token ids, "max_tokens", "temperature",
                                 "top_p", "top_k", "n": 1, "stream": false, "user"}
    GET  /v1/models, GET /health

A chat request is rendered with the judge's chat template (generation prompt added), exactly as
`reward_model_client.chat` renders it. Sampling a request leaves out comes from
`reward_model.rollout.*`; a request's `temperature` > 0 samples, 0 is greedy. Each request goes to
the replica with the fewest prompts queued or running (ties: the one that has served fewest: round
robin when they are idle); a replica's waiting prompts with the same sampling go as one `generate`
call (HF: one left-padded batch, as the client's calls), so the concurrent requests of an async
function are batched. A replica that does not answer within `reward_model.rollout.request_timeout_s`
gets the request cancelled and the caller a 504 whose message (and HTTP reason) names that key; the
router counts it, and the reward loop then fails the step with a TimeoutError naming the key even if
the function swallowed the error (`pop_timeouts`). Other fields are refused with 400 naming them.
`usage.completion_tokens` is the answer's text re-tokenized. The server runs in an async Ray actor
(no CPU reserved) on the driver's node, or in a thread of this process without Ray; `shutdown` closes
the port and ends the actor.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from typing import Any

from hybridrl.reward.genrm import TIMEOUT_KEY, default_sampling
from hybridrl.utils import openai_wire
from hybridrl.utils.openai_wire import error_body

CHAT_FIELDS = openai_wire.CHAT_FIELDS | {"top_k", "chat_template_kwargs"}
COMPLETION_FIELDS = openai_wire.COMPLETION_FIELDS | {"top_k"}
_IDS = itertools.count()
MAX_BATCH = 256  # prompts of one generate call on a replica


class BadRequest(Exception):
    """A request refused with 400 (message names the field)."""


def request_sampling(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """GenRMServer sampling of a request: the body's values over `reward_model.rollout`'s defaults.

    Raises:
        BadRequest: n != 1, stream, logprobs, or a value of the wrong type.
    """
    if body.get("n", 1) not in (1, None):
        raise BadRequest("n must be 1 (one answer per request)")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the GenRM router; use stream=false")
    if body.get("logprobs"):
        raise BadRequest("logprobs are not returned by the GenRM router; leave logprobs out")
    s = dict(defaults)
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadRequest(f"{key} must be a positive integer, got {v!r}")
            s["max_tokens"] = v
            break
    for key, lo in (("temperature", 0.0), ("top_p", 0.0), ("top_k", -1)):
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, int | float) or isinstance(v, bool) or v < lo:
            raise BadRequest(f"{key} must be a number >= {lo}, got {v!r}")
        s[key] = v
    if body.get("temperature") is not None:  # as an OpenAI server: temperature 0 is greedy, > 0 samples
        s["do_sample"] = float(body["temperature"]) > 0
    s["top_k"] = int(s["top_k"])
    return s


def _check_fields(body: Any, allowed: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    extra = openai_wire.unsupported_fields(body, allowed)
    if extra:
        raise BadRequest(f"unsupported field(s) {extra}; the GenRM router accepts {sorted(allowed)}")
    return body


class GenRMRouter:
    """The HTTP server and its load balance over the judge replicas (the body of an async Ray actor).

    Args:
        servers: GenRMServer replicas (Ray actor handles, or the objects themselves without Ray).
        rollout: `reward_model.rollout` (sampling defaults, request_timeout_s).
        tokenizer_path: the judge's tokenizer folder (`reward_model.model.path`).
        trust_remote_code: `reward_model.model.trust_remote_code`.
        host: where to listen (None: this node's IP under Ray, else 127.0.0.1); port 0: a free port.
    """

    def __init__(
        self, servers: list[Any], rollout: Any, tokenizer_path: str, trust_remote_code: bool = False,
        host: str | None = None, port: int = 0,
    ) -> None:  # fmt: skip
        from hybridrl.config.roles import ModelConfig
        from hybridrl.models.hf import load_tokenizer

        self.servers, self.host, self.port = list(servers), host, int(port)
        self.defaults, self.timeout = default_sampling(rollout), float(rollout.request_timeout_s)
        self.tok = load_tokenizer(
            ModelConfig(path=tokenizer_path, trust_remote_code=trust_remote_code), key="reward_model.model"
        )
        self.model_name = os.path.basename(str(tokenizer_path).rstrip("/")) or "genrm"
        self.in_flight = [0] * len(self.servers)
        self.served = [0] * len(self.servers)
        self.calls = [0] * len(self.servers)  # generate calls (batches) per replica
        self.timeouts = 0
        self._queues: list[list] = []
        self._wake: list[asyncio.Event] = []
        self._tasks: list[asyncio.Task] = []
        self._runner = None
        self.address: str | None = None

    async def start(self) -> str:
        """Listen (idempotent); returns the address "host:port" (veRL's reward_router_address)."""
        if self.address is not None:
            return self.address
        from aiohttp import web

        self._queues = [[] for _ in self.servers]
        self._wake = [asyncio.Event() for _ in self.servers]
        self._tasks = [asyncio.ensure_future(self._dispatch(i)) for i in range(len(self.servers))]
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host = self.host or _node_ip()
        site = web.TCPSite(self._runner, host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        """Close the port (open requests are cut)."""
        if self._runner is not None:
            await self._runner.cleanup()
        for task in self._tasks:
            task.cancel()
        self._runner, self.address, self._tasks = None, None, []

    async def stats(self) -> dict[str, Any]:
        """Requests served, generate calls (batches) and prompts in flight per replica; timeouts so far."""
        return {
            "served": list(self.served),
            "calls": list(self.calls),
            "in_flight": list(self.in_flight),
            "timeouts": self.timeouts,
        }

    async def pop_timeouts(self) -> int:
        """Requests that timed out since the last call."""
        n, self.timeouts = self.timeouts, 0
        return n

    # ---------------------------------------------------------------- replicas
    def _pick(self) -> int:
        """The replica with the fewest prompts queued or running; ties: the fewest served so far."""
        return min(range(len(self.servers)), key=lambda i: (self.in_flight[i], self.served[i], i))

    async def _ask(self, prompt: str | list[int], sampling: dict[str, Any]) -> str:
        """One prompt's answer from the least-loaded replica, within the timeout (asyncio.TimeoutError).
        The prompt waits in the replica's queue; its dispatcher batches what is waiting."""
        i = self._pick()
        self.in_flight[i] += 1
        self.served[i] += 1
        fut = asyncio.get_running_loop().create_future()
        self._queues[i].append((prompt, sampling, fut))
        self._wake[i].set()
        try:
            return await asyncio.wait_for(fut, self.timeout)
        finally:
            self.in_flight[i] -= 1

    async def _dispatch(self, i: int) -> None:
        """Replica i's loop: the waiting prompts with the first one's sampling (at most MAX_BATCH) go
        as one `generate` call (HF: one left-padded batch), then the next group."""
        queue = self._queues[i]
        while True:
            await self._wake[i].wait()
            self._wake[i].clear()
            while queue:
                s = queue[0][1]
                batch = [q for q in queue if q[1] == s][:MAX_BATCH]
                for q in batch:
                    queue.remove(q)
                batch = [q for q in batch if not q[2].done()]  # timed out while waiting
                if not batch:
                    continue
                await self._run_batch(i, batch, s)

    async def _run_batch(self, i: int, batch: list, sampling: dict[str, Any]) -> None:
        """Answer a batch's futures; a prompt the replica refuses (ValueError: too long for
        reward_model.rollout.*) fails alone: the batch is then retried one prompt at a time."""
        try:
            texts = await self._generate(i, [p for p, _, _ in batch], sampling)
        except ValueError as e:
            if len(batch) == 1:
                if not batch[0][2].done():
                    batch[0][2].set_exception(e)
                return
            for one in batch:
                if not one[2].done():
                    await self._run_batch(i, [one], sampling)
            return
        except Exception as e:  # a replica that raised or did not answer: every caller of the batch sees it
            for _, _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, _, f), text in zip(batch, texts):
            if not f.done():
                f.set_result(text)

    async def _generate(self, i: int, prompts: list, sampling: dict[str, Any]) -> list[str]:
        """One generate call on replica i, given up (and cancelled) after the timeout."""
        server = self.servers[i]
        self.calls[i] += 1
        if hasattr(getattr(server, "generate", None), "remote"):
            ref = server.generate.remote(prompts, sampling)
            try:
                return await asyncio.wait_for(_await_ref(ref), self.timeout)
            except asyncio.TimeoutError:
                import ray

                ray.cancel(ref)
                raise
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(
            loop.run_in_executor(None, server.generate, prompts, sampling), self.timeout
        )

    # ---------------------------------------------------------------- HTTP
    async def _chat(self, request):
        async def render(body: dict) -> tuple[str, dict]:
            _check_fields(body, CHAT_FIELDS)
            msgs = body.get("messages")
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(isinstance(m, dict) and "role" in m for m in msgs)
            ):
                raise BadRequest("messages must be a non-empty list of {role, content} objects")
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise BadRequest("chat_template_kwargs must be an object")
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
            return text, request_sampling(body, self.defaults)

        return await self._serve(request, render, chat=True)

    async def _completion(self, request):
        async def render(body: dict) -> tuple[Any, dict]:
            _check_fields(body, COMPLETION_FIELDS)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a list of one prompt
            ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
            if not (ids or (isinstance(prompt, str) and prompt)):
                raise BadRequest("prompt must be one non-empty string or one list of token ids")
            return prompt, request_sampling(body, self.defaults)

        return await self._serve(request, render, chat=False)

    async def _serve(self, request, render, chat: bool):
        from aiohttp import web

        try:
            body = await request.json()
        except Exception:
            return web.json_response(error_body(400, "the request body is not valid JSON"), status=400)
        try:
            prompt, sampling = await render(body)
            text = await self._ask(prompt, sampling)
        except BadRequest as e:
            return web.json_response(error_body(400, str(e)), status=400)
        except ValueError as e:  # the replica's own checks (prompt too long for reward_model.rollout.*)
            return web.json_response(error_body(400, str(e)), status=400)
        except asyncio.TimeoutError:
            self.timeouts += 1
            msg = (
                f"the generative reward model did not answer within {TIMEOUT_KEY}={self.timeout:g} s; raise "
                f"{TIMEOUT_KEY}, ask for fewer tokens, or check that the judge's engine is alive"
            )
            return web.json_response(error_body(504, msg), status=504, reason=f"Gateway Timeout ({msg})")
        except Exception as e:  # a replica that raised
            return web.json_response(error_body(500, f"{type(e).__name__}: {e}"), status=500)
        return web.json_response(self._response(body, prompt, text, sampling, chat))

    def _response(self, body: dict, prompt: Any, text: str, sampling: dict, chat: bool) -> dict[str, Any]:
        """OpenAI's chat.completion / text_completion object around one answer."""
        n_prompt = (
            len(prompt)
            if isinstance(prompt, list)
            else len(self.tok.encode(prompt, add_special_tokens=False))
        )
        n_new = len(self.tok.encode(text, add_special_tokens=False)) if text else 0
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        choice["finish_reason"] = "length" if n_new >= int(sampling["max_tokens"]) else "stop"
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": str(body.get("model") or self.model_name),
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_new,
                "total_tokens": n_prompt + n_new,
            },
        }

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", **(await self.stats())})


async def _await_ref(ref: Any) -> Any:
    return await ref


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:
        pass
    return "127.0.0.1"


class RouterHandle:
    """The running router: `address` ("host:port"), `pop_timeouts()`, `stats()`, `shutdown()`.

    Args:
        servers, rollout, tokenizer_path, trust_remote_code: as GenRMRouter.
        use_ray: an async Ray actor on this node (True), or a thread of this process.
    """

    def __init__(
        self, servers: list[Any], rollout: Any, tokenizer_path: str, trust_remote_code: bool, use_ray: bool
    ):
        args = (servers, rollout, tokenizer_path, trust_remote_code)
        self._actor = self._loop = None
        if use_ray:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.name = f"hybridrl_genrm_router_{os.getpid()}_{next(_IDS)}"
            self._actor = (
                ray.remote(GenRMRouter)
                .options(name=self.name, num_cpus=0, max_concurrency=10000, scheduling_strategy=here)
                .remote(*args)
            )
            try:
                self.address = ray.get(
                    self._actor.start.remote(), timeout=max(60.0, float(rollout.request_timeout_s))
                )
            except Exception:
                ray.kill(self._actor)
                raise
        else:
            self.name = "in-process"
            self._router = GenRMRouter(*args)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="hybridrl-genrm-router", daemon=True
            )
            self._thread.start()
            self.address = self._run(self._router.start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, method: str) -> Any:
        if self._actor is not None:
            import ray

            return ray.get(getattr(self._actor, method).remote())
        return self._run(getattr(self._router, method)())

    def pop_timeouts(self) -> int:
        return self._call("pop_timeouts")

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def shutdown(self) -> None:
        """Close the port and end the actor (or the thread's loop); idempotent."""
        if self._actor is not None:
            import ray

            try:
                ray.get(self._actor.stop.remote(), timeout=30)
            finally:
                ray.kill(self._actor)
                self._actor = None
        elif self._loop is not None:
            self._run(self._router.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None
