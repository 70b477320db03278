"""The proxy in front of several stub backends over real HTTP: the admin API, the fleet
file, health checks and ejection, safe retries, load-aware choice and per-backend metrics."""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpush.proxy.cli import config_from_args, register
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.rewrite import Backend
from kvpush.proxy.server import PROXY_KEY, Proxy, start_proxy
from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub

BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}
TOKEN = "admin-s3cret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dead_url() -> str:
    """A URL nothing listens on: connecting is refused."""
    return f"http://127.0.0.1:{free_port()}"


def prefill_backend(url: str, i: int) -> Backend:
    return Backend(url, f"prefill-{i}", "127.0.0.1", 5600 + i)


@dataclass
class Rig:
    url: str
    proxy: Proxy
    prefill: list[StubBackend]
    decode: list[StubBackend]
    prefill_urls: list[str]
    decode_urls: list[str]
    session: aiohttp.ClientSession

    async def post(self, body: dict[str, Any] = BODY, **kw: Any) -> aiohttp.ClientResponse:
        return await self.session.post(self.url + "/v1/completions", json=body, **kw)

    async def admin(
        self, method: str, body: dict[str, Any] | None = None, token: str | None = TOKEN
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(
            method, self.url + "/admin/backends", json=body, headers=headers
        ) as resp:
            return resp.status, await resp.json()

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as resp:
            return await resp.text()

    def state(self, role: str, url: str) -> Any:
        state = self.proxy.backends.pools[role].find(url)
        assert state is not None
        return state


@asynccontextmanager
async def rig(
    mode: str = "pull",
    prefill: int = 1,
    decode: int = 1,
    dead_prefill: int = 0,
    dead_decode: int = 0,
    first_prefill: str | None = None,
    **config: Any,
) -> AsyncIterator[Rig]:
    """Stub backends (dead ones, refusing connections, listed first, after `first_prefill`
    if given) and a proxy."""
    stubs = {
        "prefill": [StubBackend(f"prefill-{i}") for i in range(prefill)],
        "decode": [StubBackend(f"decode-{i}") for i in range(decode)],
    }
    runners = []
    urls: dict[str, list[str]] = {
        "prefill": [first_prefill] * bool(first_prefill)
        + [dead_url() for _ in range(dead_prefill)],
        "decode": [dead_url() for _ in range(dead_decode)],
    }
    for role, backends in stubs.items():
        for stub in backends:
            runner, url = await serve_stub(stub)
            runners.append(runner)
            urls[role].append(url)
    port = free_port()
    config.setdefault("admin_token", TOKEN)
    proxy_runner = await start_proxy(
        ProxyConfig(
            mode=mode,
            prefill=[prefill_backend(u, i) for i, u in enumerate(urls["prefill"])],
            decode=[Backend(u) for u in urls["decode"]],
            **config,
        ),
        "127.0.0.1",
        port,
    )
    try:
        async with aiohttp.ClientSession() as session:
            yield Rig(
                f"http://127.0.0.1:{port}",
                proxy_runner.app[PROXY_KEY],
                stubs["prefill"],
                stubs["decode"],
                urls["prefill"],
                urls["decode"],
                session,
            )
    finally:
        for runner in (proxy_runner, *runners):
            await runner.cleanup()


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample, 0 if absent."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the admin API -----------------------------------------------------------------------


async def test_the_admin_api_is_off_without_a_token_and_wants_the_right_one() -> None:
    async with rig(admin_token=None) as r:
        status, answer = await r.admin("GET")
        assert status == 403 and "--admin-token" in answer["error"]["message"]
    async with rig() as r:
        assert (await r.admin("GET", token=None))[0] == 401
        assert (await r.admin("GET", token="wrong"))[0] == 401
        status, view = await r.admin("GET")
        assert status == 200
        assert view["policies"] == {"prefill": "least_loaded", "decode": "least_loaded"}
        assert [b["url"] for b in view["decode"]] == r.decode_urls


async def test_backends_added_at_run_time_get_requests_and_removed_ones_stop() -> None:
    async with rig(decode=2, policy="round_robin") as r:
        first, second = r.decode_urls
        assert (await r.admin("DELETE", {"role": "decode", "url": second}))[0] == 200
        for _ in range(2):
            assert (await r.post()).status == 200
        assert (len(r.decode[0].received), len(r.decode[1].received)) == (2, 0)
        status, added = await r.admin("POST", {"role": "decode", "backend": second})
        assert status == 201 and added["healthy"] is True
        for _ in range(4):
            assert (await r.post()).status == 200
        assert (len(r.decode[0].received), len(r.decode[1].received)) == (4, 2)


async def test_a_removed_backend_finishes_the_request_it_has() -> None:
    async with rig(decode=2, policy="round_robin") as r:
        r.decode[0].behaviour = StubBehaviour(delay=0.3)
        pending = asyncio.ensure_future(r.post())
        await eventually(lambda: len(r.decode[0].received) == 1)
        status, answer = await r.admin("DELETE", {"role": "decode", "url": r.decode_urls[0]})
        assert status == 200 and answer["finishing"] == 1
        resp = await pending
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"]
        assert (await r.post()).status == 200
        assert len(r.decode[1].received) == 1


@pytest.mark.parametrize(
    ("method", "body", "status", "complaint"),
    [
        ("POST", {"role": "router", "backend": "http://h:1"}, 400, "'prefill' or 'decode'"),
        ("POST", {"role": "decode"}, 400, 'expected a JSON object {"role": "...", "backend"'),
        ("POST", {"role": "decode", "backend": "h:1"}, 400, "expected a URL like"),
        ("POST", {"role": "prefill", "backend": "http://h:1"}, 400, "engine=ID,kv=HOST:PORT"),
        ("DELETE", {"role": "decode", "url": "http://nowhere:1"}, 404, "the decode pool has"),
    ],
)
async def test_bad_admin_requests_are_refused_with_the_fix(
    method: str, body: dict[str, Any], status: int, complaint: str
) -> None:
    async with rig(mode="push") as r:
        got, answer = await r.admin(method, body)
        assert got == status and complaint in answer["error"]["message"]


async def test_the_last_backend_and_duplicates_are_refused() -> None:
    async with rig() as r:
        got, answer = await r.admin("DELETE", {"role": "decode", "url": r.decode_urls[0]})
        assert got == 409 and "add another one first" in answer["error"]["message"]
        got, answer = await r.admin("POST", {"role": "decode", "backend": r.decode_urls[0]})
        assert got == 409 and "already in the pool" in answer["error"]["message"]


# -- the fleet file ----------------------------------------------------------------------


async def test_a_changed_fleet_file_becomes_the_pools_and_a_broken_one_is_ignored(
    tmp_path: Path,
) -> None:
    fleet = tmp_path / "fleet.toml"
    async with rig(decode=2, health_interval=0.05, fleet_file=fleet) as r:
        prefill, (one, two) = r.prefill_urls[0], r.decode_urls
        fleet.write_text(f'prefill = ["{prefill}"]\ndecode = ["{two}"]\n')
        await eventually(lambda: [s.url for s in r.proxy.backends.pools["decode"]] == [two])
        fleet.write_text("decode = [")  # half-written: keep what we have
        await asyncio.sleep(0.2)
        assert [s.url for s in r.proxy.backends.pools["decode"]] == [two]
        fleet.write_text(f'prefill = ["{prefill}"]\ndecode = ["{one}", "{two}"]\n')
        await eventually(lambda: len(r.proxy.backends.pools["decode"]) == 2)


def test_the_command_line_reads_backends_from_a_fleet_file(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text('{"prefill": ["http://h:1"], "decode": ["http://h:2", "http://h:3"]}')
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["proxy", "--mode", "pull", "--config", str(fleet)])
    config = config_from_args(args)
    assert len(config.decode) == 2 and config.fleet_file == fleet
    both = parser.parse_args(
        ["proxy", "--mode", "pull", "--config", str(fleet), "--decode", "http://h:4"]
    )
    with pytest.raises(ValueError, match="not both"):
        config_from_args(both)
    with pytest.raises(ValueError, match="--mode push or --mode pull is required"):
        config_from_args(parser.parse_args(["proxy", "--config", str(fleet)]))


# -- health, ejection, retries ------------------------------------------------------------


async def test_a_failing_backend_is_ejected_and_returns_after_passing_checks() -> None:
    async with rig(decode=2, health_interval=0.05, eject_after=2, return_after=2) as r:
        sick = r.state("decode", r.decode_urls[1])
        r.decode[1].behaviour = StubBehaviour(status=500)  # its /health answers 503
        await eventually(lambda: not sick.healthy)
        assert "health checks failed: /health answered HTTP 503" in sick.reason
        assert "ejected: " + r.decode_urls[1] in r.proxy.status_line()
        for _ in range(4):
            assert (await r.post()).status == 200
        assert len(r.decode[1].received) == 0
        metrics = await r.metrics()
        assert sample(metrics, "kvpush_proxy_backend_healthy", backend=r.decode_urls[1]) == 0
        assert sample(metrics, "kvpush_proxy_backend_ejections_total", role="decode") == 1
        r.decode[1].behaviour = StubBehaviour()
        await eventually(lambda: sick.healthy)
        metrics = await r.metrics()
        assert sample(metrics, "kvpush_proxy_backend_healthy", backend=r.decode_urls[1]) == 1


async def test_with_every_decode_ejected_a_request_fails_fast_saying_why() -> None:
    async with rig(decode=1, health_interval=0.05, eject_after=1) as r:
        r.decode[0].behaviour = StubBehaviour(status=500)
        await eventually(lambda: not r.state("decode", r.decode_urls[0]).healthy)
        started = time.monotonic()
        resp = await r.post()
        message = (await resp.json())["error"]["message"]
        assert resp.status == 503 and time.monotonic() - started < 1
        assert "no healthy decode backend" in message and "/health answered HTTP 503" in message
        assert r.prefill[0].received == [], "no prefill is spent on a request decode cannot take"
        assert 'outcome="no_backend"} 1.0' in await r.metrics()


async def test_pull_prefill_refused_is_ejected_at_once_and_retried_elsewhere() -> None:
    async with rig(dead_prefill=1, prefill=1) as r:
        dead = r.prefill_urls[0]
        resp = await r.post()
        assert resp.status == 200 and len(r.prefill[0].received) == 1
        assert not r.state("prefill", dead).healthy
        assert "cannot connect" in r.state("prefill", dead).reason
        metrics = await r.metrics()
        assert sample(metrics, "kvpush_proxy_retries_total", role="prefill", cause="unsent") == 1
        assert sample(metrics, "kvpush_proxy_backend_errors_total", backend=dead) == 1
        assert (await r.post()).status == 200  # no second attempt on the dead one
        assert sample(await r.metrics(), "kvpush_proxy_retries_total", role="prefill") == 1


async def test_retries_are_bounded() -> None:
    async with rig(dead_prefill=1, prefill=1, retries=0) as r:
        resp = await r.post()
        assert resp.status == 502 and "cannot connect" in (await resp.json())["error"]["message"]
        assert r.prefill[0].received == []


async def test_push_resends_the_pair_with_a_new_transfer_id_when_prefill_refused() -> None:
    async with rig(mode="push", dead_prefill=1, prefill=1) as r:
        r.decode[0].behaviour = StubBehaviour(delay=0.3)  # still waiting when prefill fails
        resp = await r.post()
        assert resp.status == 200
        await eventually(lambda: r.decode[0].cancelled == 1)
        ((_, live_prefill_body),) = r.prefill[0].received
        first, second = (body["kv_transfer_params"] for _, body in r.decode[0].received)
        assert (first["remote_engine_id"], second["remote_engine_id"]) == ("prefill-0", "prefill-1")
        assert first["transfer_id"] != second["transfer_id"]
        assert second["transfer_id"] == live_prefill_body["kv_transfer_params"]["transfer_id"]


async def test_push_does_not_resend_after_a_prefill_that_answered_an_error() -> None:
    async with rig(mode="push", prefill=2, policy="round_robin") as r:
        r.prefill[0].behaviour = StubBehaviour(status=500)
        r.decode[0].behaviour = StubBehaviour(delay=0.3)
        resp = await r.post()
        assert resp.status == 502 and len(r.decode[0].received) == 1
        assert r.prefill[1].received == []


async def test_legs_on_a_backend_ejected_meanwhile_end_at_once_and_pull_prefill_moves_on() -> None:
    async with rig(
        prefill=2, health_interval=0.05, health_timeout=0.1, eject_after=2, request_timeout=30
    ) as r:
        r.prefill[0].behaviour = StubBehaviour(hang=True)  # accepts, never answers
        started = time.monotonic()
        resp = await r.post()
        assert resp.status == 200 and time.monotonic() - started < 5
        assert len(r.prefill[0].received) == 1 and len(r.prefill[1].received) == 1
        assert r.prefill[0].cancelled == 1
        metrics = await r.metrics()
        assert sample(metrics, "kvpush_proxy_retries_total", role="prefill", cause="lost") == 1


async def test_a_decode_ejected_while_streaming_ends_the_stream_with_an_error() -> None:
    async with rig(decode=2, health_interval=0.05, health_timeout=0.1, eject_after=2) as r:
        for stub in r.decode:
            stub.behaviour = StubBehaviour(token_gap=0.2, tokens=("a",) * 50)
        resp = await r.post({**BODY, "stream": True})
        assert resp.status == 200
        await resp.content.readline()  # prefill's first token: decode may not have the leg yet
        await eventually(lambda: any(stub.received for stub in r.decode))
        serving = next(stub for stub in r.decode if stub.received)
        serving.behaviour.hang = True  # now /health hangs too
        started = time.monotonic()
        text = (await resp.read()).decode()
        assert time.monotonic() - started < 5
        assert "ejected while in flight" in text and text.endswith("data: [DONE]\n\n")


async def test_the_last_healthy_decode_is_not_ejected_for_being_slow() -> None:
    """One slow server must not turn into a 503 for every request: with no other decode
    healthy, a /health that times out keeps it in rotation; an error still ejects it."""
    async with rig(decode=1, health_interval=0.05, health_timeout=0.1, eject_after=2) as r:
        only = r.state("decode", r.decode_urls[0])
        r.decode[0].behaviour = StubBehaviour(hang=True)
        await asyncio.sleep(0.6)  # several timed-out checks
        assert only.healthy
        r.decode[0].behaviour = StubBehaviour(status=500)
        await eventually(lambda: not only.healthy)


# -- load-aware choice and metrics ---------------------------------------------------------


async def test_a_decode_reporting_a_long_queue_is_avoided() -> None:
    async with rig(decode=2, scrape_interval=0.05) as r:
        r.decode[0].metrics = 'vllm:num_requests_waiting{engine="0"} 40.0\n'
        r.decode[1].metrics = 'vllm:num_requests_waiting{engine="0"} 0.0\n'
        busy = r.state("decode", r.decode_urls[0])
        await eventually(lambda: busy.reported is not None)
        for _ in range(6):
            assert (await r.post()).status == 200
        assert (len(r.decode[0].received), len(r.decode[1].received)) == (0, 6)
        metrics = await r.metrics()
        assert sample(metrics, "kvpush_proxy_backend_reported_waiting", backend=busy.url) == 40


async def test_per_backend_metrics_cover_load_ttft_and_handoff() -> None:
    async with rig(decode=1) as r:
        r.decode[0].behaviour = StubBehaviour(delay=0.05)
        pending = asyncio.ensure_future(r.post({**BODY, "prompt": "x" * 400}))
        await eventually(lambda: len(r.decode[0].received) == 1)
        metrics = await r.metrics()
        decode = r.decode_urls[0]
        assert sample(metrics, "kvpush_proxy_backend_in_flight", backend=decode) == 1
        assert sample(metrics, "kvpush_proxy_backend_in_flight_tokens", backend=decode) == 108
        assert (await pending).status == 200
        metrics = await r.metrics()
        assert sample(metrics, "kvpush_proxy_backend_in_flight", backend=decode) == 0
        assert sample(metrics, "kvpush_proxy_ttft_seconds_count", backend=decode) == 1
        assert sample(metrics, "kvpush_proxy_handoff_seconds_count", backend=decode) == 1
        assert sample(metrics, "kvpush_proxy_handoff_seconds_sum", backend=decode) >= 0.05
        assert sample(metrics, "kvpush_proxy_backend_seconds_per_unit", backend=decode) >= 0.05


async def test_a_backend_that_never_accepts_is_a_connect_timeout_and_is_passed_over() -> None:
    # A listening socket whose accept queue is full drops new connections' SYNs: connecting
    # hangs, as to a host that vanished without a reset.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(full.getsockname())
        silent = f"http://127.0.0.1:{full.getsockname()[1]}"
        try:
            async with rig(prefill=1, first_prefill=silent, connect_timeout=0.3) as r:
                started = time.monotonic()
                resp = await r.post()
                assert resp.status == 200 and time.monotonic() - started < 3
                assert "cannot connect within --connect-timeout 0.3 s" in (
                    r.state("prefill", silent).reason
                )
        finally:
            for filler in fillers:
                filler.close()


async def test_proxy_health_is_ok_only_once_an_ejected_backend_is_taken_back() -> None:
    async with rig(decode=1, health_interval=60, return_after=2) as r:
        state = r.state("decode", r.decode_urls[0])
        await eventually(lambda: state.passed_checks == 1)  # the monitor's first round is done
        r.proxy.backends.eject("decode", state, "cannot connect (test)")
        # Each /health probe counts as a check: answering once is not yet enough to return.
        async with r.session.get(r.url + "/health") as resp:
            report = await resp.json()
            assert resp.status == 503 and report["decode"] == {state.url: False}
            assert report["ejected"] == {state.url: "cannot connect (test)"}
        assert (await r.post()).status == 503
        async with r.session.get(r.url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["ejected"] == {}
        assert (await r.post()).status == 200
