"""Our proxy in front of a running topology, in this process, and the warm-up through it.

`kvpush up`, `kvpush bench sweep|compare|hooks` and `kvpush plan measure` start the proxy the
same way: the mode of the topology's setup, its prefill and decode servers as backends,
listening on 127.0.0.1; each passes the settings it wants besides those (the request
timeout, how lenient the health checks are). The proxy's modules are imported when it
starts, so that importing this module stays cheap (`kvpush --help` imports every tool).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvpush.testbed.pinning import confined
from kvpush.testbed.topology import SETUPS, StartupError, Topology

if TYPE_CHECKING:
    from aiohttp import web

    from kvpush.proxy.config import ProxyConfig


def local_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def topology_proxy_config(topology: Topology, **settings: Any) -> ProxyConfig:
    """The proxy's configuration for `topology`; `settings` are ProxyConfig's other fields."""
    from kvpush.proxy.config import ProxyConfig

    prefill, decode = topology.proxy_backends()
    setup = SETUPS[topology.config.setup or ""]
    settings.setdefault("first_token", setup.first_token)
    return ProxyConfig(mode=setup.proxy_mode, prefill=prefill, decode=decode, **settings)


async def start_topology_proxy(topology: Topology, port: int, **settings: Any) -> web.AppRunner:
    """Serve the proxy for `topology` on 127.0.0.1:`port` (`runner.cleanup()` stops it);
    `settings` as for `topology_proxy_config`. A port that cannot be bound is an OSError
    (`cannot_listen` words it for the user)."""
    from kvpush.proxy.server import start_proxy

    return await start_proxy(topology_proxy_config(topology, **settings), "127.0.0.1", port)


T = TypeVar("T")


async def with_warm_proxy(
    topology: Topology,
    port: int,
    work: Callable[[str], Awaitable[T]],
    **settings: Any,
) -> T:
    """Start the proxy for `topology`, warm the pair up through it, run `work(url)` and
    stop the proxy; a port that cannot be bound or a failed warm-up is a StartupError.
    The calling thread (the proxy's and the work's event loop) runs meanwhile on the cores
    no server has, if there are any (`Topology.client_cores`)."""
    with confined(topology.client_cores):
        try:
            runner = await start_topology_proxy(topology, port, **settings)
        except OSError as exc:
            raise cannot_listen(port, exc) from None
        url = local_url(port)
        try:
            error = await warm_up(url, str(topology.config.model))
            if error:
                raise StartupError(f"warm-up through the proxy failed: {error}")
            return await work(url)
        finally:
            await runner.cleanup()


def cannot_listen(port: int, exc: OSError) -> StartupError:
    return StartupError(f"proxy cannot listen on port {port}: {exc.strerror}")


async def warm_up(url: str, model: str, attempts: int = 3, timeout: float = 30.0) -> str | None:
    """One short completion through the proxy, retried; returns the last error or None.

    The first request of a pair opens its NIXL connections; under CPU load vLLM's own
    handshakes can time out once (they have a fixed 5 s limit), so a retry is expected.
    """
    import aiohttp

    body = {"model": model, "prompt": "warm up", "max_tokens": 2, "temperature": 0}
    error: str | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        for _ in range(attempts):
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        await resp.read()  # the whole answer: leaving early counts client_gone
                        return None
                    error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = f"no answer within {timeout:g} s ({type(exc).__name__})"
    return error
