"""The proxy's HTTP client to its backends, and the two reads it makes besides the legs.

One session for every leg, health check and /metrics read, made on first use (inside the
event loop), with the request and connect timeouts and, on every call, the backends' API
key: vLLM started with --api-key refuses /v1/* without it, and sending it elsewhere does no
harm. `health` is one health check (GET /health); `metrics` reads a backend's /metrics.
"""

from __future__ import annotations

import aiohttp

TIMED_OUT = "/health gave no answer within"  # how `health` words a check that timed out


class BackendClient:
    def __init__(self, request_timeout: float, connect_timeout: float, api_key: str | None) -> None:
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=self.request_timeout, sock_connect=self.connect_timeout
            )
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                headers=headers,
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self, url: str, timeout: float) -> str | None:
        """GET url/health; None when it answers 200 in time, else what went wrong."""
        try:
            async with self.session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                return None if resp.status == 200 else f"/health answered HTTP {resp.status}"
        except TimeoutError:
            return f"{TIMED_OUT} {timeout:g} s"
        except aiohttp.ClientConnectorError as exc:
            return f"cannot connect ({exc.os_error})"
        except aiohttp.ClientError as exc:
            return f"/health failed: {type(exc).__name__}: {exc}"

    async def metrics(self, url: str, timeout: float) -> str | None:
        """The text of url/metrics; None when it does not answer 200 within `timeout`."""
        try:
            async with self.session.get(
                url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                return await resp.text() if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None
