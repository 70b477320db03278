"""A fake vLLM backend speaking just enough of the OpenAI API to test and benchmark the proxy.

It answers instantly (or after `delay`; streamed tokens `token_gap` apart), records every
request it got (unless `record` is off, as in the benchmark), can require an API key on
every route (stricter than vLLM's --api-key, which guards /v1/* only), and can be told to
fail: return an HTTP error (its /health then answers 503), fail a stream after some tokens
as vLLM does (an error event), or hang, /health included, until the client gives up. Not a
model: the text it returns is fixed, so what a test checks is the proxy's plumbing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpush.core.protocol import FIRST_TOKEN_PARAM, MISROUTED_PARAM


@dataclass(slots=True)
class StubBehaviour:
    status: int = 200
    hang: bool = False
    delay: float = 0.0
    token_gap: float = 0.0
    first_gap: float = 0.0  # streamed: before the first token (decode waiting for its KV)
    tokens: tuple[str, ...] = ("Hello", " from", " stub")
    # streamed: after this many tokens, vLLM's in-band error event (its stream had begun)
    stream_error_after: int | None = None
    # ... written in two pieces, a moment apart (the proxy must see it whole)
    split_error_event: bool = False
    # a push prefill: answer as a kvpush engine that ran another engine's request does
    misrouted: bool = False


@dataclass(slots=True)
class StubBackend:
    name: str
    behaviour: StubBehaviour = field(default_factory=StubBehaviour)
    received: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    cancelled: int = 0
    record: bool = True
    metrics: str = ""  # what /metrics answers, e.g. a kvpush:info line
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' when set
    refused: int = 0  # requests refused for a missing or wrong key

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.refused += 1
            return web.json_response({"error": "Unauthorized"}, status=401)  # as vLLM says it
        return await handler(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics)

    async def _health(self, request: web.Request) -> web.Response:
        if self.behaviour.hang:
            await asyncio.sleep(3600)
        return web.Response(status=200 if self.behaviour.status == 200 else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.record:
            self.received.append(({k.lower(): v for k, v in request.headers.items()}, body))
        b = self.behaviour
        try:
            if b.hang:
                await asyncio.sleep(3600)
            if b.delay:
                await asyncio.sleep(b.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if b.status != 200:
            return web.json_response(
                {"error": {"message": f"{self.name} was told to fail"}}, status=b.status
            )
        params = body.get("kv_transfer_params") or {}
        usage = {"prompt_tokens": 3, "completion_tokens": len(b.tokens), "total_tokens": 6}
        if params.get("do_remote_decode"):
            answer = {
                "id": "p",
                "object": "text_completion",
                "created": 1,
                "model": "stub",
                "choices": [{"index": 0, "text": b.tokens[0], "finish_reason": "length"}],
                "usage": usage,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.name,
                    "remote_block_ids": [0, 1],
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                    FIRST_TOKEN_PARAM: 1,  # the id of its first token, as kvpush returns it
                },
            }
            if b.misrouted:
                answer["kv_transfer_params"] = {MISROUTED_PARAM: f"{self.name}_elsewhere"}
            if "messages" in body:
                answer["object"] = "chat.completion"
                answer["choices"] = [
                    {"index": 0, "message": {"role": "assistant", "content": b.tokens[0]},
                     "finish_reason": "length"}
                ]  # fmt: skip
            return web.json_response(answer)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "d",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "".join(b.tokens), "finish_reason": "length"}],
                    "usage": usage,
                }
            )
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        chat = "messages" in body
        if chat:  # like vLLM, the role first, before any token
            role = {"id": "d", "choices": [{"index": 0, "delta": {"role": "assistant",
                    "content": ""}, "finish_reason": None}]}  # fmt: skip
            await stream.write(f"data: {json.dumps(role)}\n\n".encode())
        if b.first_gap:
            await asyncio.sleep(b.first_gap)
        # Like vLLM, stop at max_tokens (the benchmark's probes ask for one).
        limit = body.get("max_tokens")
        tokens = b.tokens[:limit] if isinstance(limit, int) and limit > 0 else b.tokens
        for i, token in enumerate(tokens):
            if i == b.stream_error_after:
                break
            if i and b.token_gap:
                await asyncio.sleep(b.token_gap)
            part: dict[str, Any] = {"delta": {"content": token}} if chat else {"text": token}
            chunk = {"id": "d", "choices": [{"index": 0, **part, "finish_reason": None}]}
            await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if b.stream_error_after is not None:  # as vLLM tells a failure after its 200
            error = {"message": "Internal server error", "type": "InternalServerError",
                     "param": None, "code": 500}  # fmt: skip
            event = f"data: {json.dumps({'error': error})}\n\n".encode()
            if b.split_error_event:
                await stream.write(event[:10])
                await asyncio.sleep(0.05)
                event = event[10:]
            await stream.write(event)
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream


async def serve_stub(stub: StubBackend, port: int = 0) -> tuple[web.AppRunner, str]:
    """Start `stub` on 127.0.0.1 (a free port when 0); returns the runner and its URL."""
    runner = web.AppRunner(stub.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{bound}"
