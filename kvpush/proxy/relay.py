"""Decode's answer to the client: relayed whole or streamed chunk by chunk (its first token
possibly from prefill, `kvpush.proxy.first_token`), with TTFT timed at the client's first
byte; an error after the stream began is told in-band.

vLLM reports a request that fails after its stream began (a KV transfer that failed or
timed out while decode waited) with an event in the stream, `data: {"error": ...}`, whose
message is only "Internal server error". The relay stops at such an event and fails the
leg (`BackendFailure`), so the client hears which backend failed and why, as for an
error before the stream: an HTTP error where nothing was sent yet, else in-band."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.proxy.errors import BackendFailure, error_body, error_response
from kvpush.proxy.first_token import Splice
from kvpush.proxy.metrics import Metrics
from kvpush.proxy.rewrite import Backend

log = logging.getLogger("kvpush.proxy")
_EVENT_STREAM = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_ERROR_EVENT = b'data: {"error"'  # how vLLM's streams begin an error event


def stream_error(chunk: bytes) -> tuple[bytes, int, str] | None:
    """Where `chunk` of a backend's event stream holds an error event: the bytes before
    it, the error's status code and its message. Text inside a token is JSON-escaped, so
    it cannot start an event this way. An event split across chunks is seen once whole
    (`error_start` holds its start back)."""
    at = chunk.find(_ERROR_EVENT)
    while at > 0 and chunk[at - 1 : at] != b"\n":
        at = chunk.find(_ERROR_EVENT, at + 1)
    if at < 0:
        return None
    end = chunk.find(b"\n\n", at)
    status, message = 500, "an error event without a message"
    try:
        error = json.loads(chunk[at + 5 : end if end >= 0 else len(chunk)])["error"]
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code
        message = str(error.get("message") or message)
    except (ValueError, TypeError, AttributeError, KeyError):
        pass
    return chunk[:at], status, message


def error_start(chunk: bytes) -> int:
    """Where an error event that has not fully arrived may begin in `chunk`: its last line,
    if that is the start of one (`len(chunk)` if not). vLLM writes each event whole, so
    this holds nothing back from its streams; a split one is relayed once complete."""
    start = chunk.rfind(b"\n") + 1
    tail = chunk[start:]
    if tail and (_ERROR_EVENT.startswith(tail) or tail.startswith(_ERROR_EVENT)):
        return start
    return len(chunk)


class Relay:
    """Writes decode's answer to the client; knows whether the client already got bytes."""

    def __init__(
        self,
        request: web.Request,
        started: float,
        metrics: Metrics,
        chunk_log: list[tuple[float, int]] | None = None,
    ) -> None:
        self.request = request
        self.started = started
        self.metrics = metrics
        self.response: web.StreamResponse | None = None
        self.prefill: Backend | None = None  # the prefill this request went to
        self.prefill_seconds: float | None = None  # how long its leg took, once it answered
        # (time.monotonic(), bytes) of each streamed chunk from decode, when being traced
        self.chunk_log = chunk_log
        self.splice: Splice | None = None  # set when the first token may come from prefill
        # a stream that would have been spliced, but its decode samples its own first token:
        # counted as decode's first token once it ends
        self.decodes_own_first_token = False
        self._writing = asyncio.Lock()  # prefill's token and decode's bytes, in order
        self.from_decode = False  # some of decode's answer reached the client
        self.complete = False  # decode's whole streamed answer was written to the client

    @property
    def answered(self) -> bool:
        return self.response is not None and self.response.prepared

    def _first_byte(self, backend: Backend, on_first_byte: Callable[[], None]) -> None:
        """Decode's first byte: the handoff is over."""
        if self.response is None and self.splice is None:  # spliced: timed as it is written
            self._client_first_byte(backend)
        if self.prefill_seconds is not None:
            handoff = time.perf_counter() - self.started - self.prefill_seconds
            self.metrics.handoff.labels(backend.url).observe(max(handoff, 0))
        on_first_byte()

    def _client_first_byte(self, backend: Backend) -> None:
        self.metrics.ttft.labels(backend.url).observe(time.perf_counter() - self.started)

    async def _stream(self, data: bytes, backend: Backend) -> None:
        """Write streamed bytes, starting the client's stream at the first."""
        async with self._writing:
            if self.response is None:
                self._client_first_byte(backend)
                self.response = web.StreamResponse(headers=_EVENT_STREAM)
                await self.response.prepare(self.request)
            await self.response.write(data)

    async def prefill_answered(self, answer: Any, backend: Backend) -> None:
        """Prefill's answer is in: its first token goes to the client if it still can."""
        if self.splice is None:
            return
        data = self.splice.prefill_answer(answer)
        if data:
            self.metrics.first_token.labels("prefill").inc()
            await self._stream(data, backend)

    async def forward(
        self, resp: aiohttp.ClientResponse, backend: Backend, on_first_byte: Callable[[], None]
    ) -> None:
        if self.splice is not None:
            return await self._spliced(resp, backend, on_first_byte, self.splice)
        content_type = resp.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            data = await resp.read()
            self._first_byte(backend, on_first_byte)
            self.from_decode = True
            self.response = web.Response(body=data, headers={"Content-Type": content_type})
            return
        stream = web.StreamResponse(
            headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        async for chunk in self._chunks(resp, backend, on_first_byte):
            if self.response is None:
                self.from_decode = True
                await stream.prepare(self.request)
                self.response = stream
            await stream.write(chunk)
        if self.response is None:
            await stream.prepare(self.request)
            self.response = stream
        if self.decodes_own_first_token:
            self.metrics.first_token.labels("decode").inc()
        await stream.write_eof()
        self.complete = True

    async def _chunks(
        self, resp: aiohttp.ClientResponse, backend: Backend, on_first_byte: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        """Decode's streamed bytes as they come, its first byte timed, up to an error event
        (module doc), which fails the leg."""
        first = True
        held = b""  # the start of what may be an error event, until the rest of it comes
        async for chunk in resp.content.iter_any():
            if self.chunk_log is not None:
                self.chunk_log.append((time.monotonic(), len(chunk)))
            if held:
                chunk, held = held + chunk, b""
            failed = stream_error(chunk)
            if failed is not None:
                chunk = failed[0]
            else:
                cut = error_start(chunk)
                chunk, held = chunk[:cut], chunk[cut:]
            if chunk:
                if first:
                    self._first_byte(backend, on_first_byte)
                    first = False
                yield chunk
            if failed is not None:
                _, status, message = failed
                raise BackendFailure("decode", backend, status, f"failed mid-stream: {message}")
        if held:  # the stream ended inside it
            failed = stream_error(held)
            if failed is not None:
                _, status, message = failed
                raise BackendFailure("decode", backend, status, f"failed mid-stream: {message}")
            if first:
                self._first_byte(backend, on_first_byte)
            yield held

    async def _spliced(
        self,
        resp: aiohttp.ClientResponse,
        backend: Backend,
        on_first_byte: Callable[[], None],
        splice: Splice,
    ) -> None:
        async for chunk in self._chunks(resp, backend, on_first_byte):
            data = splice.decode_bytes(chunk)
            if data:
                self.from_decode = True
                await self._stream(data, backend)
        await self._stream(splice.flush(), backend)
        if not splice.sent_early:
            self.metrics.first_token.labels("decode").inc()
        elif splice.mismatch:
            self.metrics.first_token.labels("mismatch").inc()
            log.error(
                "decode %s did not produce prefill's first token, so this client got a "
                "first token decode did not continue from; is decode running kvpush's "
                "logits processor (kvpush installed in its environment, no speculative "
                "decoding)? Streams take their first token from decode from now on; "
                "--first-token decode says so from the start",
                backend.url,
            )
        assert self.response is not None
        await self.response.write_eof()
        self.complete = True

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
