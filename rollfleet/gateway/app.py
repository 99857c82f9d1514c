"""``rollfleet gateway``: one HTTP endpoint over the fleet, for trainers and agent frameworks that
never import rollfleet. A stateless aiohttp server around one ``RolloutClient``: it parses with
``gateway.protocol``, submits, awaits or streams, and answers; it keeps nothing a restart could
lose (jobs, answers and idempotency keys live in the broker).

Routes: ``POST /generate`` (SGLang's shape, one input or a batch), ``POST /v1/completions``,
``POST /v1/chat/completions`` (with a chat template: ``--tokenizer DIR``) and ``GET /v1/models``
(OpenAI's), ``GET /health``, ``GET /metrics`` (Prometheus). With an API key, every route but
``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rollfleet.gateway import protocol
from rollfleet.gateway.chat import ChatTemplate
from rollfleet.gateway.protocol import GatewayRequest
from rollfleet.runtime.aio import KeyedLocks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import RolloutResult
from rollfleet.schemas.bounded import load_json
from rollfleet.schemas.errors import AuthorizationError, InvalidRequest, RollfleetError, UnknownSession
from rollfleet.schemas.progress import TokenChunk
from rollfleet.trainer_client import Session
from rollfleet.trainer_client.streaming import chunks_of

if TYPE_CHECKING:
    from rollfleet.trainer_client import RolloutClient, RolloutHandle

log = get_logger("rollfleet.gateway")

MAX_BODY_BYTES = 1024 * 1024  # a request body past this is refused (413) before it is read whole


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rollfleet_gateway_requests_total", "Requests by route and status", ("route", "status"),
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "rollfleet_gateway_request_seconds", "Request latency by route", ("route",), registry=self.registry
        )
        self.in_flight = Gauge("rollfleet_gateway_in_flight", "Requests being served", registry=self.registry)


class Gateway:
    def __init__(
        self,
        client: RolloutClient,
        *,
        model_name: str = "rollfleet",
        api_key: str | None = None,
        default_max_staleness: int | None = None,
        timeout_s: float = 600.0,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.client = client
        self.chat_template = chat_template
        self.model_name = model_name
        self.api_key = api_key
        self.default_max_staleness = default_max_staleness
        self.timeout_s = timeout_s
        self.metrics = GatewayMetrics()
        self._cancels: dict[str, asyncio.Task[Any]] = {}  # job id -> its cancel, while under way
        self._opening = KeyedLocks()  # one open of a session at a time

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._measured])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    # -- plumbing ----------------------------------------------------------------------------
    @web.middleware
    async def _measured(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        status = 500
        try:
            if self.api_key is not None and request.path != "/health":
                self._authorize(request)
            response = await handler(request)
            status = response.status
            return response
        except RollfleetError as exc:
            reply = protocol.error_reply(exc)
            status = reply.status
            log.info("request refused", route=route, status=status, code=exc.code, error=exc.message)
            return web.json_response(reply.body, status=reply.status, headers=reply.headers)
        except web.HTTPException as exc:
            status = exc.status
            if exc.status == 413:  # (aiohttp's own refusal of an oversized body)
                err = InvalidRequest(f"the request body is larger than {MAX_BODY_BYTES} bytes")
                return web.json_response(protocol.error_reply(err).body, status=413)
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - t0)

    def _authorize(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "")
        want = f"Bearer {self.api_key}"
        if not hmac.compare_digest(given.encode(), want.encode()):
            raise AuthorizationError("a valid 'Authorization: Bearer <key>' header is required")

    async def _body(self, request: web.Request) -> Any:
        return load_json(await request.read(), what="the request body", max_bytes=MAX_BODY_BYTES)

    async def _submit(self, req: GatewayRequest) -> RolloutHandle:
        handle = await self.client.submit(
            req.payload, idempotency_key=req.idempotency_key, timeout=self.timeout_s, **req.constraint.as_kwargs()
        )
        log.info("submitted", route=req.route, idempotency_key=handle.idempotency_key, job_id=handle.job_id)
        return handle

    async def _await(self, req: GatewayRequest, handle: RolloutHandle) -> RolloutResult:
        try:
            return await handle.result()  # (shielded: the caller's cancel leaves the handle waiting)
        except asyncio.CancelledError:
            self._abandoned(req, handle)
            raise

    def _abandoned(self, req: GatewayRequest, handle: RolloutHandle) -> None:
        """The client went away. A request without an idempotency key can never be asked for
        again: its job is cancelled in the fleet (its replica's slot freed). One with a key runs
        on, so that a retry gets its one answer."""
        if req.idempotency_key is not None or handle.done() or handle.job_id in self._cancels:
            return  # (a batch's input abandoned twice, by its own wait and by the batch: one cancel)
        log.info("client gone; cancelling its job", job_id=handle.job_id)
        task = asyncio.ensure_future(handle.cancel(timeout=10.0))
        self._cancels[handle.job_id] = task
        task.add_done_callback(lambda _: self._cancels.pop(handle.job_id, None))

    # -- routes -----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        connected = self.client.nc.is_connected
        replicas = len(self.client.fleet.replicas())
        body = {"status": "ok" if connected else "broker unreachable", "replicas": replicas,
                "latest_version": self.client.latest_version}  # fmt: skip
        return web.json_response(body, status=200 if connected else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry) + generate_latest(self.client.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollfleet",
                 "latest_version": self.client.latest_version}  # fmt: skip
        return web.json_response({"object": "list", "data": [model]})

    async def _session(self, request: web.Request, req: GatewayRequest) -> Session | None:
        """The rollfleet session of a request that names its trajectory (``X-Session-Id``, or
        miles' ``X-SMG-Routing-Key``): opened on its first turn with the request's constraint,
        resumed after (also by a restarted gateway with the same client id). Its turns stick to
        the replica holding their context, under the session's version policy (monotonic)."""
        key = next((request.headers[h] for h in protocol.SESSION_HEADERS if h in request.headers), None)
        if key is None:
            return None
        sid = protocol.session_id_of(key)
        async with self._opening.hold(sid):
            found = self.client.sessions.get(sid)
            if isinstance(found, Session) and not found.closed and not self.client.shared:
                return found
            if self.client.shared:
                # Another gateway of the id may have run the trajectory's last turn: its record
                # (the next turn, the replica holding the context) is read from the broker.
                with suppress(UnknownSession):
                    return await self.client.resume_session(sid)
            return await self.client.session(sid, **req.constraint.as_kwargs()).open()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, protocol.parse_generate)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, protocol.parse_completions)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, functools.partial(protocol.parse_chat, template=self.chat_template))

    async def _serve(
        self, request: web.Request, parse: Callable[..., GatewayRequest | list[GatewayRequest]]
    ) -> web.StreamResponse:
        """One request of any shape: parsed, run as a session's turn or a job of its own
        (streamed, or awaited), and answered in the route's shape."""
        parsed = parse(
            await self._body(request),
            key_header=request.headers.get("Idempotency-Key"),
            default_max_staleness=self.default_max_staleness,
        )
        if isinstance(parsed, list):
            return web.json_response(await self._batch(request, parsed))
        req = parsed
        session = await self._session(request, req)
        if session is not None:
            # A turn moves between replicas as its session needs: streamed, it comes whole, once
            # answered (an error before that is the request's status, as for any request).
            result = await session.generate(req.payload, timeout=self.timeout_s)
            if req.stream:
                return await self._stream(request, req, _answered(result))
        else:
            handle = await self._submit(req)
            if req.stream:
                return await self._stream(request, req, self._job_events(req, handle))
            result = await self._await(req, handle)
        return web.json_response(protocol.answer(req, result, model=self._model(req), created=int(time.time())))

    async def _batch(self, request: web.Request, reqs: list[GatewayRequest]) -> list[Any]:
        """A batch of inputs (SGLang's ``/generate``): every job submitted, then awaited; the answer
        is one flat list, input by input (and sample by sample within an input). One failure fails
        the request; its keyless siblings are cancelled with it (nobody can ask for them again)."""
        if any(h in request.headers for h in protocol.SESSION_HEADERS):
            raise InvalidRequest("a batch of inputs cannot be one session's turn: send the turns one by one")
        handles: list[RolloutHandle] = []
        waits: list[asyncio.Future[RolloutResult]] = []
        try:
            for req in reqs:
                handles.append(await self._submit(req))
            waits = [asyncio.ensure_future(self._await(r, h)) for r, h in zip(reqs, handles, strict=True)]
            results = await asyncio.gather(*waits)
        except (RollfleetError, asyncio.CancelledError):
            for wait in waits:  # (the siblings still waiting stop waiting: nobody reads them now)
                wait.cancel()
            for req, handle in zip(reqs, handles, strict=False):
                self._abandoned(req, handle)
            raise
        items: list[Any] = []
        for req, result in zip(reqs, results, strict=True):
            one = protocol.answer(req, result, model=self.model_name, created=int(time.time()))
            items.extend(one if isinstance(one, list) else [one])
        return items

    def _model(self, req: GatewayRequest) -> str:
        return req.model or self.model_name

    async def _job_events(self, req: GatewayRequest, handle: RolloutHandle) -> AsyncIterator[Event]:
        """A job's tokens as the fleet checkpoints them (a resumable job) or at the end, then its
        answer; a caller that leaves cancels a keyless job."""
        try:
            async for chunk in self.client.stream(handle):
                yield handle.job_id, chunk
            yield handle.job_id, await handle.result()
        except asyncio.CancelledError:
            self._abandoned(req, handle)
            raise

    async def _stream(
        self, request: web.Request, req: GatewayRequest, events: AsyncIterator[Event]
    ) -> web.StreamResponse:
        """Server-sent events: each chunk of tokens, then the whole answer in the last event, then
        ``[DONE]``; an error on the way is an event with the error's body."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created, model = int(time.time()), self._model(req)
        try:
            async for job_id, item in events:
                if isinstance(item, RolloutResult):
                    event = protocol.final_event(req, item, model=model, created=created)
                else:
                    event = protocol.stream_event(req, item, job_id=job_id, model=model, created=created)
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
        except RollfleetError as exc:
            await response.write(f"data: {json.dumps(protocol.error_reply(exc).body)}\n\n".encode())
        with suppress(ConnectionResetError):
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response


Event = tuple[str, "TokenChunk | RolloutResult"]  # (the job's id, a chunk of tokens or its answer)


async def _answered(result: RolloutResult) -> AsyncIterator[Event]:
    """The events of an answer that came whole (a session's turn)."""
    for chunk in chunks_of(result):
        yield result.job_id, chunk
    yield result.job_id, result


async def serve(
    client: RolloutClient, host: str, port: int, *, started: Callable[[int], None] | None = None, **options: Any
) -> None:
    """Serve until cancelled; ``started`` gets the bound port (``port=0``: any free one)."""
    gateway = Gateway(client, **options)
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    log.info("gateway listening", host=host, port=bound)
    if started is not None:
        started(bound)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
