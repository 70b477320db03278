"""The proxy's HTTP conventions, over real HTTP against stub backends: the backends' API key,
errors shaped as vLLM's and OpenAI's on every path, request ids and trace context,
readiness while draining (in-process and through SIGTERM), and the access log."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpush.proxy.balance import Pool
from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub
from tests.unit.test_proxy_fleet import BODY, eventually, rig

KEY = "backend-s3cret"
MODES = pytest.mark.parametrize("mode", ["pull", "push"])
REPO = Path(__file__).resolve().parents[2]


def leg_headers(stub: StubBackend) -> dict[str, str]:
    ((headers, _),) = stub.received
    return headers


# -- the backends' API key ----------------------------------------------------------------


@MODES
async def test_the_backend_api_key_goes_with_every_leg_check_and_scrape(mode: str) -> None:
    async with rig(mode, backend_api_key=KEY, health_interval=0.05, scrape_interval=0.05) as r:
        stubs = (*r.prefill, *r.decode)
        for stub in stubs:
            stub.api_key = KEY
            stub.metrics = "vllm:num_requests_waiting 2.0\n"
        assert (await r.post()).status == 200
        assert (await r.session.get(r.url + "/v1/models")).status == 200
        assert (await r.session.get(r.url + "/health")).status == 200  # probes carry the key
        decode = r.state("decode", r.decode_urls[0])
        await eventually(lambda: decode.reported is not None)  # so does the /metrics scrape
        assert [stub.refused for stub in stubs] == [0, 0]
        for stub in stubs:
            assert leg_headers(stub)["authorization"] == f"Bearer {KEY}"


@MODES
async def test_a_backend_refusing_the_proxy_is_a_502_naming_the_flag(mode: str) -> None:
    async with rig(mode) as r:
        for stub in (*r.prefill, *r.decode):
            stub.api_key = KEY
        for resp in (await r.post(), await r.session.get(r.url + "/v1/models")):
            error = (await resp.json())["error"]
            assert resp.status == 502, "the client's own credentials were fine"
            assert "HTTP 401" in error["message"] and "--backend-api-key" in error["message"]


# -- errors -------------------------------------------------------------------------------


async def raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, str, bytes]:
    """One HTTP/1.1 request as raw bytes (a client library would refuse some headers);
    returns the status, the response head and its body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    length = f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    writer.write(head + b"\r\nHost: proxy\r\n" + length + body)
    answer = await reader.read()
    writer.close()
    response_head, _, content = answer.partition(b"\r\n\r\n")
    return int(response_head.split()[1]), response_head.decode(), content


def assert_error_shape(status: int, body: Any) -> str:
    """vLLM's (and OpenAI's) shape: {"error": {"message", "type", "code"}}; returns message."""
    error = body["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["code"] == status
    return str(error["message"])


async def test_every_refusal_is_an_openai_shaped_json_error_with_a_request_id() -> None:
    async with rig(api_key="s3cret", max_body_bytes=1024) as r:
        auth = {"Authorization": "Bearer s3cret"}
        cases = [
            ("POST", "/v1/responses", auth, BODY, 404, "this proxy serves POST /v1/completions"),
            ("POST", "/v1/embeddings", auth, BODY, 404, "no route POST /v1/embeddings"),
            ("GET", "/nowhere", {}, None, 404, "no route GET /nowhere"),
            ("GET", "/v1/completions", auth, None, 405, "/v1/completions takes POST"),
            ("DELETE", "/health", {}, None, 405, "/health takes GET"),
            ("POST", "/v1/completions", {}, BODY, 401, "missing or wrong API key"),
            ("POST", "/v1/completions", auth, {**BODY, "prompt": "x" * 2048}, 413, "over 1024"),
            ("POST", "/v1/completions", auth, {**BODY, "n": 2}, 400, "n and best_of"),
        ]
        for method, path, headers, body, status, says in cases:
            async with r.session.request(method, r.url + path, json=body, headers=headers) as resp:
                assert resp.status == status, (method, path)
                assert resp.content_type == "application/json", (method, path)
                assert says in assert_error_shape(status, await resp.json()), (method, path)
                assert resp.headers["X-Request-Id"], (method, path)


async def test_a_non_ascii_authorization_header_is_a_clean_401() -> None:
    async with rig(api_key="s3cret") as r:
        for path, expected in (
            (b"POST /v1/completions", "missing or wrong API key"),
            (b"GET /admin/backends", "missing or wrong admin token"),
        ):
            head = path + b" HTTP/1.1\r\nAuthorization: Bearer caf\xc3\xa9\xff"
            status, response_head, content = await raw_request(r.url, head, b"{}")
            assert status == 401, content
            assert expected in assert_error_shape(401, json.loads(content))
            assert "X-Request-Id" in response_head


async def test_a_failure_inside_the_proxy_is_a_json_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    async with rig() as r:
        monkeypatch.setattr(Pool, "pick", broken)
        resp = await r.post()
        assert resp.status == 500
        assert "internal error" in assert_error_shape(500, await resp.json())


# -- request ids and trace context --------------------------------------------------------

TRACE = {
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "vendor=opaque",
}


@MODES
async def test_request_ids_are_returned_and_trace_context_reaches_both_legs(mode: str) -> None:
    async with rig(mode) as r:
        resp = await r.post(headers={"X-Request-Id": "client-7", **TRACE})
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "client-7"
        prefill, decode = leg_headers(r.prefill[0]), leg_headers(r.decode[0])
        assert re.fullmatch(r"client-7-[0-9a-f]{12}", decode["x-request-id"])
        assert prefill["x-request-id"] == decode["x-request-id"]
        for name, value in TRACE.items():
            assert prefill[name] == value and decode[name] == value


async def test_a_generated_id_is_the_one_the_legs_carry_also_when_streaming() -> None:
    async with rig() as r:
        resp = await r.post({**BODY, "stream": True})
        await resp.read()
        generated = resp.headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated)
        assert leg_headers(r.decode[0])["x-request-id"] == generated
        assert "traceparent" not in leg_headers(r.decode[0])
        health = await r.session.get(r.url + "/health")
        assert health.headers["X-Request-Id"] != generated


# -- readiness and draining ---------------------------------------------------------------


async def test_ready_turns_503_at_once_while_the_request_in_flight_finishes() -> None:
    async with rig() as r:
        ready = await r.session.get(r.url + "/ready")
        assert ready.status == 200 and await ready.json() == {"status": "ready"}
        r.decode[0].behaviour = StubBehaviour(delay=0.5)
        pending = asyncio.ensure_future(r.post())
        await eventually(lambda: r.proxy.in_flight == 1)
        drain = asyncio.ensure_future(r.proxy.drain(timeout=30))
        await eventually(lambda: r.proxy.draining)
        ready = await r.session.get(r.url + "/ready")
        assert ready.status == 503
        assert await ready.json() == {"status": "draining", "in_flight": 1}
        health = await r.session.get(r.url + "/health")
        assert health.status == 503 and (await health.json())["status"] == "draining"
        assert not drain.done()
        assert (await pending).status == 200
        assert await drain == 0


async def test_a_second_signal_ends_the_drain_at_once() -> None:
    async with rig() as r:
        r.decode[0].behaviour = StubBehaviour(hang=True)
        pending = asyncio.ensure_future(r.post())
        await eventually(lambda: r.proxy.in_flight == 1)
        stop_now = asyncio.Event()
        drain = asyncio.ensure_future(r.proxy.drain(timeout=30, stop_now=stop_now))
        await asyncio.sleep(0.05)
        stop_now.set()
        assert await asyncio.wait_for(drain, 2) == 1
        pending.cancel()


async def test_ready_is_503_while_a_role_has_no_backend_in_rotation() -> None:
    async with rig(decode=0, dead_decode=1, health_interval=0.05, eject_after=1) as r:
        await eventually(lambda: not r.proxy.backends.pools["decode"].available())
        ready = await r.session.get(r.url + "/ready")
        assert ready.status == 503
        reason = "no healthy backend: decode"
        assert await ready.json() == {"status": "unavailable", "reason": reason}


async def test_sigterm_drains_the_proxy_process() -> None:
    """`kvpush proxy` itself: after SIGTERM /ready says 503, the request in flight gets its
    answer, and the process exits 0 once it has."""
    prefill, decode = StubBackend("prefill-0"), StubBackend("decode-0", StubBehaviour(delay=1.0))
    (p_runner, p_url), (d_runner, d_url) = await serve_stub(prefill), await serve_stub(decode)
    argv = ["proxy", "--mode", "pull", "--prefill", p_url, "--decode", d_url, "--port", "0"]
    code = "import sys; from kvpush.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *argv, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = re.search(r"listening on (http://\S+)", line)
        assert url, line
        async with aiohttp.ClientSession() as session:
            pending = asyncio.ensure_future(session.post(url[1] + "/v1/completions", json=BODY))
            await eventually(lambda: len(decode.received) == 1)
            proc.send_signal(signal.SIGTERM)
            await eventually_ready_is(session, url[1], 503)
            resp = await pending
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == "Hello from stub"
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        for runner in (p_runner, d_runner):
            await runner.cleanup()


async def eventually_ready_is(session: aiohttp.ClientSession, url: str, status: int) -> None:
    for _ in range(100):
        async with session.get(url + "/ready") as resp:
            if resp.status == status:
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"/ready never answered {status}")


# -- access log ---------------------------------------------------------------------------


async def test_the_access_log_has_a_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpush.proxy.access")
    async with rig(access_log=True) as r:
        await r.post(headers={"X-Request-Id": "client-7"})
        await r.session.get(r.url + "/v1/nothing")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvpush.proxy.access"]
    assert any('"POST /v1/completions HTTP/1.1" 200' in x and "id=client-7" in x for x in lines)
    assert any('"GET /v1/nothing HTTP/1.1" 404' in x for x in lines)


async def test_no_access_log_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpush.proxy.access")
    async with rig() as r:
        await r.post()
    assert not [rec for rec in caplog.records if rec.name == "kvpush.proxy.access"]
