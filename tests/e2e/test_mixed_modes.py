"""A prefill in kvpush pull mode next to a decode in push mode: a deployment mistake.

Requests routed to the pair must fail within seconds with the mismatch named (both modes
and the fix) to the client and in both servers' logs, and both servers must keep serving.
vLLM itself only tells the client "Internal server error" for a failed KV load; the proxy
adds the mismatch, which both servers report on /metrics (kvpush:info).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpush.proxy.rewrite import format_backend
from kvpush.testbed import scrape
from kvpush.testbed.topology import Topology, TopologyConfig, http_ok
from tests.e2e.conftest import BASE_PORT, KV_PORT, PROMPTS, completion, ports_free, post

pytestmark = pytest.mark.e2e
PORT, KV = BASE_PORT + 20, KV_PORT + 20  # clear of the shared deployments
MISMATCH = "mode mismatch: decode decode-0"
DECODE_SEES = "incompatible peer prefill-0: remote prefill-0 runs in pull mode, local in push"


@pytest.fixture(scope="module")
def mixed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    config = TopologyConfig(
        model=tiny_model,
        setup="kvpush-push",
        role_setups={"prefill": "kvpush-pull"},
        port=PORT,
        kv_port=KV,
        eager=True,
        workdir=tmp_path_factory.mktemp("mixed"),
    )
    with Topology(config) as topology:
        topology.start()
        topology.wait_healthy(timeout=400)
        yield topology
    assert ports_free((PORT + 100, PORT + 200, KV, KV + 1))


def named_mismatch(line: str) -> bool:
    """A log line naming the mode mismatch: prefill's refusal of the registration, or
    decode's own check of prefill's Hello (whichever reaches decode first)."""
    return MISMATCH in line or DECODE_SEES in line


@contextmanager
def proxy(mode: str, topology: Topology, port: int) -> Iterator[str]:
    """`kvpush proxy` in `mode` in front of the pair, as an operator would run it."""
    prefill, decode = topology.prefill[0], topology.decode[0]
    cmd = [
        sys.executable,
        "-m",
        "kvpush.cli",
        "proxy",
        "--mode",
        mode,
        "--prefill",
        format_backend(prefill.backend()),
        "--decode",
        decode.url,
        "--port",
        str(port),
        "--request-timeout",
        "45",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "listening on" in line:
                break
        else:
            raise AssertionError(f"kvpush proxy exited with code {proc.wait()}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_mixed_pair_fails_fast_and_names_both_modes(
    mixed: Topology, tiny_model: Path, mode: str
) -> None:
    prefill_log = mixed.prefill[0].log_path
    decode_log = mixed.decode[0].log_path
    seen = tuple(
        sum(named_mismatch(line) for line in log.read_text().splitlines())
        for log in (prefill_log, decode_log)
    )
    with proxy(mode, mixed, PORT + (0 if mode == "push" else 1)) as url:
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as failure:
            post(url + "/v1/completions", completion(tiny_model, PROMPTS[1]), timeout=60)
        took = time.monotonic() - started
        answer = failure.value.read().decode()
    assert took < 10, f"the request took {took:.1f} s to fail: {answer}"
    assert failure.value.code == 502 and "decode backend" in answer, answer
    # vLLM only says "Internal server error"; the proxy names the mismatch from /metrics.
    assert "runs kvpush in pull mode" in answer and "in push mode" in answer, answer
    print(f"client saw, after {took:.2f} s: HTTP {failure.value.code} {answer}")
    for log, before in zip((prefill_log, decode_log), seen, strict=True):
        lines = [line for line in log.read_text().splitlines() if named_mismatch(line)]
        assert len(lines) > before, f"{log} does not name the mismatch"
        line = lines[-1]
        assert "push mode" in line and "pull mode" in line, line
        assert "set the same kv_connector_extra_config.mode on prefill and decode" in line or (
            "configure the same kvpush mode on prefill and decode" in line
        ), line
    mixed.check_alive()
    assert http_ok(mixed.prefill[0].url + "/health") and http_ok(mixed.decode[0].url + "/health")


def test_the_mixed_pair_counts_the_refusals_and_frees_every_block(mixed: Topology) -> None:
    prefill = scrape.scrape(mixed.prefill[0].url)
    assert scrape.total(prefill, "kvpush:failures_total", kind="incompatible_peer") >= 1
    decode = scrape.scrape(mixed.decode[0].url)
    assert scrape.total(decode, "kvpush:failures_total", kind="receive_failed") >= 1
    for server in (*mixed.prefill, *mixed.decode):
        usage = scrape.total(scrape.scrape(server.url), "vllm:kv_cache_usage_perc")
        for _ in range(50):
            if usage == 0:
                break
            time.sleep(0.2)
            usage = scrape.total(scrape.scrape(server.url), "vllm:kv_cache_usage_perc")
        assert usage == 0, f"{server.name} KV usage stayed at {usage}"
