"""A request's two legs, pull or push, each resent elsewhere only where that is safe.

Pull: choose prefill (`balance.Pool.pick`) -> POST the prompt with max_tokens=1 -> read
prefill's kv_transfer_params -> choose decode, now, with fresh load -> POST the client's
request with those params -> relay decode's answer. Push: choose prefill and decode first,
send both legs at once with one request id; if either leg fails, the other is cancelled
(closing the HTTP connection makes vLLM abort the request and free its blocks).

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

When a decode leg fails after prefill answered, `handoff_cause` reads the pair's /metrics
for why (vLLM itself only answers "Internal server error").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpush.proxy import first_token, rewrite
from kvpush.proxy.backends import Backends
from kvpush.proxy.balance import BackendState
from kvpush.proxy.client import BackendClient
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.errors import LOST, UNSENT, BackendFailure, describe, transport_failure
from kvpush.proxy.first_token import Splice
from kvpush.proxy.fleet import ROLES
from kvpush.proxy.metrics import Metrics
from kvpush.proxy.relay import Relay
from kvpush.proxy.rewrite import Backend

log = logging.getLogger("kvpush.proxy")


@dataclass(frozen=True, slots=True)
class Job:
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


class Legs:
    """Sends a job's legs in the configured mode and relays decode's answer."""

    def __init__(
        self, config: ProxyConfig, backends: Backends, client: BackendClient, metrics: Metrics
    ) -> None:
        self.config = config
        self.backends = backends
        self.client = client
        self.metrics = metrics
        # kvpush:failures_total by kind, per backend URL, as last read after a failure.
        self._failures_seen: dict[str, dict[str, float]] = {}

    async def run(self, job: Job, relay: Relay) -> None:
        """Both legs of `job`; raises NoBackend or BackendFailure when the client gets none."""
        if self.config.first_token == "prefill" and first_token.eligible(job.body):
            if self.backends.prefill_may_give_first_token():
                relay.splice = Splice(chat="messages" in job.body)
            else:
                relay.decodes_own_first_token = True
        if self.config.mode == "pull":
            await self._pull(job, relay)
        else:
            await self._push(job, relay)

    def _may_retry(
        self,
        exc: BackendFailure,
        attempt: int,
        tried: set[str],
        safe: tuple[str, ...],
        relay: Relay,
    ) -> bool:
        # Pull's decode leg may go elsewhere after prefill's first token reached the client
        # (the new decode is pinned to it as well), not after any of decode's answer did.
        sent = relay.from_decode if self.config.mode == "pull" else relay.answered
        if exc.safety not in safe or attempt >= self.config.retries or sent:
            return False
        tried.add(exc.backend.url)
        if not self.backends.pools[exc.role].available(tried):
            return False
        self.metrics.retries.labels(exc.role, exc.safety).inc()
        log.info("sending the %s leg again, elsewhere: %s", exc.role, exc)
        return True

    async def _pull(self, job: Job, relay: Relay) -> None:
        self.backends.pools["decode"].ensure_available()  # before spending a prefill on it
        tried: set[str] = set()
        for attempt in itertools.count():
            prefill = self.backends.choose("prefill", job.prompt_tokens, tried)
            relay.prefill = prefill.backend
            try:
                params = await self._prefill(prefill, job, rewrite.pull_prefill_params(), relay)
                break
            except BackendFailure as exc:
                if not self._may_retry(exc, attempt, tried, (UNSENT, LOST), relay):
                    raise
        assert params is not None
        body = rewrite.decode_body(job.body, params)
        if relay.splice is not None:
            body = first_token.pin_pull(body, params) or body
        tried = set()
        for attempt in itertools.count():
            decode = self.backends.choose("decode", 1, tried)
            try:
                return await self._decode(decode, job, body, job.request_id, relay)
            except BackendFailure as exc:
                if not self._may_retry(exc, attempt, tried, (UNSENT,), relay):
                    raise

    async def _push(self, job: Job, relay: Relay) -> None:
        tried: dict[str, set[str]] = {role: set() for role in ROLES}
        for attempt in itertools.count():
            prefill = self.backends.choose("prefill", job.prompt_tokens, tried["prefill"])
            decode = self.backends.choose("decode", 1, tried["decode"])
            relay.prefill, relay.prefill_seconds = prefill.backend, None
            # A fresh transfer id per pair: nothing of an abandoned pair can match this one.
            rid = job.request_id if attempt == 0 else f"{job.request_id}-retry{attempt}"
            try:
                return await self._push_pair(job, prefill, decode, rid, relay)
            except BackendFailure as exc:
                if not self._may_retry(exc, attempt, tried[exc.role], (UNSENT,), relay):
                    raise

    async def _push_pair(
        self, job: Job, prefill: BackendState, decode: BackendState, rid: str, relay: Relay
    ) -> None:
        # A data-parallel prefill: decode registers with the engine chosen here, and
        # prefill's leg is pinned to it; the engine counts the leg until prefill answered
        dp_rank = self.backends.take_dp_rank(prefill.backend)
        taken = True

        def give_back(_: object = None) -> None:
            nonlocal taken
            if taken:
                taken = False
                self.backends.give_dp_rank(prefill.backend, dp_rank)

        try:
            await self._push_legs(job, prefill, decode, rid, relay, dp_rank, give_back)
        finally:
            give_back()

    async def _push_legs(
        self,
        job: Job,
        prefill: BackendState,
        decode: BackendState,
        rid: str,
        relay: Relay,
        dp_rank: int,
        prefill_done: Callable[[object], None],
    ) -> None:
        engine_id, _ = prefill.backend.engine(dp_rank)
        decode_body = rewrite.decode_body(
            job.body, rewrite.push_decode_params(prefill.backend, rid, dp_rank)
        )
        if relay.splice is not None:
            decode_body = first_token.pin_push(decode_body, rid)
        pinned = {rewrite.DP_RANK_HEADER: str(dp_rank)} if prefill.backend.dp_size > 1 else {}
        # Prefill's request goes out first: the client's first token is prefill's, and
        # its forward takes far longer than decode needs to register (decode's leg, sent
        # right after, still registers before prefill finishes). Sent the other way round,
        # prefill waited for the event loop to build and write decode's request.
        prefill_params = rewrite.push_prefill_params(rid, engine_id)
        prefill_task = asyncio.ensure_future(
            self._prefill(prefill, job, prefill_params, relay, rid, pinned)
        )
        prefill_task.add_done_callback(prefill_done)
        decode_task = asyncio.ensure_future(self._decode(decode, job, decode_body, rid, relay))
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
        job: Job,
        params: dict[str, Any],
        relay: Relay,
        rid: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | None:
        """The prefill leg; in pull mode returns the coordinates decode needs."""
        backend = state.backend
        started = time.perf_counter()
        flight = self.backends.flight("prefill", state, job.prompt_tokens, job.prompt_tokens)
        async with flight:
            answer = await self._post_json(
                backend,
                job.path,
                rewrite.prefill_body(job.body, params),
                {**job.headers(rid or job.request_id), **(headers or {})},
            )
            flight.answered()
            seconds = time.perf_counter() - started
            relay.prefill_seconds = seconds
            self.metrics.prefill.labels(backend.url).observe(seconds)
            coordinates = None
            ran_on = rewrite.misrouted(answer, params)
            if ran_on:
                raise BackendFailure("prefill", backend, 502, ran_on)
            if self.config.mode == "pull":
                try:
                    coordinates = rewrite.pull_decode_params(answer, backend)
                except ValueError as exc:
                    raise BackendFailure("prefill", backend, 502, str(exc)) from None
                if first_token.pulled_token(coordinates) is None:
                    relay.splice = None  # prefill sent no token to pin decode to
            await relay.prefill_answered(answer, backend)
            return coordinates

    async def _post_json(
        self, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        try:
            async with self.client.session.post(
                backend.url + path, json=body, headers=headers
            ) as resp:
                if resp.status != 200:
                    raise BackendFailure("prefill", backend, resp.status, await describe(resp))
                return await resp.json()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise transport_failure("prefill", backend, exc, self.config) from None

    async def _decode(
        self, state: BackendState, job: Job, body: dict[str, Any], rid: str, relay: Relay
    ) -> None:
        backend = state.backend
        async with self.backends.flight("decode", state, 1, job.decode_tokens) as flight:
            try:
                async with self.client.session.post(
                    backend.url + job.path, json=body, headers=job.headers(rid)
                ) as resp:
                    if resp.status != 200:
                        raise BackendFailure("decode", backend, resp.status, await describe(resp))
                    await relay.forward(resp, backend, flight.answered)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise transport_failure("decode", backend, exc, self.config) from None
        if relay.splice is not None and relay.splice.mismatch:
            self.backends.first_token_of(state, "own")  # its later streams: decode's token

    async def handoff_cause(self, prefill: Backend, decode: Backend) -> str | None:
        """What the pair's /metrics say about a failed handoff: a mode mismatch, or which
        of kvpush's failure counters grew since the last such reading (vLLM itself only
        answers "Internal server error")."""
        texts = await asyncio.gather(
            self.client.metrics(prefill.url, 1.0), self.client.metrics(decode.url, 1.0)
        )
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
