from __future__ import annotations

import socket
import ssl
import statistics
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kvpush.core.protocol import (
    GREETING_SIZE,
    MAC_SIZE,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    LeaseRenew,
    Message,
    ProtocolError,
    ReadDone,
    Seal,
    encode,
    greeting,
    parse_greeting,
)
from kvpush.dataplane.control import (
    ControlClient,
    ControlServer,
    Limits,
    Peer,
    Unreachable,
    frame,
    proof,
)
from tests.control_peers import Recorder, read_until_closed, recv_exactly, wait_for

SECRET = b"control-test-secret"


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def server(recorder: Recorder) -> Iterator[ControlServer]:
    limits = Limits(max_frame=4096)
    with ControlServer("127.0.0.1", 0, recorder, secret=SECRET, limits=limits) as srv:
        yield srv


def client_for(server: ControlServer, secret: bytes | None = SECRET) -> ControlClient:
    return ControlClient("127.0.0.1", server.port, secret=secret, timeout=2.0)


OUR_NONCE = b"n" * NONCE_SIZE


def raw_connect(
    port: int, hello: bytes | None = greeting(OUR_NONCE), secret: bytes | None = SECRET
) -> tuple[socket.socket, bytes]:
    """A hand-made client: connect, read the server's greeting, send ours (`hello`); with
    `secret` (and our own greeting), prove it and check the server's proof."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
    server_nonce = parse_greeting(recv_exactly(sock, GREETING_SIZE))
    if hello is not None:
        sock.sendall(hello)
    if secret is not None and hello == greeting(OUR_NONCE):
        sock.sendall(proof(secret, "client", server_nonce, OUR_NONCE))
        assert recv_exactly(sock, MAC_SIZE) == proof(secret, "server", server_nonce, OUR_NONCE)
    return sock, server_nonce


def raw_send(port: int, data: bytes, hello: bytes | None = greeting(OUR_NONCE)) -> bytes:
    """After the greetings, send raw bytes; then read until the server closes."""
    sock, _ = raw_connect(port, hello)
    if data:
        sock.sendall(data)
    return read_until_closed(sock)


def sealed(msg: Message, nonce: bytes, sequence: int, secret: bytes | None = SECRET) -> bytes:
    return frame(msg, secret, Seal(nonce, sequence))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_request_gets_the_reply(server: ControlServer, recorder: Recorder) -> None:
    with client_for(server) as client:
        reply = client.request(LeaseRenew("t-1", 3))
        assert reply == ReadDone("t-1", 3, 0, 1, True, "")
        assert client.request(LeaseRenew("t-2", 0)) == ReadDone("t-2", 0, 0, 1, True, "")
    (first, peer), (second, peer2) = recorder.received
    assert first == LeaseRenew("t-1", 3) and second == LeaseRenew("t-2", 0)
    assert peer.host == "127.0.0.1" and peer == peer2  # one connection for both
    assert server.port != 0


def test_handler_returning_none_sends_nothing(server: ControlServer, recorder: Recorder) -> None:
    with client_for(server) as client:
        client.send(Cancel("t-1", 1, "client went away"))
        assert recorder.arrived.wait(2.0)
        assert recorder.received[0][0] == Cancel("t-1", 1, "client went away")
        with pytest.raises(TimeoutError, match="no reply to Cancel"):
            client.request(Cancel("t-2", 1, ""), timeout=0.2)
        # the connection was dropped on timeout; the next request reconnects and works
        assert client.request(LeaseRenew("t-3", 0)) == ReadDone("t-3", 0, 0, 1, True, "")


def test_garbage_and_oversized_frames_are_refused_and_counted(server: ControlServer) -> None:
    assert raw_send(server.port, struct.pack(">I", 5) + b"hello") == b""
    assert raw_send(server.port, struct.pack(">I", 5000) + b"x" * 100) == b""
    assert raw_send(server.port, b"GET / HTTP/1.1\r\n\r\n") == b""  # reads as a huge length
    unsigned = encode(LeaseRenew("t", 0))
    assert raw_send(server.port, struct.pack(">I", len(unsigned)) + unsigned) == b""
    assert raw_send(server.port, b"", hello=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
    wrong = b"KPHI" + bytes((PROTOCOL_VERSION + 1,)) + OUR_NONCE
    assert raw_send(server.port, b"", hello=wrong) == b""
    assert server.rejected == {"bad_magic": 2, "too_large": 2, "bad_mac": 1, "bad_version": 1}
    with client_for(server) as client:  # still serving
        assert client.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")


def test_a_refused_frame_closes_only_its_own_connection(server: ControlServer) -> None:
    with client_for(server) as good:
        assert good.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")
        raw_send(server.port, struct.pack(">I", 2) + b"KP")
        assert good.request(LeaseRenew("t-2", 0)) == ReadDone("t-2", 0, 0, 1, True, "")
    assert server.rejected == {"malformed": 1}


def test_replayed_frames_are_refused_and_counted(server: ControlServer, recorder: Recorder) -> None:
    msg = LeaseRenew("t-1", 0)
    answer = frame(ReadDone("t-1", 0, 0, 1, True, ""), SECRET, Seal(OUR_NONCE, 0))
    sock, nonce = raw_connect(server.port)
    recorded = sealed(msg, nonce, 0)
    sock.sendall(recorded)
    assert recv_exactly(sock, len(answer)) == answer  # the genuine frame is served
    sock.sendall(recorded)  # the same frame again on the same connection
    assert read_until_closed(sock) == b""
    assert raw_send(server.port, recorded) == b"", "a recorded frame on a new connection"
    sock, nonce = raw_connect(server.port)
    sock.sendall(sealed(msg, nonce, 1))  # a frame from the future: one was skipped
    assert read_until_closed(sock) == b""
    sock, nonce = raw_connect(server.port)
    sock.sendall(frame(msg, SECRET))  # not sealed at all
    assert read_until_closed(sock) == b""
    assert server.rejected == {"replayed": 4}
    assert [m for m, _ in recorder.received] == [msg], "no replay reached the handler"


def test_a_replayed_reply_is_refused_by_the_client(recorder: Recorder) -> None:
    """A fake server (it knows the secret) that answers with a reply recorded from another
    connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        stale = sealed(ReadDone("t-1", 0, 0, 1, True, ""), b"s" * NONCE_SIZE, 0)
        server_nonce = b"x" * NONCE_SIZE

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(greeting(server_nonce))
                client_nonce = parse_greeting(recv_exactly(conn, GREETING_SIZE))
                conn.sendall(proof(SECRET, "server", server_nonce, client_nonce))
                recv_exactly(conn, MAC_SIZE)
                conn.recv(4096)
                conn.sendall(stale)
                conn.recv(4096)

        thread = threading.Thread(target=serve)
        thread.start()
        with (
            ControlClient("127.0.0.1", port, secret=SECRET, timeout=2.0) as client,
            pytest.raises(ProtocolError, match="another connection"),
        ):
            client.request(LeaseRenew("t-1", 0))
        thread.join()


def test_wrong_secret_is_refused(server: ControlServer, recorder: Recorder) -> None:
    with (
        client_for(server, secret=b"another secret") as client,
        pytest.raises(ConnectionError, match="same shared secret"),
    ):
        client.request(LeaseRenew("t-1", 0))
    # A client with no secret sends its frame at once; the server reads it as a wrong proof
    # and closes, and the client reads the server's proof as a reply of absurd length.
    with (
        client_for(server, secret=None) as client,
        pytest.raises((ConnectionError, ProtocolError), match="same shared secret"),
    ):
        client.request(LeaseRenew("t-1", 0))
    wait_for(lambda: server.rejected.get("bad_mac", 0) >= 2)
    assert set(server.rejected) == {"bad_mac"} and server.rejected["bad_mac"] in (2, 3)
    assert recorder.received == []


def test_connection_refused_names_the_address() -> None:
    port = free_port()
    with ControlClient("127.0.0.1", port, timeout=1.0) as client:
        with pytest.raises(Unreachable, match=f"127.0.0.1:{port}"):
            client.request(LeaseRenew("t-1", 0))
        with pytest.raises(Unreachable, match=f"127.0.0.1:{port}"):
            client.send(LeaseRenew("t-1", 0))


def test_a_peer_that_never_greets_fails_the_connect_within_the_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        client = ControlClient("127.0.0.1", silent.getsockname()[1], timeout=0.3)
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="greeting .* timed out"):
            client.send(LeaseRenew("t-1", 0))
        assert time.monotonic() - started < 2.0


def test_alive_tells_whether_a_connection_still_stands(recorder: Recorder) -> None:
    server = ControlServer("127.0.0.1", 0, recorder)
    server.start()
    client = ControlClient("127.0.0.1", server.port, timeout=2.0)
    assert client.connection == 0 and not client.alive(0), "no connection yet"
    client.request(LeaseRenew("t-1", 0))
    first = client.connection
    assert client.alive(first)
    server.stop()  # as when the peer exits
    deadline = time.monotonic() + 2.0
    while client.alive(first):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with ControlServer("127.0.0.1", server.port, recorder):  # restarted
        client.request(LeaseRenew("t-2", 0))
        assert client.connection == first + 1
        assert client.alive(first + 1) and not client.alive(first)
        client.close()
        assert not client.alive(first + 1)


def test_handler_failure_closes_the_connection_not_the_server(
    server: ControlServer,
) -> None:
    with client_for(server) as client:
        with pytest.raises(ConnectionError):
            client.request(LeaseRenew("boom", 0))
        assert client.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")
    assert server.handler_errors == 2
    assert server.rejected == {}


def test_client_reconnects_after_the_server_restarts(recorder: Recorder) -> None:
    first = ControlServer("127.0.0.1", 0, recorder)
    first.start()
    port = first.port
    client = ControlClient("127.0.0.1", port, timeout=2.0)
    assert client.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")
    first.stop()
    with ControlServer("127.0.0.1", port, recorder):
        recorder.arrived.clear()
        client.send(Cancel("t-1", 0, "after restart"))  # must not vanish into the old socket
        assert recorder.arrived.wait(2.0)
        assert recorder.received[-1][0] == Cancel("t-1", 0, "after restart")
        assert client.request(LeaseRenew("t-2", 0)) == ReadDone("t-2", 0, 0, 1, True, "")
    client.close()


def test_requests_from_many_threads_get_their_own_replies(server: ControlServer) -> None:
    errors: list[str] = []
    with client_for(server) as client:

        def worker(n: int) -> None:
            for i in range(20):
                reply = client.request(LeaseRenew(f"t-{n}-{i}", i))
                if reply != ReadDone(f"t-{n}-{i}", i, 0, 1, True, ""):
                    errors.append(f"{n}/{i}: {reply}")

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []


def test_pipelined_frames_in_one_segment_are_all_answered(server: ControlServer) -> None:
    sock, nonce = raw_connect(server.port)
    with sock:
        sock.sendall(b"".join(sealed(LeaseRenew(f"t-{i}", i), nonce, i) for i in range(50)))
        expected = b"".join(
            sealed(ReadDone(f"t-{i}", i, 0, 1, True, ""), OUR_NONCE, i) for i in range(50)
        )
        received = b""
        while len(received) < len(expected):
            chunk = sock.recv(65536)
            assert chunk
            received += chunk
    assert received == expected


def test_connections_beyond_the_limit_are_refused(recorder: Recorder) -> None:
    with ControlServer("127.0.0.1", 0, recorder, limits=Limits(max_connections=2)) as server:
        first = client_for(server, secret=None)
        second = client_for(server, secret=None)
        assert first.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")
        assert second.request(LeaseRenew("t-2", 0)) == ReadDone("t-2", 0, 0, 1, True, "")
        with socket.create_connection(("127.0.0.1", server.port), timeout=2.0) as sock:
            assert read_until_closed(sock) == b"", "closed without a greeting"
        assert server.rejected == {"too_many_connections": 1}
        second.close()
        third = client_for(server, secret=None)
        deadline = time.monotonic() + 2.0
        while True:  # the server notices the closed connection asynchronously
            try:
                assert third.request(LeaseRenew("t-4", 0)) == ReadDone("t-4", 0, 0, 1, True, "")
                break
            except ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        first.close()
        third.close()


def test_stop_ends_the_thread_and_frees_the_port(recorder: Recorder) -> None:
    server = ControlServer("127.0.0.1", 0, recorder)
    server.start()
    thread = server._thread
    assert thread is not None and thread.is_alive()
    server.stop()
    server.stop()
    assert not thread.is_alive()
    with ControlServer("127.0.0.1", server.port, recorder):
        pass


def test_many_requests_on_one_connection_each_get_their_own_answer(
    server: ControlServer, recorder: Recorder
) -> None:
    """200 requests back to back on one connection: every answer is the one for its own
    request (id and generation), none is lost or reordered, the server saw each once.
    The round trip is printed as information, not asserted (these machines are noisy)."""
    with client_for(server) as client:
        client.request(LeaseRenew("warm-up", 0))
        times = []
        for i in range(200):
            start = time.perf_counter()
            answer = client.request(LeaseRenew(f"t-{i}", i))
            times.append(time.perf_counter() - start)
            assert isinstance(answer, ReadDone), answer
            assert (answer.transfer_id, answer.generation) == (f"t-{i}", i)
    renewals = [m for m in recorder.messages if isinstance(m, LeaseRenew)]
    assert [m.transfer_id for m in renewals] == ["warm-up"] + [f"t-{i}" for i in range(200)]
    assert server.handler_errors == 0
    median = statistics.median(times)
    print(
        f"\ncontrol round trip over loopback: median {median * 1e6:.0f} us, "
        f"p90 {statistics.quantiles(times, n=10)[-1] * 1e6:.0f} us (200 requests)"
    )


def test_send_now_goes_out_only_on_an_open_connection_with_room(recorder: Recorder) -> None:
    """`send_now` never connects, waits or blocks: with the peer not reading, it stops
    once the socket buffers are full, and what it sent arrives, sealed in sequence."""
    gate = threading.Event()

    def handler(msg: Message, peer: Peer) -> Message | None:
        if isinstance(msg, Cancel) and msg.reason == "hold":
            gate.wait(10.0)  # the server reads nothing more meanwhile
        return recorder(msg, peer)

    with ControlServer("127.0.0.1", 0, handler, secret=SECRET) as server:
        client = client_for(server)
        assert not client.send_now(Cancel("t-0", 0, "")), "no connection yet: not made here"
        client.send(Cancel("t-1", 0, "hold"))
        assert client.send_now(Cancel("t-2", 0, ""))
        big = Cancel("t-3", 0, "x" * 4000)
        went = 0
        while client.send_now(big):
            went += 1
            assert went < 10_000, "the socket buffers never filled"
        gate.set()
        client.send(Cancel("t-4", 0, "after"))
        wait_for(lambda: len(recorder.received) == 3 + went)
        client.close()
        assert server.rejected == {}, "every frame sealed in sequence"
    ids = sorted(m.transfer_id for m in recorder.messages)  # handlers may run out of order
    assert ids == ["t-1", "t-2"] + ["t-3"] * went + ["t-4"]


class _Stuck:
    """A connected socket whose next send puts out `count` bytes (0: none, would block)."""

    def __init__(self, sock: socket.socket, count: int) -> None:
        self._sock, self._count = sock, count

    def send(self, data: bytes, flags: int = 0) -> int:
        if self._count:
            return self._sock.send(data[: self._count], flags)
        raise BlockingIOError

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


@pytest.mark.parametrize("count", [0, 7])
def test_send_now_that_could_not_finish_leaves_the_sequence_whole(
    server: ControlServer, recorder: Recorder, count: int
) -> None:
    """Nothing out: the connection stays and the next frame takes the unsent one's place.
    Part of a frame out: the connection is dropped (the peer discards the part with it)."""
    client = client_for(server)
    client.send(Cancel("t-1", 0, ""))
    first = client.connection
    real = client._sock
    assert real is not None
    client._sock = _Stuck(real, count)  # type: ignore[assignment]
    assert not client.send_now(Cancel("t-2", 0, ""))
    if count:
        assert client._sock is None, "a partly sent frame ends its connection"
    else:
        client._sock = real
    client.send(Cancel("t-3", 0, ""))
    wait_for(lambda: len(recorder.received) == 2)
    assert [m.transfer_id for m in recorder.messages] == ["t-1", "t-3"]
    assert client.connection == first + (1 if count else 0)
    assert server.rejected == {}, "no frame out of sequence"
    client.close()


def test_send_now_leaves_tls_and_a_busy_client_to_send(server: ControlServer) -> None:
    client = client_for(server)
    client.send(Cancel("t-1", 0, ""))
    with client._lock:  # another thread is sending
        assert not client.send_now(Cancel("t-2", 0, ""))
    assert client.send_now(Cancel("t-3", 0, ""))
    # bound to a connection (a handshake's): only on that one
    assert not client.send_now(Cancel("t-4", 0, ""), connection=client.connection - 1)
    assert client.send_now(Cancel("t-5", 0, ""), connection=client.connection)
    client.tls = ssl.create_default_context()  # TLS records: always through `send`
    assert not client.send_now(Cancel("t-6", 0, ""))
    client.close()


def test_send_now_after_the_peer_closed_sends_nothing(recorder: Recorder) -> None:
    server = ControlServer("127.0.0.1", 0, recorder)
    server.start()
    client = ControlClient("127.0.0.1", server.port, timeout=2.0)
    client.send(Cancel("t-1", 0, ""))
    server.stop()
    deadline = time.monotonic() + 2.0
    while client.alive(client.connection):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not client.send_now(Cancel("t-2", 0, ""))
    client.close()
