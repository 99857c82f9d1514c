"""``rollfleet gateway``: one HTTP endpoint over the fleet, for trainers and agent frameworks that
never import rollfleet. A stateless aiohttp server around one ``RolloutClient``; it keeps nothing
a restart could lose (jobs, answers, idempotency keys and sessions live in the broker).

Routes: ``POST /generate`` (SGLang's shape, one input or a batch), ``POST /v1/completions``,
``POST /v1/chat/completions`` (with a chat template: ``--tokenizer DIR``) and ``GET /v1/models``
(OpenAI's), ``GET /health``, ``GET /metrics`` (Prometheus). With an API key, every route but
``/health`` needs ``Authorization: Bearer <key>``.

This module only waits and carries out: ``protocol`` reads a request and shapes its answer,
``request_state.RequestState`` decides what becomes of it (its key, what a client that leaves
means for its jobs, its status, its metrics label), for every door alike (``Exchange``).
Connections are guarded below the routes (``_GatewayHandler``): a request's head must arrive
within ``HEADER_TIMEOUT_S``, and a head aiohttp cannot parse gets the JSON error shape without
its bytes echoed or logged.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rollfleet.gateway import protocol
from rollfleet.gateway.chat import ChatTemplate
from rollfleet.gateway.protocol import GatewayRequest
from rollfleet.gateway.request_state import (
    CLIENT_CLOSED,
    Action,
    CancelJob,
    EndStream,
    OpenStream,
    RequestState,
)
from rollfleet.runtime.aio import KeyedLocks
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import RolloutResult
from rollfleet.schemas.errors import (
    AuthorizationError,
    InternalError,
    InvalidRequest,
    NoCompatibleReplica,
    RollfleetError,
    UnknownSession,
)
from rollfleet.schemas.progress import TokenChunk
from rollfleet.trainer_client import Session
from rollfleet.trainer_client.streaming import chunks_of

if TYPE_CHECKING:
    from rollfleet.trainer_client import RolloutClient, RolloutHandle

log = get_logger("rollfleet.gateway")

MAX_BODY_BYTES = 1024 * 1024  # a request body past this is refused (413) before it is read whole
HEADER_TIMEOUT_S = 5.0  # from a connection's opening, or a request head's first byte, to its last
BODY_TIMEOUT_S = 30.0  # to read a request's body once its head is in
IDLE_TIMEOUT_S = 75.0  # a kept-alive connection with no request (nginx's keepalive_timeout)
SSE_KEEPALIVE_S = 5.0  # a stream waiting this long sends a comment, so idle-timing proxies keep it
CANCEL_TIMEOUT_S = 10.0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rollfleet_gateway_requests_total",
            "Requests by route and the status they ended with (499: the client left first)",
            ("route", "status"), registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "rollfleet_gateway_request_seconds", "Request latency by route", ("route",), registry=self.registry
        )
        self.in_flight = Gauge("rollfleet_gateway_in_flight", "Requests being served", registry=self.registry)


def _json_response(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """``web.json_response`` with the gateway's encoder (``protocol.json_bytes``)."""
    return web.Response(body=protocol.json_bytes(body), status=status, headers=headers,
                        content_type="application/json", charset="utf-8")  # fmt: skip


_LABEL = web.RequestKey("rollfleet_status", int)  # (where a request's handler leaves the status it ended with)


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
        self._opening = KeyedLocks()  # one open of a session at a time
        self.turns = KeyedLocks()  # one turn of a trajectory at a time (the next waits for it)
        # What outlives the request that started it: a job being stored for a client that left,
        # a cancel under way, a keyed turn running on for its retry.
        self.background: set[asyncio.Future[Any]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._measured])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/generate", functools.partial(self._serve, route="generate"))
        app.router.add_post("/v1/completions", functools.partial(self._serve, route="completions"))
        app.router.add_post("/v1/chat/completions", functools.partial(self._serve, route="chat"))
        return app

    def keep(self, future: asyncio.Future[Any]) -> None:
        """Hold a task that outlives its request until it ends (its error logged, never lost)."""
        self.background.add(future)
        future.add_done_callback(self._ended)

    def _ended(self, future: asyncio.Future[Any]) -> None:
        self.background.discard(future)
        if not future.cancelled() and future.exception() is not None:
            exc = future.exception()
            log.info("a request's leftover work ended with an error", error=getattr(exc, "message", repr(exc)))

    async def close(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)

    # -- plumbing ----------------------------------------------------------------------------
    @web.middleware
    async def _measured(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        status = 500
        try:
            if self.api_key is not None and request.path != "/health":
                if not protocol.authorized(request.headers, self.api_key):
                    raise AuthorizationError("a valid 'Authorization: Bearer <key>' header is required")
            response = await handler(request)
            status = request.get(_LABEL, response.status)
            return response
        except RollfleetError as exc:
            return self._refused(request, exc, route)
        except web.HTTPException as exc:  # (aiohttp's router and body limit)
            if exc.status == 404:
                return self._refused(request, protocol.RouteNotFound(f"no route {request.path!r}"), route)
            if isinstance(exc, web.HTTPMethodNotAllowed):
                err = protocol.MethodNotAllowed(f"{request.path} takes {sorted(exc.allowed_methods)}",
                                                sorted(exc.allowed_methods))  # fmt: skip
                return self._refused(request, err, route)
            if exc.status == 413:
                too_large = protocol.BodyTooLarge(f"the request body is larger than {MAX_BODY_BYTES} bytes")
                return self._refused(request, too_large, route)
            raise
        except asyncio.CancelledError:
            request[_LABEL] = CLIENT_CLOSED  # (the connection closed: aiohttp cancels its handler)
            raise
        finally:
            status = request.get(_LABEL, status)
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - t0)

    def _refused(self, request: web.Request, exc: RollfleetError, route: str) -> web.Response:
        reply = protocol.error_reply(exc)
        request[_LABEL] = reply.status
        log.info("request refused", route=route, status=reply.status, code=exc.code, error=exc.message)
        return _json_response(reply.body, status=reply.status, headers=reply.headers)

    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except TimeoutError:
            raise protocol.RequestTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
        return protocol.read_body(raw, MAX_BODY_BYTES)

    async def submit(self, req: GatewayRequest) -> RolloutHandle:
        handle = await self.client.submit(
            req.payload, idempotency_key=req.idempotency_key, timeout=self.timeout_s,
            wait_for_replica=req.wait_for_replica, constraint=req.constraint,
        )  # fmt: skip
        log.info("submitted", route=req.route, idempotency_key=handle.idempotency_key, job_id=handle.job_id,
                 **({"user": req.user} if req.user is not None else {}))  # fmt: skip
        return handle

    def cancel(self, handle: RolloutHandle) -> None:
        """Cancel a job whose client left (``RequestState`` decided it): in the background, since
        nobody waits for it now."""
        log.info("client gone; cancelling its job", job_id=handle.job_id)
        self.keep(asyncio.ensure_future(handle.cancel(timeout=CANCEL_TIMEOUT_S)))

    # -- routes -----------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        connected = self.client.nc.is_connected
        replicas = len(self.client.fleet.replicas())
        body = {"status": "ok" if connected else "broker unreachable", "replicas": replicas,
                "latest_version": self.client.latest_version}  # fmt: skip
        return _json_response(body, status=200 if connected else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry) + generate_latest(self.client.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollfleet",
                 "latest_version": self.client.latest_version}  # fmt: skip
        return _json_response({"object": "list", "data": [model]})

    async def session(self, sid: str) -> Session:
        """The rollfleet session a trajectory's header names: resumed (also by a restarted
        gateway, or another one on the same client id, from its record in the broker), or opened.
        Opened with the same settings by every gateway (any version, monotonic): each turn carries
        its request's own constraint, so no turn's constraint outlives it."""
        async with self._opening.hold(sid):
            found = self.client.sessions.get(sid)
            if isinstance(found, Session) and not found.closed and not self.client.shared:
                return found
            if self.client.shared:
                # Another gateway of the id may have run the trajectory's last turn: its record
                # (the next turn, the replica holding the context) is read from the broker.
                with suppress(UnknownSession):
                    return await self.client.resume_session(sid)
            return await self.client.session(sid, min_version=0, version_policy="monotonic").open()

    async def _serve(self, request: web.Request, *, route: protocol.Route) -> web.StreamResponse:
        """One request of any shape: read, then carried through its ``Exchange``."""
        key = protocol.header_text(request.headers, protocol.IDEMPOTENCY_HEADER)
        sid = protocol.session_of(request.headers)
        body = await self._body(request)
        common: dict[str, Any] = {"key_header": key, "default_max_staleness": self.default_max_staleness}
        parsed: GatewayRequest | list[GatewayRequest]
        if route == "generate":
            parsed = protocol.parse_generate(body, **common)
        elif route == "completions":
            parsed = protocol.parse_completions(body, model_name=self.model_name, **common)
        else:
            parsed = protocol.parse_chat(body, template=self.chat_template, model_name=self.model_name, **common)
        if sid is not None:
            protocol.check_turn(parsed)
        return await Exchange(self, request, parsed, sid).run()


Event = tuple[str, "TokenChunk | RolloutResult"]  # (the job's id, a chunk of tokens or its answer)
_END = object()  # (the last item of a stream's queue)


class Exchange:
    """One request carried out: the jobs stored, awaited or streamed, and answered, as its
    ``RequestState`` says; the client leaving, at any await, is one event of it."""

    def __init__(self, gateway: Gateway, request: web.Request, parsed: GatewayRequest | list[GatewayRequest],
                 sid: str | None) -> None:  # fmt: skip
        self.gateway = gateway
        self.request = request
        self.reqs = parsed if isinstance(parsed, list) else [parsed]
        self.sid = sid
        door = "batch" if isinstance(parsed, list) else "turn" if sid is not None else "plain"
        self.req = self.reqs[0]
        self.state = RequestState(door, stream=self.req.stream and door != "batch",
                                  keys=tuple(r.idempotency_key for r in self.reqs))  # fmt: skip
        self.handles: dict[int, RolloutHandle] = {}
        self.response: web.StreamResponse | None = None
        self.created = int(time.time())

    async def run(self) -> web.StreamResponse:
        try:
            if self.state.door == "turn":
                return await self._turn()
            return await self._jobs()
        except RollfleetError as exc:
            return await self._failed(exc)
        except asyncio.CancelledError:  # (the connection closed: aiohttp cancels its handler)
            self._left()
            raise
        except ConnectionResetError:  # (it closed as a stream was written)
            self._left()
            return self.response if self.response is not None else web.Response(status=CLIENT_CLOSED)
        finally:
            if self.state.status is not None:
                self.request[_LABEL] = self.state.status

    # -- the machine's actions -------------------------------------------------------------------
    def _do(self, actions: list[Action]) -> list[Action]:
        """Carry out the cancels at once; hand back what writes the response."""
        for action in actions:
            if isinstance(action, CancelJob):
                self.gateway.cancel(self.handles[action.index])
        return [a for a in actions if not isinstance(a, CancelJob)]

    def _note_settled(self) -> None:
        for i, handle in self.handles.items():
            if handle.done():
                self.state.job_settled(i)

    def _left(self) -> None:
        self._note_settled()
        self._do(self.state.client_left())

    def _stored(self, index: int, handle: RolloutHandle) -> None:
        self.handles[index] = handle
        self._do(self.state.job_stored(index))

    async def _failed(self, exc: RollfleetError) -> web.StreamResponse:
        self._note_settled()
        wait = 1
        if isinstance(exc, NoCompatibleReplica):  # (how long: the time the fleet's autoscaler expects)
            wait = protocol.retry_after_s(self.req.constraint, self.gateway.client.fleet.autoscaler_status, time.time())
        reply = protocol.error_reply(exc, retry_after_s=wait)
        log.info("request failed", route=self.req.route, status=reply.status, code=exc.code, error=exc.message)
        for action in self._do(self.state.failed(reply.status)):
            if isinstance(action, EndStream) and self.response is not None:
                await self._end_stream([self._event(reply.body)])
                return self.response
        return _json_response(reply.body, status=reply.status, headers=reply.headers)

    # -- plain requests and batches ----------------------------------------------------------------
    async def _store(self, index: int, req: GatewayRequest) -> RolloutHandle:
        """Store one job. The submit runs as a task of its own: a client that leaves while the job
        is being stored cancels this wait, not the submit, so the handle is held once the job is
        stored, and the machine can have it cancelled."""
        task = asyncio.ensure_future(self.gateway.submit(req))
        try:
            handle = await asyncio.shield(task)
        except asyncio.CancelledError:
            self.gateway.keep(task)
            task.add_done_callback(lambda t: t.cancelled() or t.exception() or self._stored(index, t.result()))
            raise
        self._stored(index, handle)
        return handle

    async def _jobs(self) -> web.StreamResponse:
        for i, req in enumerate(self.reqs):
            handle = await self._store(i, req)
            early = await _refused_at_once(handle)
            if early is not None:  # (no replica for the constraint, say: its own status, streamed or not)
                raise early
        if any(isinstance(a, OpenStream) for a in self._do(self.state.all_stored())):
            return await self._stream(self._job_events(self.handles[0]))
        results = await asyncio.gather(*(self.handles[i].result() for i in range(len(self.reqs))))
        self._do(self.state.answered())
        model = self.gateway.model_name
        if self.state.door != "batch":
            return _json_response(protocol.answer(self.req, results[0], model=model, created=self.created))
        items: list[Any] = []  # (a batch: one flat list, input by input, sample by sample)
        for req, result in zip(self.reqs, results, strict=True):
            one = protocol.answer(req, result, model=model, created=self.created)
            items.extend(one if isinstance(one, list) else [one])
        return _json_response(items)

    async def _job_events(self, handle: RolloutHandle) -> AsyncIterator[Event]:
        """A job's tokens as the fleet checkpoints them (a resumable job) or at the end, then its answer."""
        async for chunk in self.gateway.client.stream(handle):
            yield handle.job_id, chunk
        yield handle.job_id, await handle.result()

    # -- session turns -----------------------------------------------------------------------------
    async def _turn(self) -> web.StreamResponse:
        """A session's turn: run by its session (which stores its job where the trajectory's
        context is cached, and may move it), as a task the client's leaving does not stop: a
        keyless turn's job is cancelled then (``submitted`` tells the handle), a keyed one runs on
        and is recorded for the retry. The trajectory's turns through this gateway run one at a
        time: a turn asked while the previous one runs (a retry after a disconnect) waits for it,
        and so reads the session as that turn left it."""
        sid, req = self.sid, self.req
        assert sid is not None

        async def run() -> RolloutResult | None:
            async with self.gateway.turns.hold(sid):
                if not self.state.may_start():
                    return None  # (its client left while it waited: nothing of it was stored)
                session = await self.gateway.session(sid)
                return await session.generate(req.payload, timeout=self.gateway.timeout_s, key=req.idempotency_key,
                                              submitted=lambda handle: self._stored(0, handle),
                                              constraint=req.constraint)  # fmt: skip

        turn = asyncio.ensure_future(run())
        try:
            result = await asyncio.shield(turn)
        except asyncio.CancelledError:
            self.gateway.keep(turn)
            raise
        assert result is not None  # (None only for a client that left)
        if any(isinstance(a, OpenStream) for a in self._do(self.state.answered())):
            # A turn may move between replicas while it waits: streamed, it comes whole once answered.
            return await self._stream(_answered(result), decided=True)
        return _json_response(protocol.answer(req, result, model=self.gateway.model_name, created=self.created))

    # -- streams -------------------------------------------------------------------------------
    def _event(self, body: Any) -> bytes:
        return protocol.sse_event(body)

    async def _open(self) -> None:
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await self.response.prepare(self.request)

    async def _end_stream(self, last: list[bytes]) -> None:
        assert self.response is not None
        for data in last:
            await self.response.write(data)
        await self.response.write(b"data: [DONE]\n\n")
        with suppress(ConnectionResetError):
            await self.response.write_eof()

    async def _stream(self, events: AsyncIterator[Event], *, decided: bool = False) -> web.StreamResponse:
        """Server-sent events: each chunk of tokens, then the whole answer in the last event, then
        ``[DONE]``; while none comes, a ``: keep-alive`` comment every ``SSE_KEEPALIVE_S``.
        ``decided``: the request was answered before its stream opened (a turn)."""
        await self._open()
        assert self.response is not None
        req, model = self.req, self.gateway.model_name
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for item in events:
                    await queue.put(item)
                await queue.put(_END)
            except RollfleetError as exc:
                await queue.put(exc)

        pumping = asyncio.ensure_future(pump())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
                except TimeoutError:
                    await self.response.write(b": keep-alive\n\n")
                    continue
                if isinstance(item, RollfleetError):
                    raise item
                if item is _END:  # (the answer is always the last event: not reached)
                    raise InternalError("a stream ended without its answer")
                job_id, value = item
                if isinstance(value, RolloutResult):
                    if not decided:
                        self._do(self.state.answered())
                    final = protocol.final_event(req, value, model=model, created=self.created)
                    await self._end_stream([self._event(final)])
                    return self.response
                chunk = protocol.stream_event(req, value, job_id=job_id, model=model, created=self.created)
                await self.response.write(self._event(chunk))
        finally:
            pumping.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await pumping


async def _refused_at_once(handle: RolloutHandle) -> RollfleetError | None:
    """The error a handle was settled with by its submit (no replica for its constraint, say),
    read without waiting: None while it waits for its answer."""
    if not handle.done():
        return None
    try:
        await handle
    except RollfleetError as exc:
        return exc
    return None


async def _answered(result: RolloutResult) -> AsyncIterator[Event]:
    """The events of an answer that came whole (a session's turn)."""
    for chunk in chunks_of(result):
        yield result.job_id, chunk
    yield result.job_id, result


# -- connections ---------------------------------------------------------------------------------


class _GatewayHandler(web.RequestHandler):
    """aiohttp's connection handler, with two guards. A request's head must arrive whole within
    ``HEADER_TIMEOUT_S`` of the connection's opening, or of its first byte on a kept-alive
    connection: a client sending it a byte at a time (slowloris) is cut off, not held open for
    minutes. A head aiohttp cannot parse (a line too long, a byte not allowed) is answered with the
    gateway's JSON error, never with the bytes it quotes, and logged on one line without them:
    they may be an ``Authorization`` header's secret."""

    gateway: Gateway
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._request_in_progress:
            self._arm()  # (a next request's head begins)
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:  # a head was read whole
            self._disarm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = asyncio.get_running_loop().call_later(HEADER_TIMEOUT_S, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._request_in_progress:
            return
        log.info("connection closed: its request head did not arrive in time", timeout_s=HEADER_TIMEOUT_S)
        self.gateway.metrics.requests.labels(route="unread", status="408").inc()
        self.force_close()

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # (as aiohttp: the connection is broken)
            raise ConnectionError("the response was under way; no error can be sent")
        error: RollfleetError
        if status >= 500:
            # An error none of the gateway's handlers caught: a defect, logged with its traceback
            # (the gateway's own frames; aiohttp's message, which may quote the request, is not).
            log.error("unhandled error serving a request", status=status, error=type(exc).__name__, exc_info=exc)
            error = InternalError("internal error")
        else:
            log.info("request refused before it was read", status=status, error=type(exc).__name__)
            error = InvalidRequest("the request line or headers are malformed, or longer than allowed")
        self.gateway.metrics.requests.labels(route="unread", status=str(status)).inc()
        response = _json_response(protocol.error_reply(error).body, status=status)
        response.force_close()
        return response


class _GatewayServer(web.Server):
    gateway: Gateway

    def __call__(self) -> web.RequestHandler:
        handler = _GatewayHandler(self, loop=self._loop, **self._kwargs)
        handler.gateway = self.gateway
        return handler


class _GatewayRunner(web.AppRunner):
    """An ``AppRunner`` whose connections are handled by ``_GatewayHandler``."""

    def __init__(self, gateway: Gateway, **kwargs: Any) -> None:
        super().__init__(gateway.app(), **kwargs)
        self.gateway = gateway

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        server = _GatewayServer(made.request_handler, request_factory=made.request_factory, loop=made._loop,
                                handler_cancellation=made.handler_cancellation, **made._kwargs)  # fmt: skip
        server.gateway = self.gateway
        return server


async def serve(
    client: RolloutClient, host: str, port: int, *, started: Callable[[int], None] | None = None, **options: Any
) -> None:
    """Serve until cancelled; ``started`` gets the bound port (``port=0``: any free one)."""
    gateway = Gateway(client, **options)
    runner = _GatewayRunner(gateway, handler_cancellation=True, access_log=None, keepalive_timeout=IDLE_TIMEOUT_S)
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
        await gateway.close()
