"""The proxy's background work: health checks, the optional /metrics scrape, fleet-file reload.

Every `health_interval` seconds each backend of both roles gets `GET /health` (answered
within `health_timeout`, status 200, or it counts as failed); the pools decide ejection and
return (`balance.Pool.checked`). A healthy decode is asked once, on `/metrics`, whether it
continues from prefill's first token (`kvpush:info`'s first_token; see
`kvpush.proxy.first_token`). Ejected backends keep being checked, which is how they come
back. With `scrape_interval` > 0 each backend's `/metrics` is read that often for vLLM's
running/waiting queues and KV usage. With a fleet file, a change to it (by mtime) makes the
pools the file's lists; a file that does not parse is logged and the pools are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from kvpush.proxy.backends import Backends
from kvpush.proxy.balance import parse_vllm_metrics
from kvpush.proxy.client import BackendClient
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.fleet import read_fleet
from kvpush.proxy.rewrite import decode_first_token

log = logging.getLogger("kvpush.proxy")


class Monitor:
    def __init__(self, backends: Backends, client: BackendClient, config: ProxyConfig) -> None:
        self.backends = backends
        self.client = client
        self.health_interval = config.health_interval
        self.health_timeout = config.health_timeout
        self.scrape_interval = config.scrape_interval
        self.fleet_file = config.fleet_file
        self._tasks: list[asyncio.Task[None]] = []
        self._fleet_mtime = self._mtime()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._every(self.health_interval, self._tick)))
        if self.scrape_interval > 0:
            self._tasks.append(asyncio.create_task(self._every(self.scrape_interval, self.scrape)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _every(self, seconds: float, work: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await work()
            except Exception:  # one bad round must not end the checks for good
                log.exception("proxy background check failed; trying again in %g s", seconds)
            await asyncio.sleep(max(0.0, seconds - (loop.time() - started)))

    async def _tick(self) -> None:
        self.reload_fleet()
        await self.check_health()

    async def check_health(self) -> None:
        targets = [(role, state) for role, pool in self.backends.pools.items() for state in pool]
        problems = await asyncio.gather(
            *(self.client.health(state.url, self.health_timeout) for _, state in targets)
        )
        for (role, state), problem in zip(targets, problems, strict=True):
            self.backends.checked(role, state, problem)
        unknown = [s for s in self.backends.pools["decode"] if s.healthy and s.first_token is None]
        texts = await asyncio.gather(
            *(self.client.metrics(state.url, self.health_timeout) for state in unknown)
        )
        for state, text in zip(unknown, texts, strict=True):
            # asked once: one that does not say (an older kvpush, /metrics not served)
            # continues from prefill's token as far as the proxy knows, until a stream
            # shows otherwise (`Legs._decode`)
            self.backends.first_token_of(state, (text and decode_first_token(text)) or "pinned")

    async def scrape(self) -> None:
        states = [state for pool in self.backends.pools.values() for state in pool]
        texts = await asyncio.gather(
            *(self.client.metrics(state.url, self.health_timeout) for state in states)
        )
        for state, text in zip(states, texts, strict=True):
            state.reported = parse_vllm_metrics(text) if text else None

    def _mtime(self) -> int | None:
        path = self.fleet_file
        if path is None:
            return None
        try:
            return path.stat().st_mtime_ns
        except OSError:
            return None

    def reload_fleet(self) -> None:
        """Apply the fleet file if it changed since it was last read."""
        path = self.fleet_file
        mtime = self._mtime()
        if path is None or mtime is None or mtime == self._fleet_mtime:
            return
        self._fleet_mtime = mtime
        try:
            changes = self.backends.apply_fleet(read_fleet(path))
        except ValueError as exc:
            log.error("fleet file %s not applied, keeping the current backends: %s", path, exc)
            return
        log.info("fleet file %s applied: %s", path, "; ".join(changes) or "no change")
