"""The proxy over real HTTP against stub backends: legs, streaming, errors, limits."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.metrics import Metrics
from kvpush.proxy.rewrite import Backend
from kvpush.proxy.server import start_proxy
from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Rig:
    url: str
    prefill: StubBackend
    decode: StubBackend
    session: aiohttp.ClientSession
    mode: str = "pull"
    decode_url: str = ""

    async def post(self, body: dict[str, Any], path: str = "/v1/completions", **kw: Any) -> Any:
        return await self.session.post(self.url + path, json=body, **kw)


async def make_rig(mode: str, **config: Any) -> AsyncIterator[Rig]:
    prefill, decode = StubBackend("prefill-0"), StubBackend("decode-0")
    p_runner, p_url = await serve_stub(prefill)
    d_runner, d_url = await serve_stub(decode)
    port = free_port()
    decode_url = config.pop("decode_url", d_url)
    dp = config.pop("prefill_dp", 1)
    tp = 2 if dp > 1 else 1
    proxy = await start_proxy(
        ProxyConfig(
            mode=mode,
            prefill=[Backend(p_url, "prefill-0", "127.0.0.1", 5600, tp, dp)],
            decode=[Backend(decode_url)],
            **config,
        ),
        "127.0.0.1",
        port,
    )
    async with aiohttp.ClientSession() as session:
        yield Rig(f"http://127.0.0.1:{port}", prefill, decode, session, mode, decode_url)
    for runner in (proxy, p_runner, d_runner):
        await runner.cleanup()


@pytest.fixture(params=["pull", "push"])
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    async for r in make_rig(request.param):
        yield r


BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 0}


async def test_client_gets_decode_answer_and_legs_are_rewritten(rig: Rig) -> None:
    resp = await rig.post(BODY)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == "Hello from stub"
    ((p_headers, p_body),) = rig.prefill.received
    ((d_headers, d_body),) = rig.decode.received
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert d_body["max_tokens"] == 8
    assert p_headers["x-request-id"] == d_headers["x-request-id"]
    assert d_body["kv_transfer_params"]["do_remote_prefill"] is True


async def test_streaming_is_relayed_chunk_by_chunk(rig: Rig) -> None:
    resp = await rig.post({**BODY, "stream": True})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == "Hello from stub"


async def test_chat_completions_and_models_pass_through(rig: Rig) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert (await rig.post(chat, "/v1/chat/completions")).status == 200
    models = await rig.session.get(rig.url + "/v1/models")
    assert (await models.json())["data"][0]["id"] == "stub"


async def test_pull_decode_gets_prefill_coordinates() -> None:
    async for rig in make_rig("pull"):
        await rig.post(BODY)
        params = rig.decode.received[0][1]["kv_transfer_params"]
        assert params["remote_engine_id"] == "prefill-0" and params["remote_block_ids"] == [0, 1]


async def test_push_decode_is_told_where_prefill_lives() -> None:
    async for rig in make_rig("push"):
        await rig.post(BODY)
        params = rig.decode.received[0][1]["kv_transfer_params"]
        assert (params["remote_engine_id"], params["remote_port"]) == ("prefill-0", 5600)
        assert (
            params["transfer_id"] == rig.prefill.received[0][1]["kv_transfer_params"]["transfer_id"]
        )


async def test_push_pins_each_request_to_a_data_parallel_engine_and_tells_decode_which() -> None:
    """A prefill of 2 DP engines (tp 2): the proxy spreads requests over both, pins prefill's
    leg to its engine (vLLM's X-data-parallel-rank) and names that engine to decode, with
    its own first control port; prefill's leg names it too, for the engine to check."""
    async for rig in make_rig("push", prefill_dp=2):
        for _ in range(4):
            assert (await rig.post(BODY)).status == 200
        seen = []
        for (p_headers, p_body), (_, d_body) in zip(
            rig.prefill.received, rig.decode.received, strict=True
        ):
            rank = int(p_headers["x-data-parallel-rank"])
            params = d_body["kv_transfer_params"]
            assert (params["remote_engine_id"], params["remote_port"]) == (
                f"prefill-0_dp{rank}", 5600 + 2 * rank
            )  # fmt: skip
            assert p_body["kv_transfer_params"]["kvpush_engine_id"] == f"prefill-0_dp{rank}"
            seen.append(rank)
        assert sorted(seen) == [0, 0, 1, 1], seen
    async for rig in make_rig("push"):  # one engine: no header, its own id
        await rig.post(BODY)
        ((p_headers, p_body),) = rig.prefill.received
        assert "x-data-parallel-rank" not in p_headers
        assert p_body["kv_transfer_params"]["kvpush_engine_id"] == "prefill-0"


async def test_a_data_parallel_engine_is_free_again_once_its_prefill_leg_answered() -> None:
    """The engine choice counts prefill legs, not whole requests: a request whose decode
    still streams no longer weighs on the engine that prefilled it."""
    async for rig in make_rig("push", prefill_dp=2):
        rig.decode.behaviour = StubBehaviour(delay=1.5)
        slow = asyncio.ensure_future(rig.post(BODY))
        while not (rig.prefill.received and rig.decode.received):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # prefill's instant answer is in; decode's is not
        rig.decode.behaviour = StubBehaviour()
        for _ in range(2):
            assert (await rig.post(BODY)).status == 200
        assert not slow.done()
        ranks = [int(headers["x-data-parallel-rank"]) for headers, _ in rig.prefill.received]
        assert ranks == [0, 1, 0], "engine 0 took the third: the first's prefill had ended"
        assert (await slow).status == 200


async def test_prefill_error_names_the_backend(rig: Rig) -> None:
    rig.prefill.behaviour = StubBehaviour(status=500)
    resp = await rig.post(BODY)
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert "prefill backend" in error["message"] and error["backend"].startswith("http://127.0.0.1")


async def test_push_prefill_failure_cancels_the_waiting_decode_leg() -> None:
    async for rig in make_rig("push"):
        rig.prefill.behaviour = StubBehaviour(status=500, delay=0.2)
        rig.decode.behaviour = StubBehaviour(hang=True)
        started = time.monotonic()
        resp = await rig.post(BODY)
        assert resp.status == 502 and time.monotonic() - started < 5
        for _ in range(50):
            if rig.decode.cancelled:
                break
            await asyncio.sleep(0.05)
        assert rig.decode.cancelled == 1, "decode leg must be closed so vLLM aborts it"


async def test_a_push_prefill_engine_that_ran_another_engines_request_fails_it_at_once() -> None:
    """A data-parallel prefill whose front end ignored X-data-parallel-rank: the engine
    that ran the request says so (and freed its KV); the proxy answers 502 naming it and
    closes decode's leg, which would otherwise wait for a WRITE until prefill_timeout_s."""
    async for rig in make_rig("push", prefill_dp=2):
        rig.prefill.behaviour = StubBehaviour(misrouted=True)
        rig.decode.behaviour = StubBehaviour(hang=True)
        started = time.monotonic()
        resp = await rig.post(BODY)
        message = (await resp.json())["error"]["message"]
        assert resp.status == 502 and time.monotonic() - started < 5
        assert "prefill-0_elsewhere ran the request meant for prefill-0_dp0" in message
        assert "X-data-parallel-rank" in message
        for _ in range(50):
            if rig.decode.cancelled:
                break
            await asyncio.sleep(0.05)
        assert rig.decode.cancelled == 1


async def test_unreachable_decode_is_a_fast_502() -> None:
    async for rig in make_rig("pull", decode_url=f"http://127.0.0.1:{free_port()}"):
        resp = await rig.post(BODY)
        assert resp.status == 502
        assert "cannot connect" in (await resp.json())["error"]["message"]


async def test_a_hanging_backend_becomes_a_504_within_the_timeout() -> None:
    async for rig in make_rig("pull", request_timeout=0.5):
        rig.decode.behaviour = StubBehaviour(hang=True)
        started = time.monotonic()
        resp = await rig.post(BODY)
        assert resp.status == 504 and time.monotonic() - started < 3
        assert "no answer within 0.5 s" in (await resp.json())["error"]["message"]


async def test_bad_requests_are_refused_before_any_backend_sees_them() -> None:
    async for rig in make_rig("pull", max_body_bytes=1024):
        bad_json = await rig.session.post(rig.url + "/v1/completions", data=b"{not json")
        assert bad_json.status == 400
        too_big = await rig.post({**BODY, "prompt": "x" * 4096})
        assert too_big.status == 413
        bad_field = await rig.post({**BODY, "max_tokens": -1})
        assert bad_field.status == 400
        assert rig.prefill.received == [] and rig.decode.received == []


async def test_api_key_is_required_when_configured() -> None:
    async for rig in make_rig("pull", api_key="s3cret"):
        assert (await rig.post(BODY)).status == 401
        ok = await rig.post(BODY, headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200
        assert (await rig.session.get(rig.url + "/health")).status == 200


async def test_health_and_metrics_report_backends(rig: Rig) -> None:
    assert (await rig.session.get(rig.url + "/health")).status == 200
    await rig.post(BODY)
    rig.decode.behaviour = StubBehaviour(status=500)
    await rig.post(BODY)
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'outcome="ok"} 1.0' in metrics
    assert 'outcome="backend_error"} 1.0' in metrics
    assert "kvpush_proxy_ttft_seconds_count" in metrics
    assert (await rig.session.get(rig.url + "/health")).status == 503


def test_push_config_without_coordinates_is_refused() -> None:
    with pytest.raises(ValueError, match="engine=ID,kv=HOST:PORT"):
        ProxyConfig(mode="push", prefill=[Backend("http://h:1")], decode=[Backend("http://h:2")])


async def test_a_failed_handoff_between_mismatched_modes_is_named() -> None:
    async for rig in make_rig("push"):
        rig.prefill.metrics = 'kvpush:info{engine="0",mode="pull",role="prefill"} 1.0\n'
        rig.decode.metrics = 'kvpush:info{engine="0",mode="push",role="decode"} 1.0\n'
        rig.decode.behaviour = StubBehaviour(status=500)
        resp = await rig.post(BODY)
        message = (await resp.json())["error"]["message"]
        assert resp.status == 502 and "decode backend" in message
        assert "runs kvpush in pull mode" in message and "in push mode" in message


async def test_a_plain_decode_failure_gets_no_mode_hint() -> None:
    async for rig in make_rig("pull"):
        rig.decode.behaviour = StubBehaviour(status=500)
        message = (await (await rig.post(BODY)).json())["error"]["message"]
        assert "mode mismatch" not in message


async def test_a_failed_handoff_names_the_kvpush_failures_that_grew() -> None:
    """vLLM answers a failed transfer with a bare 500; the client hears kvpush's cause."""

    def counters(timeout: int, gone: int) -> str:
        return (
            'kvpush:info{engine="0",mode="push",role="decode"} 1.0\n'
            f'kvpush:failures_total{{engine="0",kind="transfer_timeout"}} {timeout}.0\n'
            f'kvpush:failures_total{{engine="0",kind="peer_gone"}} {gone}.0\n'
        )

    async for rig in make_rig("push"):
        rig.decode.behaviour = StubBehaviour(status=500)
        rig.decode.metrics = counters(2, 0)
        first = (await (await rig.post(BODY)).json())["error"]["message"]
        assert "kvpush:failures_total" in first and "transfer_timeout +2" in first
        rig.decode.metrics = counters(2, 1)  # one more failure, of another kind
        second = (await (await rig.post(BODY)).json())["error"]["message"]
        assert "decode http://127.0.0.1:" in second and "peer_gone +1" in second
        assert "transfer_timeout" not in second  # it did not grow this time


FAILED_TRANSFER = (
    'kvpush:info{engine="0",mode="%s",role="decode"} 1.0\n'
    'kvpush:failures_total{engine="0",kind="transfer_timeout"} 1.0\n'
)


async def test_a_stream_that_fails_before_any_byte_is_an_http_error_naming_the_cause(
    rig: Rig,
) -> None:
    """vLLM fails a streamed request whose KV never came with an event in its 200 stream
    that says only "Internal server error": where the client has no byte yet, it gets an
    HTTP error naming decode and kvpush's counted cause instead."""
    async for other in make_rig(rig.mode, first_token="decode"):
        other.decode.behaviour = StubBehaviour(stream_error_after=0)
        other.decode.metrics = FAILED_TRANSFER % rig.mode
        resp = await other.post({**BODY, "stream": True})
        assert resp.status == 502, await resp.text()
        message = (await resp.json())["error"]["message"]
        assert "decode backend http://127.0.0.1:" in message
        assert "failed mid-stream: Internal server error" in message
        assert "transfer_timeout +1" in message


async def test_a_stream_that_fails_after_its_first_token_ends_with_the_cause(rig: Rig) -> None:
    """Prefill's token went out first (or decode's tokens): the error comes in-band, as the
    stream's last event, with the backend and the cause, and nothing of decode's after it."""
    rig.decode.behaviour = StubBehaviour(stream_error_after=2)
    rig.decode.metrics = FAILED_TRANSFER % rig.mode
    resp = await rig.post({**BODY, "stream": True})
    assert resp.status == 200
    events = stream_events(await resp.text())
    texts = [event_text(e) for e in events[:-1]]
    assert "".join(texts) == "Hello from", texts  # prefill's token, then decode's next one
    error = events[-1]["error"]
    assert error["code"] == 502 and error["backend"] == rig.decode_url
    assert "failed mid-stream" in error["message"] and "transfer_timeout +1" in error["message"]


async def test_an_error_event_split_across_chunks_still_ends_the_stream_with_the_cause(
    rig: Rig,
) -> None:
    rig.decode.behaviour = StubBehaviour(stream_error_after=2, split_error_event=True)
    rig.decode.metrics = FAILED_TRANSFER % rig.mode
    resp = await rig.post({**BODY, "stream": True})
    events = stream_events(await resp.text())  # every event whole
    assert "".join(event_text(e) for e in events[:-1]) == "Hello from"
    assert "failed mid-stream" in events[-1]["error"]["message"]


def test_only_what_may_begin_an_error_event_is_held_back() -> None:
    from kvpush.proxy.relay import error_start

    token = b'data: {"choices": [{"text": "x"}]}\n\n'
    assert error_start(token) == len(token)
    for piece in (b"d", b"data: {", b'data: {"error"', b'data: {"error": {"mess'):
        assert error_start(token + piece) == len(token), piece
    assert error_start(token + b'data: {"choices"') == len(token) + 16
    assert error_start(b'data: {"err') == 0


def test_an_error_event_is_found_only_where_an_event_starts() -> None:
    from kvpush.proxy.relay import stream_error

    ok = b'data: {"choices": [{"text": "data: {\\"error\\": 1}"}]}\n\n'
    assert stream_error(ok) is None
    bad = b'data: {"error": {"message": "boom", "code": 503}}\n\ndata: [DONE]\n\n'
    assert stream_error(ok + bad) == (ok, 503, "boom")
    assert stream_error(b'data: {"error": "not an object"}\n\n') == (
        b"", 500, "an error event without a message"
    )


def stream_events(text: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def event_text(event: dict[str, Any]) -> str:
    choice = event["choices"][0]
    return str(choice["text"] if "text" in choice else choice["delta"].get("content") or "")


async def first_content(resp: aiohttp.ClientResponse) -> tuple[float, list[dict[str, Any]]]:
    """The events up to the first with text, and when that one came."""
    events = []
    while True:
        line = await resp.content.readline()
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
            if event_text(events[-1]):
                return time.monotonic(), events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_streamed_answer_starts_with_prefills_token_and_decode_continues_from_it(
    rig: Rig, path: str
) -> None:
    """Decode waits 1.5 s (its KV): the client's first token comes from prefill before that,
    decode's copy of it is left out, and decode is told which token to reproduce."""
    rig.decode.behaviour = StubBehaviour(first_gap=1.5)
    body: dict[str, Any] = {**BODY, "stream": True}
    if "chat" in path:
        body = {**body, "messages": [{"role": "user", "content": "hi"}]}
        del body["prompt"]
    started = time.monotonic()
    resp = await rig.post(body, path)
    first_at, head = await first_content(resp)
    assert first_at - started < 1.0, "prefill's token must not wait for decode's"
    assert head[-1]["id"] == "p" and event_text(head[-1]) == "Hello"
    events = [*head, *stream_events(await resp.text())]
    assert "".join(event_text(e) for e in events) == "Hello from stub"
    if "chat" in path:  # push: decode's role chunk may come first (vLLM sends it at once)
        roles = [e["choices"][0]["delta"].get("role") for e in events]
        assert roles.count("assistant") == 1 and roles[0] == "assistant", roles
    xargs = rig.decode.received[0][1]["vllm_xargs"]
    if rig.prefill.received[0][1]["kv_transfer_params"].get("transfer_id"):  # push
        transfer_id = rig.prefill.received[0][1]["kv_transfer_params"]["transfer_id"]
        assert xargs == {"kvpush_first_token_of": transfer_id}
    else:
        assert xargs == {"kvpush_first_token": 1}  # the id prefill returned
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'kvpush_proxy_first_token_total{source="prefill"} 1.0' in metrics


async def test_when_decode_answers_first_the_stream_is_decodes_alone() -> None:
    async for rig in make_rig("push"):
        rig.prefill.behaviour = StubBehaviour(delay=0.3)
        resp = await rig.post({**BODY, "stream": True})
        events = stream_events(await resp.text())
        assert [e["id"] for e in events] == ["d", "d", "d"]
        assert "".join(event_text(e) for e in events) == "Hello from stub"
        metrics = await (await rig.session.get(rig.url + "/metrics")).text()
        assert 'kvpush_proxy_first_token_total{source="decode"} 1.0' in metrics
        assert "kvpush_proxy_ttft_seconds_count" in metrics
        counts = [line for line in metrics.splitlines() if "ttft_seconds_count" in line]
        assert [float(line.split()[-1]) for line in counts] == [1.0], "one TTFT per request"


async def test_a_decode_that_does_not_reproduce_the_token_is_counted_then_gives_its_own(
    rig: Rig,
) -> None:
    rig.decode.behaviour = StubBehaviour(first_gap=0.3, tokens=("Howdy", " there"))
    resp = await rig.post({**BODY, "stream": True})
    text = "".join(event_text(e) for e in stream_events(await resp.text()))
    assert text == "HelloHowdy there"  # nothing of decode's is lost
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'kvpush_proxy_first_token_total{source="mismatch"} 1.0' in metrics
    # learned: that decode's streams now start with its own token, not pinned to another
    resp = await rig.post({**BODY, "stream": True})
    assert "".join(event_text(e) for e in stream_events(await resp.text())) == "Howdy there"
    assert "vllm_xargs" not in rig.decode.received[-1][1]
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert 'kvpush_proxy_first_token_total{source="decode"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_a_decode_that_says_it_samples_its_own_first_token_gives_it(mode: str) -> None:
    """A drafting decode (speculative decoding: vLLM loads no custom logits processor)
    says so on /metrics; the proxy asks once it is healthy, and streams its token only."""
    async for rig in make_rig(mode, health_interval=0.1):
        labels = f'auth="on",engine="0",first_token="own",mode="{mode}",role="decode"'
        rig.decode.metrics = "kvpush:info{" + labels + "} 1.0\n"
        rig.decode.behaviour = StubBehaviour(first_gap=0.3, tokens=("Howdy", " there"))
        await asyncio.sleep(0.5)  # a few health checks
        resp = await rig.post({**BODY, "stream": True})
        events = stream_events(await resp.text())
        assert "".join(event_text(e) for e in events) == "Howdy there"
        assert {e["id"] for e in events} == {"d"}
        assert "vllm_xargs" not in rig.decode.received[-1][1]
        metrics = await (await rig.session.get(rig.url + "/metrics")).text()
        assert 'kvpush_proxy_first_token_total{source="decode"} 1.0' in metrics
        assert 'kvpush_proxy_first_token_total{source="mismatch"}' not in metrics
        assert 'kvpush_proxy_first_token_total{source="prefill"}' not in metrics


def test_the_first_token_counts_are_read_by_source() -> None:
    metrics = Metrics({})
    assert metrics.first_token_counts() == {}
    metrics.first_token.labels("prefill").inc(3)
    metrics.first_token.labels("decode").inc()
    assert metrics.first_token_counts() == {"prefill": 3, "decode": 1}


async def test_first_token_from_decode_and_unstreamed_requests_are_not_pinned() -> None:
    async for rig in make_rig("push", first_token="decode"):
        rig.decode.behaviour = StubBehaviour(first_gap=0.2)
        events = stream_events(await (await rig.post({**BODY, "stream": True})).text())
        assert [e["id"] for e in events] == ["d", "d", "d"]
        assert "vllm_xargs" not in rig.decode.received[0][1]
    async for rig in make_rig("pull"):
        await rig.post(BODY)
        await rig.post({**BODY, "stream": True, "logprobs": 1})
        assert all("vllm_xargs" not in body for _, body in rig.decode.received)


async def test_clients_cannot_set_the_proxys_vllm_xargs(rig: Rig) -> None:
    resp = await rig.post({**BODY, "vllm_xargs": {"kvpush_first_token_of": "someone-else"}})
    assert resp.status == 400 and "kvpush_" in (await resp.json())["error"]["message"]
    ok = await rig.post({**BODY, "stream": True, "vllm_xargs": {"mine": 1}})
    assert ok.status == 200
    await ok.read()
    assert rig.decode.received[-1][1]["vllm_xargs"]["mine"] == 1


def test_an_in_process_proxy_serves_on_the_loop_kvpush_proxy_uses() -> None:
    """`kvpush up` and the benchmarks host the proxy in-process through `run_proxy_loop`:
    what they measure is the proxy on uvloop, as `kvpush proxy` deploys it."""
    uvloop = pytest.importorskip("uvloop")
    from kvpush.proxy.server import run_proxy_loop

    async def one_request() -> tuple[asyncio.AbstractEventLoop, Any]:
        async for rig in make_rig("push"):
            answer = await (await rig.post(BODY)).json()
        return asyncio.get_running_loop(), answer

    loop, answer = run_proxy_loop(one_request())
    assert isinstance(loop, uvloop.Loop)
    assert answer["choices"][0]["text"]


async def test_a_streamed_answer_counts_once_the_client_has_it_all(rig: Rig) -> None:
    """A client that closes the connection as soon as it read the last chunk (urllib,
    requests) left while the proxy finished the request: it still counts as ok, and one
    that left mid-answer as the client's going."""

    def read_all(timeout: float = 10.0) -> str:
        request = urllib.request.Request(
            rig.url + "/v1/completions",
            data=json.dumps({**BODY, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return str(resp.read().decode())

    answers = await asyncio.gather(*(asyncio.to_thread(read_all) for _ in range(12)))
    assert all(a.rstrip().endswith("data: [DONE]") for a in answers)
    await asyncio.sleep(0.2)  # the handlers' last steps
    metrics = await (await rig.session.get(rig.url + "/metrics")).text()
    assert f'kvpush_proxy_requests_total{{mode="{rig.mode}",outcome="ok"}} 12.0' in metrics
    rig.decode.behaviour = StubBehaviour(hang=True)
    with pytest.raises((TimeoutError, urllib.error.URLError)):  # it leaves, unanswered
        await asyncio.to_thread(read_all, 0.5)
    for _ in range(100):
        metrics = await (await rig.session.get(rig.url + "/metrics")).text()
        if 'outcome="client_gone"} 1.0' in metrics:
            break
        await asyncio.sleep(0.1)
    assert 'outcome="client_gone"} 1.0' in metrics
