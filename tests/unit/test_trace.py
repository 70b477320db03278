"""`kvpush bench sweep --trace`'s chunk timestamps at the proxy, through a real proxy in
front of stub backends, how a burst is told apart at the proxy and at the client, and the
CPU and run-queue wait it reads from /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from kvpush.bench.trace import Tracer, burst_shares, cpu_delta, proxy_chunk_times, tree_cpu
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.rewrite import Backend
from kvpush.proxy.server import PROXY_KEY, start_proxy
from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub
from kvpush.testbed.topology import Topology, TopologyConfig


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_proxy_keeps_each_chunk_of_a_streamed_answer_only_while_asked() -> None:
    tokens = tuple(f" t{i}" for i in range(8))
    prefill = StubBackend("prefill-0")
    decode = StubBackend("decode-0", StubBehaviour(token_gap=0.01, tokens=tokens))
    p_runner, p_url = await serve_stub(prefill)
    d_runner, d_url = await serve_stub(decode)
    port = free_port()
    config = ProxyConfig(
        mode="push",
        prefill=[Backend(p_url, "prefill-0", "127.0.0.1", 5600)],
        decode=[Backend(d_url)],
    )
    runner = await start_proxy(config, "127.0.0.1", port)
    proxy = runner.app[PROXY_KEY]
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            await (await session.post(url, json=body)).read()
            assert proxy.chunk_logs is None  # off unless a tracer asks
            proxy.chunk_logs = {}
            await (await session.post(url, json=body)).read()
            logs = proxy.chunk_logs
    finally:
        for r in (runner, p_runner, d_runner):
            await r.cleanup()
    ((request, chunks),) = logs.items()
    times = [at for at, _ in chunks]
    assert len(chunks) >= len(tokens) and times == sorted(times)
    assert times[-1] - times[0] >= 0.06  # spread as decode sent them, 10 ms apart
    (traced,) = proxy_chunk_times(logs, times[0])
    assert traced["request"] == request and traced["chunks_s"][0] == 0.0
    assert burst_shares(None, [traced])["one_burst_proxy"] == 0.0


def test_an_answer_in_one_chunk_and_a_late_done_is_one_burst_at_the_proxy() -> None:
    burst = {"chunks_s": [1.0, 1.2], "bytes": [3000, 14]}  # every token, then [DONE]
    streamed = {"chunks_s": [1.0 + 0.004 * i for i in range(32)], "bytes": [100] * 32}
    raw = {"ttfts": [0.2, 0.1], "latencies": [0.2, 0.3], "output_lens": [32, 32]}
    shares = burst_shares(raw, [burst, streamed])
    assert shares == {"one_burst_client": 0.5, "one_burst_proxy": 0.5}


def test_a_client_that_exits_before_the_run_ends_keeps_its_cpu_seconds(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    topology = Topology(TopologyConfig(model=tmp_path, setup="kvpush-push", workdir=tmp_path))
    tracer = Tracer(topology, every=0.05)
    tracer.start()
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    client = subprocess.Popen([sys.executable, "-c", burn])
    tracer.watch_client(client.pid)
    client.wait(10)
    time.sleep(0.2)  # the tracer's last readings come after the client has gone
    tracer.stop()
    traced = tracer.result(None, [], [], [])
    (process,) = traced["cpu"]["client"]
    assert process["cpu_s"] >= 0.2


def test_processes_that_share_one_core_show_their_wait_for_it() -> None:
    """Two busy processes confined to one core take turns on it: each stands runnable
    without the core about as long as it runs, and the trace says so."""
    core = min(os.sched_getaffinity(0))
    # each burns 0.3 s of CPU, then stays alive (asleep), so a reading taken after both
    # burned still finds them in the tree, however slowly the box started them
    burn = (
        "import time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\ntime.sleep(30)"
    )
    both = f"{sys.executable} -c '{burn}' & {sys.executable} -c '{burn}'; wait"
    parent = subprocess.Popen(
        ["sh", "-c", both],
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        start_new_session=True,
    )
    try:
        before = tree_cpu(parent.pid)
        deadline = time.monotonic() + 20
        burners: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            time.sleep(0.05)
            burners = [p for p in cpu_delta(before, tree_cpu(parent.pid)) if p["cpu_s"] >= 0.25]
            if len(burners) == 2:
                break
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert len(burners) == 2, burners
    for process in burners:
        assert process["waited_s"] >= 0.05, process
        assert process["threads_waited"], process
