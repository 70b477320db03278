"""Adversarial clients against the control server, all on loopback and bounded: a few
dozen connections at most, timeouts of a fraction of a second.

Nothing about a worker may reach a peer that has not proved the shared secret, and nobody
without it may hold the server's memory or lock other peers out: connections that never
greet, half greetings, oversized frames before authentication, a flood from one address,
idle connections.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpush.core.planning import KVLayout
from kvpush.core.protocol import (
    GREETING_SIZE,
    MAC_SIZE,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Hello,
    LeaseRenew,
    ReadDone,
    Registration,
    Seal,
    encode,
    greeting,
    parse_greeting,
)
from kvpush.dataplane.control import (
    ControlClient,
    ControlServer,
    Limits,
    frame,
    proof,
)
from tests.control_peers import Recorder, read_until_closed, recv_exactly, wait_for

SECRET = b"bounds-test-secret"
NONCE = b"c" * NONCE_SIZE
HELLO = Hello(
    version=PROTOCOL_VERSION,
    engine_id="prefill-0",
    role="prefill",
    mode="push",
    model="tiny",
    kv_dtype="bfloat16",
    tp_rank=0,
    tp_size=1,
    layout=KVLayout((0x1000, 0x9000), 4, 16, 2, 8, 256, 128, 8, 2),
    agent_name="agent-prefill-0",
    agent_metadata=b"nixl metadata: connection info and memory keys",
    memory=((0x1000, 0x1000), (0x9000, 0x1000)),
)
# Short timers so that every test ends within a second or two.
FAST = Limits(greeting_timeout_s=0.3, log_every_s=60.0)


@pytest.fixture
def worker() -> Recorder:
    """The worker's handler: answers a Hello with the worker's own (what an attacker wants)."""
    return Recorder(HELLO)


@pytest.fixture
def serve(worker: Recorder) -> Iterator[Callable[..., ControlServer]]:
    started: list[ControlServer] = []

    def make(secret: bytes | None = SECRET, **limits: Any) -> ControlServer:
        server = ControlServer(
            "127.0.0.1", 0, worker, secret=secret, limits=dataclasses.replace(FAST, **limits)
        )
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=2.0, source_address=(source, 0))
    return sock


def greeted(
    port: int, secret: bytes | None = SECRET, source: str = "127.0.0.1"
) -> tuple[socket.socket, bytes]:
    """A hand-made client past greeting and (with `secret`) both proofs; returns it and the
    server's nonce, which its frames must carry."""
    sock = connect(port, source)
    server_nonce = parse_greeting(recv_exactly(sock, GREETING_SIZE))
    sock.sendall(greeting(NONCE))
    if secret is not None:
        sock.sendall(proof(secret, "client", server_nonce, NONCE))
        assert recv_exactly(sock, MAC_SIZE) == proof(secret, "server", server_nonce, NONCE)
    return sock, server_nonce


def served(server: ControlServer, source: str = "127.0.0.1") -> bool:
    """A genuine client gets its answer."""
    with ControlClient("127.0.0.1", server.port, secret=server.secret, timeout=2.0) as client:
        if source != "127.0.0.1":
            sock, nonce = greeted(server.port, server.secret, source)
            with sock:
                sock.sendall(frame(LeaseRenew("t", 0), server.secret, Seal(nonce, 0)))
                expected = frame(ReadDone("t", 0, 0, 1, True, ""), server.secret, Seal(NONCE, 0))
                return recv_exactly(sock, len(expected)) == expected
        return client.request(LeaseRenew("t", 0)) == ReadDone("t", 0, 0, 1, True, "")


# -- nothing about a worker reaches an unauthenticated peer --------------------------------


def test_a_hello_without_the_secret_gets_no_answer(
    serve: Callable[..., ControlServer], worker: Recorder
) -> None:
    server = serve()
    attempts = {
        # greeting, then a Hello straight away: no proof
        "no proof": greeting(NONCE) + frame(HELLO),
        "wrong secret": greeting(NONCE) + b"p" * MAC_SIZE + frame(HELLO, b"not the secret"),
    }
    for name, data in attempts.items():
        sock = connect(server.port)
        server_greeting = recv_exactly(sock, GREETING_SIZE)
        sock.sendall(data)
        received = read_until_closed(sock)
        # The server's proof (bound to this connection's nonces) and then the close.
        server_nonce = parse_greeting(server_greeting)
        assert received == proof(SECRET, "server", server_nonce, NONCE), name
    # With the proof right but the Hello unsigned or signed with another secret:
    for secret in (None, b"not the secret"):
        sock, nonce = greeted(server.port)
        sock.sendall(frame(HELLO, secret, Seal(nonce, 0)))
        assert read_until_closed(sock) == b""
    assert worker.received == [], "no unauthenticated frame reached the worker"
    assert server.rejected == {"bad_mac": 4}
    assert served(server)


def test_a_client_tells_nothing_to_a_server_without_the_secret() -> None:
    """A fake kvpush server that does not know the secret (a forged address in
    kv_transfer_params): the client sends its greeting and proof, and not one frame."""
    got = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def impostor() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(greeting(b"s" * NONCE_SIZE))
                conn.sendall(b"guessed proof".ljust(MAC_SIZE, b"."))
                conn.settimeout(2.0)
                with pytest.raises((TimeoutError, ConnectionError)):
                    while chunk := conn.recv(4096):
                        got.extend(chunk)
                    raise ConnectionError

        thread = threading.Thread(target=impostor)
        thread.start()
        client = ControlClient("127.0.0.1", listener.getsockname()[1], secret=SECRET, timeout=2.0)
        with client, pytest.raises(ConnectionError, match="did not prove the shared secret"):
            client.request(HELLO)
        thread.join()
    assert len(got) == GREETING_SIZE + MAC_SIZE, "greeting and proof only, no Hello"
    assert b"nixl metadata" not in got


def test_without_a_secret_anyone_gets_the_hello(serve: Callable[..., ControlServer]) -> None:
    """What `insecure: true` means: the worker answers whoever asks."""
    server = serve(secret=None)
    sock, nonce = greeted(server.port, secret=None)
    with sock:
        sock.sendall(frame(HELLO, None, Seal(nonce, 0)))
        reply = frame(HELLO, None, Seal(NONCE, 0))
        assert recv_exactly(sock, len(reply)) == reply


# -- greeting deadline, half greetings ------------------------------------------------------


def test_connections_that_never_greet_are_closed_at_the_greeting_deadline(
    serve: Callable[..., ControlServer],
) -> None:
    server = serve()
    silent = [connect(server.port) for _ in range(10)]
    half = connect(server.port)
    half.sendall(greeting(NONCE)[:10])  # half a greeting
    no_proof = connect(server.port)
    no_proof.sendall(greeting(NONCE) + b"p" * (MAC_SIZE - 1))  # one byte short of a proof
    assert served(server), "served while they wait"
    started = time.monotonic()
    for sock in [*silent, half, no_proof]:
        read_until_closed(sock)  # returns when the server closes it
    took = time.monotonic() - started
    assert took < 1.5, f"closed after {took:.2f} s; the deadline is 0.3 s"
    assert server.rejected == {"greeting_timeout": 12}
    wait_for(lambda: server.connections == 0)


def test_an_unauthenticated_connection_buffers_no_more_than_greeting_and_proof(
    serve: Callable[..., ControlServer],
) -> None:
    server = serve(greeting_timeout_s=5.0)
    sock = connect(server.port)
    recv_exactly(sock, GREETING_SIZE)
    sock.sendall(greeting(NONCE) + b"p" * (MAC_SIZE - 1))
    time.sleep(0.1)
    held = [len(c.inbuf) for c in list(server._conns.values())]
    assert held and max(held) <= MAC_SIZE
    # A megabyte after the greeting: read as a wrong proof, the connection closed at once.
    flood = connect(server.port)
    recv_exactly(flood, GREETING_SIZE)
    with pytest.raises(OSError):
        flood.sendall(greeting(NONCE) + b"x" * (1 << 20))
        time.sleep(0.5)
        flood.sendall(b"x" * (1 << 20))
    read_until_closed(flood)
    sock.close()
    assert server.rejected == {"bad_mac": 1}


def test_a_timer_in_the_future_does_not_spin(serve: Callable[..., ControlServer]) -> None:
    server = serve(greeting_timeout_s=30.0, idle_timeout_s=30.0)
    assert served(server)  # an authenticated connection with an idle deadline...
    pending = connect(server.port)  # ...and one in its greeting
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    pending.close()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.05, f"{cpu:.3f} s of CPU in 0.5 s while waiting"


# -- frame sizes before authentication -------------------------------------------------------


def big_registration(ids: int) -> Registration:
    return Registration(
        "t", "r", "decode-0", "127.0.0.1", 1, 0, 1, tuple(range(1 << 20, (1 << 20) + ids)), 1, 0, 1
    )


def test_without_a_secret_the_first_frame_is_held_to_the_small_limit(
    serve: Callable[..., ControlServer], worker: Recorder
) -> None:
    server = serve(secret=None, unauthenticated_frame=64 << 10)
    big = big_registration(20_000)  # ~100 KB: over the first-frame limit, under the full one
    assert 64 << 10 < len(encode(big)) < 1 << 20
    sock, nonce = greeted(server.port, secret=None)
    sock.sendall(struct.pack(">I", len(encode(big, None, Seal(nonce, 0)))))
    assert read_until_closed(sock) == b"", "refused on its length alone"
    assert server.rejected == {"too_large": 1}
    # After a first valid frame the full limit applies.
    sock, nonce = greeted(server.port, secret=None)
    with sock:
        sock.sendall(frame(LeaseRenew("t", 0), None, Seal(nonce, 0)))
        reply = frame(ReadDone("t", 0, 0, 1, True, ""), None, Seal(NONCE, 0))
        assert recv_exactly(sock, len(reply)) == reply
        sock.sendall(frame(big, None, Seal(nonce, 1)))
        wait_for(lambda: big in worker.messages)


# -- connection limits ------------------------------------------------------------------------


def test_a_flood_from_one_address_does_not_lock_out_another(
    serve: Callable[..., ControlServer],
) -> None:
    server = serve(greeting_timeout_s=5.0, max_unauthenticated_per_host=4)
    flood = [connect(server.port) for _ in range(4)]
    for sock in flood:
        recv_exactly(sock, GREETING_SIZE)
    refused = [connect(server.port) for _ in range(3)]
    for sock in refused:
        assert read_until_closed(sock) == b"", "closed without a greeting"
    assert server.rejected == {"too_many_from_host": 3}
    assert served(server, source="127.0.0.2"), "another address is served"
    for sock in flood:
        sock.close()


def test_a_host_at_its_connection_limit_is_refused_others_are_not(
    serve: Callable[..., ControlServer],
) -> None:
    server = serve(max_connections_per_host=2)
    held = [greeted(server.port)[0] for _ in range(2)]
    wait_for(lambda: server.connections == 2)
    assert read_until_closed(connect(server.port)) == b""
    assert server.rejected == {"too_many_from_host": 1}
    assert served(server, source="127.0.0.2")
    for sock in held:
        sock.close()


def test_when_full_a_new_connection_replaces_the_oldest_one_still_greeting(
    serve: Callable[..., ControlServer],
) -> None:
    """Connections that never greet cannot keep a genuine peer out, even from many
    addresses: the oldest one in its greeting makes room."""
    server = serve(greeting_timeout_s=5.0, max_unauthenticated=4)
    sources = [f"127.0.0.{i}" for i in range(10, 14)]
    idle = [connect(server.port, source) for source in sources]
    for sock in idle:
        recv_exactly(sock, GREETING_SIZE)
    wait_for(lambda: server.connections == 4)
    started = time.monotonic()
    assert served(server)
    assert time.monotonic() - started < 1.0
    assert read_until_closed(idle[0]) == b"", "the oldest was replaced"
    assert server.rejected == {"greeting_evicted": 1}
    for sock in idle:
        sock.close()


def test_connections_beyond_the_global_limit_evict_greeting_ones_first(
    serve: Callable[..., ControlServer],
) -> None:
    server = serve(greeting_timeout_s=5.0, max_connections=3)
    genuine = [ControlClient("127.0.0.1", server.port, secret=SECRET) for _ in range(2)]
    for client in genuine:
        assert client.request(LeaseRenew("t", 0)) == ReadDone("t", 0, 0, 1, True, "")
    squatter = connect(server.port, "127.0.0.9")
    recv_exactly(squatter, GREETING_SIZE)
    wait_for(lambda: server.connections == 3)
    third = ControlClient("127.0.0.1", server.port, secret=SECRET)
    assert third.request(LeaseRenew("t", 1)) == ReadDone("t", 1, 0, 1, True, "")
    assert read_until_closed(squatter) == b""
    # Full of authenticated connections: the next one is refused.
    with pytest.raises(ConnectionError):
        ControlClient("127.0.0.1", server.port, secret=SECRET).request(LeaseRenew("t", 2))
    assert server.rejected == {"greeting_evicted": 1, "too_many_connections": 1}
    for client in [*genuine, third]:
        client.close()


# -- idle timeout -------------------------------------------------------------------------


def test_an_idle_connection_is_closed_and_the_client_reconnects(
    serve: Callable[..., ControlServer],
) -> None:
    server = serve(idle_timeout_s=0.3)
    with ControlClient("127.0.0.1", server.port, secret=SECRET, timeout=2.0) as client:
        assert client.request(LeaseRenew("t", 0)) == ReadDone("t", 0, 0, 1, True, "")
        first = client.connection
        wait_for(lambda: server.idle_closed == 1)
        assert server.connections == 0
        assert client.request(LeaseRenew("t", 1)) == ReadDone("t", 1, 0, 1, True, "")
        assert client.connection == first + 1
    assert server.rejected == {}


def test_a_client_replaces_a_connection_before_the_server_would_close_it(
    serve: Callable[..., ControlServer], worker: Recorder
) -> None:
    """A frame sent at the moment the server closes an idle connection would be lost; the
    client replaces a connection idle for half the server's timeout before using it."""
    server = serve(idle_timeout_s=0.4)
    client = ControlClient("127.0.0.1", server.port, secret=SECRET, timeout=2.0, idle_s=0.2)
    with client:
        client.send(LeaseRenew("t", 0))
        time.sleep(0.3)
        client.send(LeaseRenew("t", 1))
        assert client.connection == 2
        wait_for(lambda: len(worker.received) == 2)
    assert server.rejected == {}


# -- logging ------------------------------------------------------------------------------


def test_refusals_are_counted_each_but_logged_at_most_once_per_interval(
    serve: Callable[..., ControlServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = serve()
    with caplog.at_level(logging.WARNING, logger="kvpush.dataplane.control"):
        for _ in range(20):
            sock, _ = greeted(server.port)
            sock.sendall(struct.pack(">I", 5) + b"hello")
            read_until_closed(sock)
    assert server.rejected == {"bad_magic": 20}
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
