"""The control port's addresses (`host` advertised, `bind_host` listened on) and the
target-side NIXL progress, without NIXL or vLLM."""

from __future__ import annotations

import socket
import time

import pytest

from kvpush.node import progress as progress_module
from kvpush.node.config import KvpushConfig
from kvpush.node.context import Identity
from kvpush.node.progress import TargetProgress
from kvpush.node.worker import WorkerSide
from tests.node_kv import KVMemory, free_port
from tests.unit.test_node_parts import FakeTransport

SECRET = {"KVPUSH_SECRET": "s3cret"}


def test_bind_host_defaults_to_host_and_is_a_known_key() -> None:
    config = KvpushConfig.from_extra({"host": "10.0.0.1"}, env=SECRET)
    assert (config.host, config.listen_host) == ("10.0.0.1", "10.0.0.1")
    config = KvpushConfig.from_extra({"host": "10.0.0.1", "bind_host": "0.0.0.0"}, env=SECRET)
    assert (config.host, config.listen_host) == ("10.0.0.1", "0.0.0.0")
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2", **SECRET}
    assert KvpushConfig.from_extra({}, env=env).listen_host == "10.0.0.2"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]", "", "*"])
def test_a_wildcard_host_is_refused_naming_bind_host(wildcard: str) -> None:
    with pytest.raises(ValueError, match="peers cannot connect to.*set bind_host") as info:
        KvpushConfig.from_extra({"host": wildcard}, env=SECRET)
    assert "reachable address" in str(info.value)
    with pytest.raises(ValueError, match="peers cannot connect to"):
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": wildcard or "0.0.0.0", **SECRET}
        KvpushConfig.from_extra({}, env=env)


def worker(role: str, **config: str) -> WorkerSide:
    side = WorkerSide(
        KvpushConfig(mode="pull", port=free_port(), secret=b"s3cret", **config),  # type: ignore[arg-type]
        Identity(f"{role}-0", role, "tiny", 0, 1),
    )
    kv = KVMemory.make(1, 4, 1, 4, 64, 1, None)
    side.start(kv.layout, kv.memory, "bfloat16", transport=FakeTransport())
    return side


def test_the_control_port_listens_on_bind_host_and_advertises_host() -> None:
    side = worker("prefill", host="127.0.0.1", bind_host="0.0.0.0")
    try:
        assert side.server is not None and side.ctx is not None
        listener = side.server._listener
        assert listener is not None and listener.getsockname()[0] == "0.0.0.0"
        assert (side.ctx.hello.host, side.ctx.hello.port) == ("127.0.0.1", side.port)
    finally:
        side.shutdown()
    side = worker("decode", host="127.0.0.1")
    try:
        assert side.server is not None and side.server._listener is not None
        assert side.server._listener.getsockname()[0] == "127.0.0.1"
    finally:
        side.shutdown()


def test_a_host_that_is_not_this_machines_says_to_set_bind_host() -> None:
    with pytest.raises(OSError, match="not an address of this machine.*set bind_host"):
        worker("prefill", host="198.51.100.7")  # TEST-NET-2: no machine's address
    with pytest.raises(OSError, match="bind_host 198.51.100.8 is not an address of this"):
        worker("prefill", host="127.0.0.1", bind_host="198.51.100.8")


def test_ipv6_bind_host_listens_on_both_families() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    side = worker("prefill", host="127.0.0.1", bind_host="::")
    try:
        with socket.create_connection(("127.0.0.1", side.port), timeout=2):
            pass
    finally:
        side.shutdown()


def test_target_progress_runs_only_while_a_transfer_may_be_under_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(progress_module, "LINGER_S", 0.05)
    calls: list[float] = []
    busy = [False]
    thread = TargetProgress(lambda: calls.append(time.monotonic()), lambda: busy[0], "t")
    thread.start()
    try:
        time.sleep(0.1)
        assert calls == [], "idle, nothing runs"
        thread.wake()  # a transfer may start: runs for the linger time even if not busy yet
        time.sleep(0.2)
        assert calls
        settled = len(calls)
        time.sleep(0.1)
        assert len(calls) == settled, "stops once nothing is in flight and the linger passed"
        busy[0] = True
        thread.wake()
        time.sleep(0.3)
        running = len(calls)
        assert running > settled + 10, "keeps running while busy"
        busy[0] = False
        time.sleep(0.15)
        stopped = len(calls)
        time.sleep(0.1)
        assert len(calls) == stopped
    finally:
        thread.stop()
    assert not thread.is_alive()


def test_pull_coordinates_name_host_never_bind_host() -> None:
    from vllm.v1.request import RequestStatus

    from kvpush.vllm.scheduler import SchedulerSide
    from tests.unit.test_vllm_adapter import FakeRequest

    config = KvpushConfig(mode="pull", host="10.0.0.5", port=7100, bind_host="0.0.0.0")
    side = SchedulerSide(config, "prefill-0", is_producer=True)
    req = FakeRequest(
        "p-1", list(range(6)), {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, 6
    )
    _, params = side.request_finished(req, [9, 2])  # type: ignore[arg-type]
    assert params is not None
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.5", 7100)
