"""Decode's answer to the client: relayed whole or streamed chunk by chunk, with TTFT timed
at its first byte; an error after the stream began is told in-band."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvpush.proxy.errors import error_body, error_response
from kvpush.proxy.metrics import Metrics
from kvpush.proxy.rewrite import Backend


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
            if self.chunk_log is not None:
                self.chunk_log.append((time.monotonic(), len(chunk)))
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
