"""The OpenAI-compatible P/D proxy: aiohttp server and client on one event loop.

One request's path, pull mode: pick prefill (least in flight) -> POST the prompt with
max_tokens=1 -> read prefill's kv_transfer_params -> pick decode -> POST the client's
request with those params -> relay decode's answer (streamed chunk by chunk, or whole).
Push mode: pick prefill and decode first, send both legs at once with one request id;
if either leg fails, the other is cancelled (closing the HTTP connection makes vLLM abort
the request and free its blocks) and the client gets an error naming the backend.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpush.proxy import rewrite
from kvpush.proxy.rewrite import Backend, RequestError

log = logging.getLogger("kvpush.proxy")

PROXY_KEY: web.AppKey[Proxy] = web.AppKey("kvpush.proxy")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BackendFailure(Exception):
    """A leg failed; carries what the client is told and which backend is to blame."""

    def __init__(self, role: str, backend: Backend, status: int, detail: str) -> None:
        super().__init__(f"{role} backend {backend.url}: {detail}")
        self.role = role
        self.backend = backend
        self.status = status
        self.detail = detail

    @property
    def client_status(self) -> int:
        # A 4xx from vLLM is about the request (bad prompt, too long): pass it through.
        # Anything else is the proxy's upstream failing: 502, or 504 for a timeout.
        return self.status if 400 <= self.status < 500 else (504 if self.status == 504 else 502)


@dataclass(slots=True)
class ProxyConfig:
    mode: str
    prefill: list[Backend]
    decode: list[Backend]
    request_timeout: float = 300.0
    connect_timeout: float = 5.0
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.mode not in rewrite.MODES:
            raise ValueError(f"mode must be one of {rewrite.MODES}, got {self.mode!r}")
        if not self.prefill or not self.decode:
            raise ValueError("the proxy needs at least one prefill and one decode backend")
        if self.mode == "push":
            missing = [b.url for b in self.prefill if not b.has_kv_coordinates]
            if missing:
                raise ValueError(
                    f"push mode needs KV coordinates for every prefill backend ({missing}): "
                    "pass --prefill URL,engine=ID,kv=HOST:PORT[,tp=N]"
                )
        if self.request_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError("timeouts must be positive")


@dataclass(slots=True)
class Pool:
    """Backends of one role; picks the one with the fewest requests in flight."""

    role: str
    backends: list[Backend]
    in_flight: dict[str, int] = field(default_factory=dict)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def pick(self) -> Backend:
        start = next(self._turn) % len(self.backends)
        ordered = self.backends[start:] + self.backends[:start]
        return min(ordered, key=lambda b: self.in_flight.get(b.url, 0))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvpush_proxy_requests",
            "Client requests by outcome",
            ["mode", "outcome"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvpush_proxy_backend_in_flight",
            "Legs in flight per backend",
            ["role", "backend"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvpush_proxy_backend_errors",
            "Failed legs per backend",
            ["role", "backend", "kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvpush_proxy_ttft_seconds",
            "Time from client request to the first byte of decode's answer",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefill = Histogram(
            "kvpush_proxy_prefill_seconds",
            "Duration of the prefill leg",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


def error_body(message: str, kind: str, backend: str | None = None) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message, "type": kind}
    if backend:
        err["backend"] = backend
    return {"error": err}


def error_response(
    status: int, message: str, kind: str, backend: str | None = None
) -> web.Response:
    return web.json_response(error_body(message, kind, backend), status=status)


class Proxy:
    """The proxy's state (backend pools, metrics, HTTP client) and its request handlers."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pools = {
            "prefill": Pool("prefill", config.prefill),
            "decode": Pool("decode", config.decode),
        }
        self.metrics = Metrics()
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=self.config.request_timeout, sock_connect=self.config.connect_timeout
            )
            self._session = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._auth_middleware]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)

        async def on_cleanup(_: web.Application) -> None:
            await self.close()

        app.on_cleanup.append(on_cleanup)
        app[PROXY_KEY] = self
        return app

    def status_line(self) -> str:
        """One human-readable line: request outcomes and legs in flight."""
        outcomes: dict[str, int] = {}
        for metric in self.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["outcome"]
                    outcomes[key] = outcomes.get(key, 0) + int(sample.value)
        done = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())) or "no requests yet"
        busy = ", ".join(
            f"{role} {sum(pool.in_flight.values())}" for role, pool in self.pools.items()
        )
        return f"requests: {done} | in flight: {busy}"

    @web.middleware
    async def _auth_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        key = self.config.api_key
        needs_key = key and request.path.startswith("/v1/")
        if needs_key and not hmac.compare_digest(
            request.headers.get("Authorization", ""), f"Bearer {key}"
        ):
            return error_response(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
            )
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
        request_id = rewrite.new_request_id(request.headers.get("X-Request-Id"))
        started = time.perf_counter()
        relay = _Relay(request, started, self.metrics)
        try:
            if mode == "pull":
                await self._pull(request.path, body, request_id, relay)
            else:
                await self._push(request.path, body, request_id, relay)
        except BackendFailure as exc:
            self.metrics.requests.labels(mode, "backend_error").inc()
            self.metrics.errors.labels(exc.role, exc.backend.url, _error_kind(exc.status)).inc()
            message = str(exc)
            if exc.role == "decode" and exc.status >= 500 and relay.prefill is not None:
                # vLLM reports a failed KV handoff as a bare 500; if the pair's connectors
                # disagree on the mode, say so (both servers report it on /metrics).
                conflict = await self._mode_conflict(relay.prefill, exc.backend)
                if conflict:
                    message = f"{message}; {conflict}"
            log.warning("request %s failed: %s", request_id, message)
            return await relay.fail(exc.client_status, message, exc.backend.url)
        self.metrics.requests.labels(mode, "ok").inc()
        assert relay.response is not None
        return relay.response

    async def _pull(self, path: str, body: dict[str, Any], rid: str, relay: _Relay) -> None:
        prefill = relay.prefill = self.pools["prefill"].pick()
        answer = await self._prefill(prefill, path, body, rewrite.pull_prefill_params(), rid)
        try:
            params = rewrite.pull_decode_params(answer, prefill)
        except ValueError as exc:
            raise BackendFailure("prefill", prefill, 502, str(exc)) from None
        decode = self.pools["decode"].pick()
        await self._leg("decode", decode, path, rewrite.decode_body(body, params), rid, relay)

    async def _push(self, path: str, body: dict[str, Any], rid: str, relay: _Relay) -> None:
        prefill = relay.prefill = self.pools["prefill"].pick()
        decode = self.pools["decode"].pick()
        decode_leg = rewrite.decode_body(body, rewrite.push_decode_params(prefill, rid))
        prefill_task = asyncio.ensure_future(
            self._prefill(prefill, path, body, rewrite.push_prefill_params(rid), rid)
        )
        decode_task = asyncio.ensure_future(
            self._leg("decode", decode, path, decode_leg, rid, relay)
        )
        try:
            done, _ = await asyncio.wait(
                {prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED
            )
            if prefill_task in done and prefill_task.exception() is not None:
                decode_task.cancel()
                await asyncio.gather(decode_task, return_exceptions=True)
                prefill_task.result()
            await decode_task
        finally:
            # Decode only finishes after prefill's KV arrived, so prefill is done or moot.
            for task in (prefill_task, decode_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(prefill_task, decode_task, return_exceptions=True)

    async def _prefill(
        self, backend: Backend, path: str, body: dict[str, Any], params: dict[str, Any], rid: str
    ) -> Any:
        started = time.perf_counter()
        with self._in_flight("prefill", backend):
            answer = await self._call(
                "prefill", backend, path, rewrite.prefill_body(body, params), rid
            )
        self.metrics.prefill.labels(backend.url).observe(time.perf_counter() - started)
        return answer

    async def _call(
        self, role: str, backend: Backend, path: str, body: dict[str, Any], rid: str
    ) -> Any:
        try:
            async with self.session.post(
                backend.url + path, json=body, headers={"X-Request-Id": rid}
            ) as resp:
                if resp.status != 200:
                    raise BackendFailure(role, backend, resp.status, await _describe(resp))
                return await resp.json()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _transport_failure(role, backend, exc, self.config) from None

    async def _leg(
        self, role: str, backend: Backend, path: str, body: dict[str, Any], rid: str, relay: _Relay
    ) -> None:
        with self._in_flight(role, backend):
            try:
                async with self.session.post(
                    backend.url + path, json=body, headers={"X-Request-Id": rid}
                ) as resp:
                    if resp.status != 200:
                        raise BackendFailure(role, backend, resp.status, await _describe(resp))
                    await relay.forward(resp, backend)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise _transport_failure(role, backend, exc, self.config) from None

    def _in_flight(self, role: str, backend: Backend) -> _InFlight:
        return _InFlight(
            self.pools[role], self.metrics.in_flight.labels(role, backend.url), backend
        )

    async def _mode_conflict(self, prefill: Backend, decode: Backend) -> str | None:
        async def mode_of(backend: Backend) -> str | None:
            try:
                async with self.session.get(
                    backend.url + "/metrics", timeout=aiohttp.ClientTimeout(total=1.0)
                ) as resp:
                    return rewrite.kvpush_mode(await resp.text()) if resp.status == 200 else None
            except (TimeoutError, aiohttp.ClientError):
                return None

        modes = await asyncio.gather(mode_of(prefill), mode_of(decode))
        return rewrite.mode_conflict(self.config.mode, prefill, modes[0], decode, modes[1])

    async def _models(self, request: web.Request) -> web.StreamResponse:
        backend = self.pools["decode"].pick()
        try:
            async with self.session.get(backend.url + "/v1/models") as resp:
                return web.Response(
                    status=resp.status, body=await resp.read(), content_type="application/json"
                )
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = _transport_failure("decode", backend, exc, self.config)
            return error_response(failure.client_status, str(failure), "backend_error", backend.url)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        async def probe(backend: Backend) -> bool:
            try:
                async with self.session.get(
                    backend.url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)
                ) as resp:
                    return resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False

        report: dict[str, dict[str, bool]] = {}
        for role, pool in self.pools.items():
            results = await asyncio.gather(*(probe(b) for b in pool.backends))
            report[role] = {b.url: ok for b, ok in zip(pool.backends, results, strict=True)}
        healthy = all(any(r.values()) for r in report.values())
        return web.json_response(
            {"status": "ok" if healthy else "degraded", "mode": self.config.mode, **report},
            status=200 if healthy else 503,
        )

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


class _InFlight:
    def __init__(self, pool: Pool, gauge: Any, backend: Backend) -> None:
        self.pool, self.gauge, self.url = pool, gauge, backend.url

    def __enter__(self) -> None:
        self.pool.in_flight[self.url] = self.pool.in_flight.get(self.url, 0) + 1
        self.gauge.inc()

    def __exit__(self, *exc: object) -> None:
        self.pool.in_flight[self.url] -= 1
        self.gauge.dec()


class _Relay:
    """Writes decode's answer to the client; knows whether the client already got bytes."""

    def __init__(self, request: web.Request, started: float, metrics: Metrics) -> None:
        self.request = request
        self.started = started
        self.metrics = metrics
        self.response: web.StreamResponse | None = None
        self.prefill: Backend | None = None  # the prefill this request went to

    async def forward(self, resp: aiohttp.ClientResponse, backend: Backend) -> None:
        content_type = resp.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            data = await resp.read()
            self.metrics.ttft.labels(backend.url).observe(time.perf_counter() - self.started)
            self.response = web.Response(body=data, headers={"Content-Type": content_type})
            return
        stream = web.StreamResponse(
            headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        first = True
        async for chunk in resp.content.iter_any():
            if first:
                self.metrics.ttft.labels(backend.url).observe(time.perf_counter() - self.started)
                await stream.prepare(self.request)
                self.response = stream
                first = False
            await stream.write(chunk)
        if first:
            await stream.prepare(self.request)
            self.response = stream
        await stream.write_eof()

    async def fail(self, status: int, message: str, backend: str) -> web.StreamResponse:
        if self.response is None or not self.response.prepared:
            return error_response(status, message, "backend_error", backend)
        # Headers are gone already: tell the streaming client in-band, then end the stream.
        payload = json.dumps(error_body(message, "backend_error", backend))
        try:
            await self.response.write(f"data: {payload}\n\ndata: [DONE]\n\n".encode())
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return self.response


async def _describe(resp: aiohttp.ClientResponse) -> str:
    text = (await resp.text(errors="replace"))[:500]
    try:
        message = json.loads(text).get("error", {}).get("message") or text
    except (json.JSONDecodeError, AttributeError):
        message = text
    return f"HTTP {resp.status}: {message}"


def _transport_failure(
    role: str, backend: Backend, exc: BaseException, config: ProxyConfig
) -> BackendFailure:
    if isinstance(exc, asyncio.TimeoutError):
        return BackendFailure(
            role,
            backend,
            504,
            f"no answer within {config.request_timeout:g} s (raise --request-timeout if "
            "requests are legitimately this slow)",
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        return BackendFailure(
            role, backend, 502, f"cannot connect ({exc.os_error}); is it running?"
        )
    return BackendFailure(role, backend, 502, f"{type(exc).__name__}: {exc}")


def _error_kind(status: int) -> str:
    if status == 504:
        return "timeout"
    return "http_4xx" if 400 <= status < 500 else "upstream"


async def start_proxy(config: ProxyConfig, host: str, port: int) -> web.AppRunner:
    """Start serving on host:port and return the runner (call `runner.cleanup()` to stop)."""
    runner = web.AppRunner(Proxy(config).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner
