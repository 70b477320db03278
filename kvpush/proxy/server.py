"""The OpenAI-compatible P/D proxy: aiohttp server and client on one event loop.

One request's path, pull mode: choose prefill (`balance.Pool.pick`) -> POST the prompt with
max_tokens=1 -> read prefill's kv_transfer_params -> choose decode, now, with fresh load ->
POST the client's request with those params -> relay decode's answer (streamed chunk by
chunk, or whole). Push mode: choose prefill and decode first, send both legs at once with
one request id; if either leg fails, the other is cancelled (closing the HTTP connection
makes vLLM abort the request and free its blocks) and the client gets an error naming the
backend.

Retries resend a leg only where that cannot pair KV wrongly or run a request twice where
it matters (each at most `retries` times, to a backend not yet tried for the request):
- pull prefill: when the request never reached the backend (connection refused) or the
  backend vanished before answering (connection lost, or ejected while the leg ran);
  nothing downstream depends on a prefill that did not answer;
- pull decode: only when the request never reached it; prefill's blocks wait for any reader;
- push: only when a leg never reached its backend and the client has no byte yet. Both
  legs are then cancelled and sent again as a new pair with a new transfer id, because
  decode's registration is tied to the prefill it was told about; a prefill that may have
  run must never be paired with a new decode, nor a new prefill with a decode that may
  have registered elsewhere.

`monitor.Monitor` runs the health checks, the optional /metrics scrape and the fleet-file
reload in the background; a backend ejected while legs run on it aborts those legs at once.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpush.proxy import rewrite
from kvpush.proxy.balance import (
    BackendState,
    Change,
    NoBackend,
    Pool,
)
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.fleet import ROLES, Fleet, check_backend, check_fleet, check_role
from kvpush.proxy.monitor import TIMED_OUT, Monitor, probe_health
from kvpush.proxy.rewrite import Backend, RequestError

log = logging.getLogger("kvpush.proxy")

PROXY_KEY: web.AppKey[Proxy] = web.AppKey("kvpush.proxy")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
KEY_REFUSED = (401, 403)
UNSENT = "unsent"  # the request never left the proxy (the connection was refused)
LOST = "lost"  # the backend went away before answering


class BackendFailure(Exception):
    """A leg failed; carries what the client is told, which backend is to blame, and
    whether the request may be sent elsewhere (`safety`: UNSENT, LOST or "")."""

    def __init__(
        self, role: str, backend: Backend, status: int, detail: str, safety: str = ""
    ) -> None:
        super().__init__(f"{role} backend {backend.url}: {detail}")
        self.role = role
        self.backend = backend
        self.status = status
        self.detail = detail
        self.safety = safety

    @property
    def client_status(self) -> int:
        # A 4xx from vLLM is about the request (bad prompt, too long): pass it through, but
        # a refused API key is the proxy's (--backend-api-key), not the client's. Anything
        # else is the proxy's upstream failing: 502, or 504 for a timeout.
        if self.status in KEY_REFUSED:
            return 502
        return self.status if 400 <= self.status < 500 else (504 if self.status == 504 else 502)


class _FleetCollector(Collector):
    """Per-backend gauges, read from the pools when /metrics is scraped."""

    def __init__(self, pools: dict[str, Pool]) -> None:
        self.pools = pools

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(
                f"kvpush_proxy_backend_{name}", doc, labels=["role", "backend"]
            )

        in_flight = gauge("in_flight", "Legs in flight per backend")
        tokens = gauge(
            "in_flight_tokens",
            "Tokens of the legs in flight (prefill: prompt; decode: prompt + max output), "
            "estimated at 4 characters a token",
        )
        healthy = gauge("healthy", "1 while the backend gets new requests, 0 while ejected")
        speed = gauge(
            "seconds_per_unit",
            "The proxy's estimate of the backend's speed: prefill seconds per prompt token, "
            "decode seconds to the first byte",
        )
        waiting = gauge("reported_waiting", "vllm:num_requests_waiting at the last scrape")
        running = gauge("reported_running", "vllm:num_requests_running at the last scrape")
        kv_usage = gauge("reported_kv_usage", "vllm:kv_cache_usage_perc at the last scrape")
        for role, pool in self.pools.items():
            for s in pool:
                labels = [role, s.url]
                in_flight.add_metric(labels, s.in_flight)
                tokens.add_metric(labels, s.tokens)
                healthy.add_metric(labels, 1.0 if s.healthy else 0.0)
                if s.estimate is not None:
                    speed.add_metric(labels, s.estimate)
                if s.reported is not None:
                    waiting.add_metric(labels, s.reported.waiting)
                    running.add_metric(labels, s.reported.running)
                    if s.reported.kv_usage is not None:
                        kv_usage.add_metric(labels, s.reported.kv_usage)
        return [in_flight, tokens, healthy, speed, waiting, running, kv_usage]


class Metrics:
    def __init__(self, pools: dict[str, Pool]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(pools))
        self.requests = Counter(
            "kvpush_proxy_requests",
            "Client requests by outcome",
            ["mode", "outcome"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvpush_proxy_backend_errors",
            "Failed legs per backend",
            ["role", "backend", "kind"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "kvpush_proxy_backend_ejections",
            "Times a backend was taken out of the choice (failed health checks, refused "
            "connections)",
            ["role", "backend"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvpush_proxy_retries",
            "Legs sent again to another backend, by why that was safe (unsent, lost)",
            ["role", "cause"],
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
            "Duration of the prefill leg (prefill-side TTFT)",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.handoff = Histogram(
            "kvpush_proxy_handoff_seconds",
            "TTFT at the proxy minus the prefill leg's duration, per decode backend: the KV "
            "handoff plus waiting at decode",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


def error_body(status: int, message: str, kind: str, backend: str | None = None) -> dict[str, Any]:
    """An error as vLLM and OpenAI's API shape it: {"error": {"message", "type", "code"}}
    (code: the HTTP status), plus the backend to blame where there is one."""
    err: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if backend:
        err["backend"] = backend
    return {"error": err}


def error_response(
    status: int, message: str, kind: str, backend: str | None = None
) -> web.Response:
    return web.json_response(error_body(status, message, kind, backend), status=status)


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


def bearer_matches(header: str, secret: str) -> bool:
    """Whether an Authorization header is 'Bearer SECRET', in constant time. Compared as
    bytes, so a header that is not ASCII is simply wrong (str comparison would raise)."""
    sent = header.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(sent, f"Bearer {secret}".encode())


@dataclass(frozen=True, slots=True)
class _Job:
    """One client request, as both legs need it."""

    path: str
    body: dict[str, Any]
    request_id: str
    prompt_tokens: int
    decode_tokens: int
    trace: dict[str, str]  # the client's W3C trace context, passed on to both legs

    def headers(self, rid: str) -> dict[str, str]:
        """A leg's headers (the backend's API key is the session's)."""
        return {"X-Request-Id": rid, **self.trace}


class Proxy:
    """The proxy's state (backend pools, metrics, HTTP client) and its request handlers."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.pools = {role: Pool(role, config.policies[role], config.health) for role in ROLES}
        for backend in config.prefill:
            self.pools["prefill"].add(backend)
        for backend in config.decode:
            self.pools["decode"].add(backend)
        self.metrics = Metrics(self.pools)
        self.monitor = Monitor(self)
        self._flights: dict[BackendState, set[_Flight]] = {}
        # kvpush:failures_total by kind, per backend URL, as last read after a failure.
        self._failures_seen: dict[str, dict[str, float]] = {}
        self._session: aiohttp.ClientSession | None = None
        self.draining = False  # set at SIGTERM: /ready answers 503, requests in flight finish
        self.in_flight = 0  # client requests being answered
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=self.config.request_timeout, sock_connect=self.config.connect_timeout
            )
            key = self.config.backend_api_key
            # On every leg, health check and /metrics read: vLLM started with --api-key
            # refuses /v1/* without it, and sending it elsewhere does no harm.
            headers = {"Authorization": f"Bearer {key}"} if key else None
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                headers=headers,
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            )
        return self._session

    async def close(self) -> None:
        await self.monitor.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        app.router.add_get("/admin/backends", self._admin_list)
        app.router.add_post("/admin/backends", self._admin_add)
        app.router.add_delete("/admin/backends", self._admin_remove)

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
        outcomes: dict[str, int] = {}
        for metric in self.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["outcome"]
                    outcomes[key] = outcomes.get(key, 0) + int(sample.value)
        done = ", ".join(f"{v} {k}" for k, v in sorted(outcomes.items())) or "no requests yet"
        busy = ", ".join(
            f"{role} {sum(s.in_flight for s in pool)}" for role, pool in self.pools.items()
        )
        line = f"requests: {done} | in flight: {busy}"
        ejected = [s.url for pool in self.pools.values() for s in pool if not s.healthy]
        return f"{line} | ejected: {', '.join(ejected)}" if ejected else line

    # -- fleet and health (called by the admin API and the monitor) ---------------------

    def apply_fleet(self, fleet: Fleet) -> list[str]:
        """Make the pools hold exactly `fleet`'s backends; returns what changed."""
        check_fleet(self.config.mode, fleet)
        changes = []
        for role in ROLES:
            pool = self.pools[role]
            wanted = {b.url: b for b in fleet.of(role)}
            for state in list(pool):
                if wanted.get(state.url) != state.backend:
                    pool.remove(state.url)
                    changes.append(f"removed {role} {state.url}")
            for url, backend in wanted.items():
                if pool.find(url) is None:
                    pool.add(backend)
                    changes.append(f"added {role} {rewrite.format_backend(backend)}")
        return changes

    def checked(self, role: str, state: BackendState, problem: str | None) -> None:
        """Record a health check (problem None: it passed).

        A check that timed out says the backend is slow, not gone: the last healthy backend
        of a role is not ejected for that (ejecting it would turn one overloaded server into
        a 503 for every request; its requests stay bounded by --request-timeout). Errors and
        refused connections still eject it.
        """
        slow = problem is not None and problem.startswith(TIMED_OUT)
        others = [s for s in self.pools[role] if s.healthy and s is not state]
        if slow and state.healthy and not others:
            log.info("%s backend %s: %s; kept, as the last healthy one", role, state.url, problem)
            return
        change = self.pools[role].checked(state, problem is None, problem or "")
        if change is Change.EJECTED:
            self._ejected(role, state)
        elif change is Change.RETURNED:
            log.info("%s backend %s passed its health checks and is back", role, state.url)

    def eject(self, role: str, state: BackendState, reason: str) -> None:
        if self.pools[role].eject(state, reason) is Change.EJECTED:
            self._ejected(role, state)

    def _ejected(self, role: str, state: BackendState) -> None:
        self.metrics.ejections.labels(role, state.url).inc()
        flights = list(self._flights.get(state, ()))
        log.warning(
            "%s backend %s ejected (%s); aborting %d legs on it",
            role,
            state.url,
            state.reason,
            len(flights),
        )
        for flight in flights:
            flight.abort(state.reason)

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
        key = self.config.api_key
        if (
            key
            and request.path.startswith("/v1/")
            and not bearer_matches(request.headers.get("Authorization", ""), key)
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
        prompt_tokens = rewrite.estimate_prompt_tokens(body)
        job = _Job(
            request.path,
            body,
            rewrite.leg_id(request[REQUEST_ID], request.headers.get("X-Request-Id")),
            prompt_tokens,
            prompt_tokens + rewrite.requested_output_tokens(body),
            rewrite.trace_headers(request.headers),
        )
        relay = _Relay(request, time.perf_counter(), self.metrics)
        try:
            if mode == "pull":
                await self._pull(job, relay)
            else:
                await self._push(job, relay)
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
                cause = await self._handoff_cause(relay.prefill, exc.backend)
                if cause:
                    message = f"{message}; {cause}"
            log.warning("request %s failed: %s", job.request_id, message)
            return await relay.fail(exc.client_status, message, exc.backend.url)
        self.metrics.requests.labels(mode, "ok").inc()
        assert relay.response is not None
        return relay.response

    def _choose(self, role: str, units: float, tried: set[str]) -> BackendState:
        return self.pools[role].pick(units, time.monotonic(), tried)

    def _may_retry(
        self,
        exc: BackendFailure,
        attempt: int,
        tried: set[str],
        safe: tuple[str, ...],
        relay: _Relay,
    ) -> bool:
        if exc.safety not in safe or attempt >= self.config.retries or relay.answered:
            return False
        tried.add(exc.backend.url)
        if not self.pools[exc.role].available(tried):
            return False
        self.metrics.retries.labels(exc.role, exc.safety).inc()
        log.info("sending the %s leg again, elsewhere: %s", exc.role, exc)
        return True

    async def _pull(self, job: _Job, relay: _Relay) -> None:
        self.pools["decode"].ensure_available()  # before spending a prefill on it
        tried: set[str] = set()
        for attempt in itertools.count():
            prefill = self._choose("prefill", job.prompt_tokens, tried)
            relay.prefill = prefill.backend
            try:
                params = await self._prefill(prefill, job, rewrite.pull_prefill_params(), relay)
                break
            except BackendFailure as exc:
                if not self._may_retry(exc, attempt, tried, (UNSENT, LOST), relay):
                    raise
        assert params is not None
        body = rewrite.decode_body(job.body, params)
        tried = set()
        for attempt in itertools.count():
            decode = self._choose("decode", 1, tried)
            try:
                return await self._decode(decode, job, body, job.request_id, relay)
            except BackendFailure as exc:
                if not self._may_retry(exc, attempt, tried, (UNSENT,), relay):
                    raise

    async def _push(self, job: _Job, relay: _Relay) -> None:
        tried: dict[str, set[str]] = {role: set() for role in ROLES}
        for attempt in itertools.count():
            prefill = self._choose("prefill", job.prompt_tokens, tried["prefill"])
            decode = self._choose("decode", 1, tried["decode"])
            relay.prefill, relay.prefill_seconds = prefill.backend, None
            # A fresh transfer id per pair: nothing of an abandoned pair can match this one.
            rid = job.request_id if attempt == 0 else f"{job.request_id}-retry{attempt}"
            try:
                return await self._push_pair(job, prefill, decode, rid, relay)
            except BackendFailure as exc:
                if not self._may_retry(exc, attempt, tried[exc.role], (UNSENT,), relay):
                    raise

    async def _push_pair(
        self, job: _Job, prefill: BackendState, decode: BackendState, rid: str, relay: _Relay
    ) -> None:
        decode_body = rewrite.decode_body(
            job.body, rewrite.push_decode_params(prefill.backend, rid)
        )
        # Decode first: the sooner it registers its blocks, the sooner prefill can write.
        decode_task = asyncio.ensure_future(self._decode(decode, job, decode_body, rid, relay))
        prefill_task = asyncio.ensure_future(
            self._prefill(prefill, job, rewrite.push_prefill_params(rid), relay, rid)
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
        self,
        state: BackendState,
        job: _Job,
        params: dict[str, Any],
        relay: _Relay,
        rid: str | None = None,
    ) -> dict[str, Any] | None:
        """The prefill leg; in pull mode returns the coordinates decode needs."""
        backend = state.backend
        started = time.perf_counter()
        async with _Flight(self, "prefill", state, job.prompt_tokens, job.prompt_tokens) as flight:
            answer = await self._post_json(
                backend,
                job.path,
                rewrite.prefill_body(job.body, params),
                job.headers(rid or job.request_id),
            )
            flight.answered()
            seconds = time.perf_counter() - started
            relay.prefill_seconds = seconds
            self.metrics.prefill.labels(backend.url).observe(seconds)
            if self.config.mode != "pull":
                return None
            try:
                return rewrite.pull_decode_params(answer, backend)
            except ValueError as exc:
                raise BackendFailure("prefill", backend, 502, str(exc)) from None

    async def _post_json(
        self, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        try:
            async with self.session.post(backend.url + path, json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise BackendFailure("prefill", backend, resp.status, await _describe(resp))
                return await resp.json()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _transport_failure("prefill", backend, exc, self.config) from None

    async def _decode(
        self, state: BackendState, job: _Job, body: dict[str, Any], rid: str, relay: _Relay
    ) -> None:
        backend = state.backend
        async with _Flight(self, "decode", state, 1, job.decode_tokens) as flight:
            try:
                async with self.session.post(
                    backend.url + job.path, json=body, headers=job.headers(rid)
                ) as resp:
                    if resp.status != 200:
                        raise BackendFailure("decode", backend, resp.status, await _describe(resp))
                    await relay.forward(resp, backend, flight.answered)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise _transport_failure("decode", backend, exc, self.config) from None

    async def _handoff_cause(self, prefill: Backend, decode: Backend) -> str | None:
        """What the pair's /metrics say about a failed handoff: a mode mismatch, or which
        of kvpush's failure counters grew since the last such reading (vLLM itself only
        answers "Internal server error")."""

        async def metrics_of(backend: Backend) -> str | None:
            try:
                async with self.session.get(
                    backend.url + "/metrics", timeout=aiohttp.ClientTimeout(total=1.0)
                ) as resp:
                    return await resp.text() if resp.status == 200 else None
            except (TimeoutError, aiohttp.ClientError):
                return None

        texts = await asyncio.gather(metrics_of(prefill), metrics_of(decode))
        modes = [rewrite.kvpush_mode(t) if t else None for t in texts]
        conflict = rewrite.mode_conflict(self.config.mode, prefill, modes[0], decode, modes[1])
        if conflict:
            return conflict
        causes = []
        for role, backend, text in (("decode", decode, texts[1]), ("prefill", prefill, texts[0])):
            if not text:
                continue
            counts = rewrite.kvpush_failures(text)
            grown = rewrite.failure_growth(self._failures_seen.get(backend.url), counts)
            self._failures_seen[backend.url] = counts
            if grown:
                causes.append(f"{role} {backend.url}: {grown}")
        if not causes:
            return None
        return "kvpush counted failed transfers (kvpush:failures_total) on " + "; ".join(causes)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            backend = self._choose("decode", 0, set()).backend
        except NoBackend as exc:
            return error_response(503, str(exc), "backend_error")
        try:
            async with self.session.get(backend.url + "/v1/models") as resp:
                if resp.status in KEY_REFUSED:  # the proxy's key, not the client's
                    failure = BackendFailure("decode", backend, resp.status, await _describe(resp))
                else:
                    return web.Response(
                        status=resp.status, body=await resp.read(), content_type="application/json"
                    )
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = _transport_failure("decode", backend, exc, self.config)
        return error_response(failure.client_status, str(failure), "backend_error", backend.url)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        """Checks every backend now (each probe counts as a health check); a backend is ok
        when it answers and takes requests; a role with none ok makes the proxy degraded."""
        report: dict[str, Any] = {}
        ejected: dict[str, str] = {}
        for role, pool in self.pools.items():
            states = list(pool)
            problems = await asyncio.gather(
                *(probe_health(self.session, s.url, 2.0) for s in states)
            )
            for state, problem in zip(states, problems, strict=True):
                self.checked(role, state, problem)
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
        missing = [role for role in ROLES if not self.pools[role].available()]
        if missing:
            reason = "no healthy backend: " + ", ".join(missing)
            return web.json_response({"status": "unavailable", "reason": reason}, status=503)
        return web.json_response({"status": "ready"})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    # -- admin API ----------------------------------------------------------------------

    def _admin_refusal(self, request: web.Request) -> web.Response | None:
        token = self.config.admin_token
        if not token:
            return error_response(
                403,
                "the admin API is off: start the proxy with --admin-token TOKEN "
                "(or $KVPUSH_ADMIN_TOKEN)",
                "permission_error",
            )
        if not bearer_matches(request.headers.get("Authorization", ""), token):
            return error_response(
                401,
                "missing or wrong admin token: send 'Authorization: Bearer <admin token>'",
                "authentication_error",
            )
        return None

    async def _admin_body(self, request: web.Request, *keys: str) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict) or any(not isinstance(body.get(k), str) for k in keys):
            fields = ", ".join(f'"{k}": "..."' for k in keys)
            raise ValueError(f"expected a JSON object {{{fields}}}")
        body["role"] = check_role(body["role"])
        return body

    async def _admin_list(self, request: web.Request) -> web.StreamResponse:
        refusal = self._admin_refusal(request)
        if refusal:
            return refusal
        now = time.monotonic()
        view: dict[str, Any] = {"mode": self.config.mode, "policies": self.config.policies}
        for role, pool in self.pools.items():
            view[role] = [_state_view(pool, s, now) for s in pool]
        return web.json_response(view)

    async def _admin_add(self, request: web.Request) -> web.StreamResponse:
        refusal = self._admin_refusal(request)
        if refusal:
            return refusal
        try:
            body = await self._admin_body(request, "role", "backend")
            backend = check_backend(
                self.config.mode, body["role"], rewrite.parse_backend(body["backend"])
            )
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        pool = self.pools[body["role"]]
        try:
            state = pool.add(backend)
        except ValueError as exc:
            return error_response(409, f"{exc}; remove it first to change it", "conflict")
        log.info("admin: added %s backend %s", body["role"], rewrite.format_backend(backend))
        return web.json_response(_state_view(pool, state, time.monotonic()), status=201)

    async def _admin_remove(self, request: web.Request) -> web.StreamResponse:
        refusal = self._admin_refusal(request)
        if refusal:
            return refusal
        try:
            body = await self._admin_body(request, "role", "url")
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        role, url = body["role"], body["url"].rstrip("/")
        pool = self.pools[role]
        if len(pool) == 1 and pool.find(url) is not None:
            return error_response(
                409, f"{url} is the last {role} backend; add another one first", "conflict"
            )
        try:
            state = pool.remove(url)
        except ValueError as exc:
            return error_response(404, str(exc), "not_found_error")
        log.info("admin: removed %s backend %s (%d legs finishing)", role, url, state.in_flight)
        return web.json_response({"removed": url, "role": role, "finishing": state.in_flight})


def _state_view(pool: Pool, state: BackendState, now: float) -> dict[str, Any]:
    reported = state.reported
    return {
        "url": state.url,
        "backend": rewrite.format_backend(state.backend),
        "healthy": state.healthy,
        "ejected_because": state.reason or None,
        "ejections": state.ejections,
        "in_flight": state.in_flight,
        "in_flight_tokens": state.tokens,
        "seconds_per_unit": state.estimate,
        "expected_seconds": pool.cost(state, 1.0, now),
        "reported": None
        if reported is None
        else {
            "running": reported.running,
            "waiting": reported.waiting,
            "kv_usage": reported.kv_usage,
        },
    }


class _Flight:
    """One leg in flight on one backend: its share of the backend's load, and a scope that
    ends the leg at once if the backend is ejected meanwhile (no request waits on a dead
    backend). Failures leaving it are counted; a refused connection ejects the backend."""

    __slots__ = ("proxy", "role", "leg", "scope", "aborted")

    def __init__(
        self, proxy: Proxy, role: str, state: BackendState, units: float, tokens: int
    ) -> None:
        self.proxy = proxy
        self.role = role
        self.leg = proxy.pools[role].begin(state, units, tokens, time.monotonic())
        self.scope = asyncio.timeout(None)
        self.aborted = ""

    def answered(self) -> None:
        self.proxy.pools[self.role].first_byte(self.leg, time.monotonic())

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self.scope.reschedule(asyncio.get_running_loop().time())

    async def __aenter__(self) -> _Flight:
        await self.scope.__aenter__()
        self.proxy._flights.setdefault(self.leg.state, set()).add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state = self.leg.state
        flights = self.proxy._flights[state]
        flights.discard(self)
        if not flights:
            del self.proxy._flights[state]
        self.proxy.pools[self.role].end(self.leg)
        try:
            await self.scope.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not self.aborted:
                raise
            exc = BackendFailure(
                self.role, state.backend, 502, f"ejected while in flight ({self.aborted})", LOST
            )
            self._count(exc)
            raise exc from None
        if isinstance(exc, BackendFailure):
            self._count(exc)
            if exc.safety == UNSENT:
                self.proxy.eject(self.role, state, exc.detail)

    def _count(self, exc: BackendFailure) -> None:
        self.proxy.metrics.errors.labels(self.role, exc.backend.url, _error_kind(exc)).inc()


class _Relay:
    """Writes decode's answer to the client; knows whether the client already got bytes."""

    def __init__(self, request: web.Request, started: float, metrics: Metrics) -> None:
        self.request = request
        self.started = started
        self.metrics = metrics
        self.response: web.StreamResponse | None = None
        self.prefill: Backend | None = None  # the prefill this request went to
        self.prefill_seconds: float | None = None  # how long its leg took, once it answered

    @property
    def answered(self) -> bool:
        return self.response is not None and self.response.prepared

    def _first_byte(self, backend: Backend, on_first_byte: Callable[[], None]) -> None:
        ttft = time.perf_counter() - self.started
        self.metrics.ttft.labels(backend.url).observe(ttft)
        if self.prefill_seconds is not None:
            self.metrics.handoff.labels(backend.url).observe(max(ttft - self.prefill_seconds, 0))
        on_first_byte()

    async def forward(
        self, resp: aiohttp.ClientResponse, backend: Backend, on_first_byte: Callable[[], None]
    ) -> None:
        content_type = resp.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            data = await resp.read()
            self._first_byte(backend, on_first_byte)
            self.response = web.Response(body=data, headers={"Content-Type": content_type})
            return
        stream = web.StreamResponse(
            headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        first = True
        async for chunk in resp.content.iter_any():
            if first:
                self._first_byte(backend, on_first_byte)
                await stream.prepare(self.request)
                self.response = stream
                first = False
            await stream.write(chunk)
        if first:
            await stream.prepare(self.request)
            self.response = stream
        await stream.write_eof()

    async def fail(self, status: int, message: str, backend: str | None) -> web.StreamResponse:
        kind = "backend_error"
        if self.response is None or not self.response.prepared:
            return error_response(status, message, kind, backend)
        # Headers are gone already: tell the streaming client in-band, then end the stream.
        payload = json.dumps(error_body(status, message, kind, backend))
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
    if resp.status in KEY_REFUSED:
        message += (
            "; the backend wants an API key: give the proxy --backend-api-key KEY (or "
            "$KVPUSH_BACKEND_API_KEY), the --api-key its vLLM servers were started with"
        )
    return f"HTTP {resp.status}: {message}"


def _transport_failure(
    role: str, backend: Backend, exc: BaseException, config: ProxyConfig
) -> BackendFailure:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        detail = f"cannot connect within --connect-timeout {config.connect_timeout:g} s"
        return BackendFailure(role, backend, 502, detail, UNSENT)
    if isinstance(exc, asyncio.TimeoutError):
        return BackendFailure(
            role,
            backend,
            504,
            f"no answer within {config.request_timeout:g} s (raise --request-timeout if "
            "requests are legitimately this slow)",
        )
    if isinstance(exc, aiohttp.ClientConnectorError):
        detail = f"cannot connect ({exc.os_error}); is it running?"
        return BackendFailure(role, backend, 502, detail, UNSENT)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return BackendFailure(role, backend, 502, f"connection lost ({exc})", LOST)
    return BackendFailure(role, backend, 502, f"{type(exc).__name__}: {exc}")


def _error_kind(exc: BackendFailure) -> str:
    if exc.status == 504:
        return "timeout"
    if exc.safety:
        return exc.safety
    return "http_4xx" if 400 <= exc.status < 500 else "upstream"


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


def use_uvloop() -> None:
    """Run asyncio on uvloop when it is installed (faster parsing and scheduling)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
