"""The OpenAI-compatible P/D proxy: aiohttp server and client on one event loop.

Its routes (`ROUTES`) and one middleware for every request: the `X-Request-Id` it is
answered with, errors as vLLM-shaped JSON (an unknown route is a 404 listing the routes),
the count a SIGTERM drain waits for; then the clients' API key on /v1/*. A completion is
served by `legs.Legs` (pull or push, with safe retries) and relayed by `relay.Relay`; on a
failed decode leg the pair's /metrics may say why (a mode mismatch, kvpush's failure
counters). The parts, each in its module: `backends` (pools, ejection, legs in flight),
`monitor` (health checks, /metrics scrape, fleet-file reload), `admin` (/admin/backends),
`metrics` (/metrics), `client` (the HTTP client to the backends), `auth`, `errors`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvpush.proxy import rewrite
from kvpush.proxy.admin import Admin
from kvpush.proxy.auth import api_key_refusal
from kvpush.proxy.backends import Backends, make_pools
from kvpush.proxy.balance import NoBackend
from kvpush.proxy.client import BackendClient
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.errors import (
    KEY_REFUSED,
    BackendFailure,
    describe,
    error_response,
    transport_failure,
)
from kvpush.proxy.fleet import ROLES
from kvpush.proxy.legs import Job, Legs
from kvpush.proxy.metrics import Metrics
from kvpush.proxy.monitor import Monitor
from kvpush.proxy.relay import Relay
from kvpush.proxy.rewrite import RequestError

log = logging.getLogger("kvpush.proxy")
T = TypeVar("T")

PROXY_KEY: web.AppKey[Proxy] = web.AppKey("kvpush.proxy")
ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
    "GET /ready, GET /metrics, GET/POST/DELETE /admin/backends"
)
REQUEST_ID = web.RequestKey("kvpush.request_id", str)  # the id a request is answered with
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs id=%{X-Request-Id}o'


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no such route, wrong method, body too large) as JSON errors."""
    what = f"{request.method} {request.path}"
    if isinstance(exc, web.HTTPNotFound):
        return error_response(
            404, f"no route {what}; this proxy serves {ROUTES}", "not_found_error"
        )
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(
            405, f"{what} is not allowed; {request.path} takes {allowed}", "invalid_request_error"
        )
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return error_response(exc.status, f"{what}: {exc.reason}", kind)


class Proxy:
    """The proxy's parts (backends, metrics, HTTP client, background checks, admin API) and
    its request handlers."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.client = BackendClient(
            config.request_timeout, config.connect_timeout, config.backend_api_key
        )
        pools = make_pools(config)
        self.metrics = Metrics(pools)
        self.backends = Backends(config.mode, pools, self.metrics)
        self.monitor = Monitor(self.backends, self.client, config)
        self.legs = Legs(config, self.backends, self.client, self.metrics)
        self.admin = Admin(self.backends, config.admin_token, config.policies)
        self.draining = False  # set at SIGTERM: /ready answers 503, requests in flight finish
        self.in_flight = 0  # client requests being answered
        # When set (`kvpush bench sweep --trace`): per request id, when each chunk of decode's
        # streamed answer reached the proxy (`Relay.chunk_log`), to tell a burst made
        # upstream of the proxy from one made after it
        self.chunk_logs: dict[str, list[tuple[float, int]]] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def close(self) -> None:
        await self.monitor.stop()
        await self.client.close()

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self._request_middleware, self._auth_middleware],
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        self.admin.add_routes(app)

        async def on_startup(_: web.Application) -> None:
            self.monitor.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.close()

        async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
            # Here rather than in a middleware: a streamed answer sends its headers early.
            request_id = request.get(REQUEST_ID)
            if request_id:
                response.headers["X-Request-Id"] = request_id

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        app.on_response_prepare.append(on_prepare)
        app[PROXY_KEY] = self
        return app

    def status_line(self) -> str:
        """One human-readable line: request outcomes, legs in flight, ejected backends."""
        return self.metrics.status_line()

    # -- draining (SIGTERM) ------------------------------------------------------------

    async def drain(self, timeout: float, stop_now: asyncio.Event | None = None) -> int:
        """Stop being ready (/ready and /health answer 503, so load balancers send no more)
        and wait until no request is in flight, `timeout` passed or `stop_now` is set.
        Requests that still arrive are served. Returns how many are still in flight."""
        self.draining = True
        log.info(
            "draining: /ready answers 503; waiting for %d requests in flight (at most %g s)",
            self.in_flight,
            timeout,
        )
        waits = [asyncio.ensure_future(self._idle.wait())]
        if stop_now is not None:
            waits.append(asyncio.ensure_future(stop_now.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self.in_flight:
            log.warning("stopping with %d requests still in flight", self.in_flight)
        return self.in_flight

    # -- middlewares ----------------------------------------------------------------------

    @web.middleware
    async def _request_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every request: an id to answer with, a count for draining, and errors as JSON."""
        request[REQUEST_ID] = rewrite.answer_id(request.headers.get("X-Request-Id"))
        counted = request.path.startswith("/v1/")  # what draining waits for
        if counted:
            self.in_flight += 1
            self._idle.clear()
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return _http_error(request, exc)
        except ConnectionError:  # the client went away: nobody to answer
            raise
        except Exception:  # a bug here must still answer in the API's shape
            log.exception("%s %s failed inside the proxy", request.method, request.path)
            return error_response(
                500, "internal error in the proxy; its log has the details", "server_error"
            )
        finally:
            if counted:
                self.in_flight -= 1
                if not self.in_flight:
                    self._idle.set()

    @web.middleware
    async def _auth_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        refusal = api_key_refusal(request, self.config.api_key)
        if refusal:
            return refusal
        return await handler(request)

    # -- handlers ---------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        mode = self.config.mode
        try:
            body = rewrite.validate_body(await request.json())
        except web.HTTPRequestEntityTooLarge:
            self.metrics.requests.labels(mode, "bad_request").inc()
            return error_response(
                413,
                f"request body over {self.config.max_body_bytes} bytes",
                "invalid_request_error",
            )
        except (json.JSONDecodeError, UnicodeDecodeError, RequestError) as exc:
            self.metrics.requests.labels(mode, "bad_request").inc()
            msg = str(exc) if isinstance(exc, RequestError) else f"body is not valid JSON: {exc}"
            return error_response(400, msg, "invalid_request_error")
        prompt_tokens = rewrite.estimate_prompt_tokens(body)
        job = Job(
            request.path,
            body,
            rewrite.leg_id(request[REQUEST_ID], request.headers.get("X-Request-Id")),
            prompt_tokens,
            prompt_tokens + rewrite.requested_output_tokens(body),
            rewrite.trace_headers(request.headers),
        )
        logs = self.chunk_logs
        chunks = None if logs is None else logs.setdefault(job.request_id, [])
        relay = Relay(request, time.perf_counter(), self.metrics, chunks)
        try:
            await self.legs.run(job, relay)
        except asyncio.CancelledError:
            # the client closed its connection (aiohttp cancels the handler): right after
            # the last byte of a streamed answer, as many clients do, or before the end
            self.metrics.requests.labels(mode, "ok" if relay.complete else "client_gone").inc()
            raise
        except NoBackend as exc:
            self.metrics.requests.labels(mode, "no_backend").inc()
            log.warning("request %s refused: %s", job.request_id, exc)
            return await relay.fail(503, str(exc), None)
        except BackendFailure as exc:
            self.metrics.requests.labels(mode, "backend_error").inc()
            message = str(exc)
            if exc.role == "decode" and exc.status >= 500 and relay.prefill is not None:
                # vLLM reports a failed KV handoff as a bare 500; if the pair's connectors
                # disagree on the mode, say so (both servers report it on /metrics).
                cause = await self.legs.handoff_cause(relay.prefill, exc.backend)
                if cause:
                    message = f"{message}; {cause}"
            log.warning("request %s failed: %s", job.request_id, message)
            return await relay.fail(exc.client_status, message, exc.backend.url)
        self.metrics.requests.labels(mode, "ok").inc()
        assert relay.response is not None
        return relay.response

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            backend = self.backends.choose("decode", 0, set()).backend
        except NoBackend as exc:
            return error_response(503, str(exc), "backend_error")
        try:
            async with self.client.session.get(backend.url + "/v1/models") as resp:
                if resp.status in KEY_REFUSED:  # the proxy's key, not the client's
                    failure = BackendFailure("decode", backend, resp.status, await describe(resp))
                else:
                    return web.Response(
                        status=resp.status, body=await resp.read(), content_type="application/json"
                    )
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = transport_failure("decode", backend, exc, self.config)
        return error_response(failure.client_status, str(failure), "backend_error", backend.url)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        """Checks every backend now (each probe counts as a health check); a backend is ok
        when it answers and takes requests; a role with none ok makes the proxy degraded."""
        report: dict[str, Any] = {}
        ejected: dict[str, str] = {}
        for role, pool in self.backends.pools.items():
            states = list(pool)
            problems = await asyncio.gather(*(self.client.health(s.url, 2.0) for s in states))
            for state, problem in zip(states, problems, strict=True):
                self.backends.checked(role, state, problem)
            report[role] = {
                s.url: p is None and s.healthy for s, p in zip(states, problems, strict=True)
            }
            ejected.update({s.url: s.reason for s in states if not s.healthy})
        healthy = all(any(report[role].values()) for role in ROLES)
        status = "draining" if self.draining else "ok" if healthy else "degraded"
        return web.json_response(
            {"status": status, "mode": self.config.mode, **report, "ejected": ejected},
            status=200 if status == "ok" else 503,
        )

    async def _ready(self, request: web.Request) -> web.StreamResponse:
        """For load balancers and readiness probes: 200 while the proxy takes requests; 503
        once it drains (SIGTERM) or while a role has no backend in rotation. Probes no
        backend (cheap to poll; the background health checks keep the rotation current)."""
        if self.draining:
            body = {"status": "draining", "in_flight": self.in_flight}
            return web.json_response(body, status=503)
        missing = [role for role in ROLES if not self.backends.pools[role].available()]
        if missing:
            reason = "no healthy backend: " + ", ".join(missing)
            return web.json_response({"status": "unavailable", "reason": reason}, status=503)
        return web.json_response({"status": "ready"})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self.metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


async def start_proxy(config: ProxyConfig, host: str, port: int) -> web.AppRunner:
    """Start serving on host:port and return the runner (call `runner.cleanup()` to stop)."""
    runner = web.AppRunner(
        Proxy(config).app(),
        handler_cancellation=True,
        access_log=logging.getLogger("kvpush.proxy.access") if config.access_log else None,
        access_log_format=ACCESS_LOG_FORMAT,
        # Proxy.drain has waited for the requests in flight before a clean stop; what
        # still runs when the runner is cleaned up is to be cut, not waited for.
        shutdown_timeout=1.0,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()  # the health checks started with the app; stop them
        raise
    return runner


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop of the kind `kvpush proxy` serves on: uvloop's when installed.
    Everything that hosts the proxy in-process (`kvpush up`, the benchmarks) runs it on
    this, so what they measure is the proxy users deploy."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_proxy_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on `new_event_loop()`: how every kvpush tool runs the proxy (and
    the `kvpush proxy bench` stubs and load), in its own process or in-process."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
