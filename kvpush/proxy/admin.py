"""The admin API, /admin/backends: list the pools (GET), add a backend (POST), remove one
(DELETE). Off unless the proxy has an admin token; every call must carry it."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from kvpush.proxy import rewrite
from kvpush.proxy.auth import admin_refusal
from kvpush.proxy.backends import Backends
from kvpush.proxy.balance import BackendState, Pool
from kvpush.proxy.errors import error_response
from kvpush.proxy.fleet import check_backend, check_role

log = logging.getLogger("kvpush.proxy")

PATH = "/admin/backends"


class Admin:
    def __init__(self, backends: Backends, token: str | None, policies: dict[str, str]) -> None:
        self.backends = backends
        self.token = token
        self.policies = policies

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self._list)
        app.router.add_post(PATH, self._add)
        app.router.add_delete(PATH, self._remove)

    async def _body(self, request: web.Request, *keys: str) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict) or any(not isinstance(body.get(k), str) for k in keys):
            fields = ", ".join(f'"{k}": "..."' for k in keys)
            raise ValueError(f"expected a JSON object {{{fields}}}")
        body["role"] = check_role(body["role"])
        return body

    async def _list(self, request: web.Request) -> web.StreamResponse:
        refusal = admin_refusal(request, self.token)
        if refusal:
            return refusal
        now = time.monotonic()
        view: dict[str, Any] = {"mode": self.backends.mode, "policies": self.policies}
        for role, pool in self.backends.pools.items():
            view[role] = [state_view(pool, s, now) for s in pool]
        return web.json_response(view)

    async def _add(self, request: web.Request) -> web.StreamResponse:
        refusal = admin_refusal(request, self.token)
        if refusal:
            return refusal
        try:
            body = await self._body(request, "role", "backend")
            backend = check_backend(
                self.backends.mode, body["role"], rewrite.parse_backend(body["backend"])
            )
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        pool = self.backends.pools[body["role"]]
        try:
            state = pool.add(backend)
        except ValueError as exc:
            return error_response(409, f"{exc}; remove it first to change it", "conflict")
        log.info("admin: added %s backend %s", body["role"], rewrite.format_backend(backend))
        return web.json_response(state_view(pool, state, time.monotonic()), status=201)

    async def _remove(self, request: web.Request) -> web.StreamResponse:
        refusal = admin_refusal(request, self.token)
        if refusal:
            return refusal
        try:
            body = await self._body(request, "role", "url")
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        role, url = body["role"], body["url"].rstrip("/")
        pool = self.backends.pools[role]
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


def state_view(pool: Pool, state: BackendState, now: float) -> dict[str, Any]:
    """One backend as GET /admin/backends shows it."""
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
