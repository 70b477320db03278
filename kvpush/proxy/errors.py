"""How a leg fails, and how the proxy says so.

`BackendFailure` is a failed leg: what the client is told, the backend to blame, and
whether the request may be sent elsewhere (`safety`: UNSENT, the request never left the
proxy; LOST, the backend went away before answering; "" otherwise). `transport_failure` and
`describe` make one from a connection error or from a backend's error answer. Every error
the proxy answers is shaped as vLLM and OpenAI's API shape theirs (`error_body`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.rewrite import Backend

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


def error_kind(exc: BackendFailure) -> str:
    """The failure's `kind` label on kvpush_proxy_backend_errors."""
    if exc.status == 504:
        return "timeout"
    if exc.safety:
        return exc.safety
    return "http_4xx" if 400 <= exc.status < 500 else "upstream"


async def describe(resp: aiohttp.ClientResponse) -> str:
    """A backend's error answer in one line: its status and message."""
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


def transport_failure(
    role: str, backend: Backend, exc: BaseException, config: ProxyConfig
) -> BackendFailure:
    """The failure a connection error means, naming the flag to change where one would help."""
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
