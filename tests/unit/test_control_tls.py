"""The control channel inside mutual TLS 1.3, on loopback.

Certificates are made here with `cryptography` (a CA, a node certificate it signed, and a
stranger's CA and certificate). Python 3.11's `ssl` has no TLS 1.3 PSK, so certificates
are the one way TLS authenticates; the shared secret's proof and MACs still run inside.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.core.protocol import LeaseRenew, ReadDone, Registration
from kvpush.dataplane.control import (
    ControlClient,
    ControlServer,
    Limits,
    tls_contexts,
)
from tests.control_peers import Files, Recorder, issue, wait_for

pytest.importorskip("cryptography.x509")

SECRET = b"tls-test-secret"
METADATA = b"NIXL-AGENT-METADATA-" * 50


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Files, Files]:
    """(ours, a stranger's): node certificates of two unrelated CAs."""
    folder = tmp_path_factory.mktemp("pki")
    return issue(folder, "kvpush-ca", "node"), issue(folder, "other-ca", "stranger")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def tls_server(pki: tuple[Files, Files], recorder: Recorder) -> Iterator[ControlServer]:
    ours, _ = pki
    server_ctx, _ = tls_contexts(ours.cert, ours.key, ours.ca)
    limits = Limits(greeting_timeout_s=2.0)
    with ControlServer("127.0.0.1", 0, recorder, SECRET, limits, tls=server_ctx) as server:
        yield server


def client_ctx(files: Files) -> ssl.SSLContext:
    return tls_contexts(files.cert, files.key, files.ca)[1]


def registration(n_blocks: int) -> Registration:
    blocks = tuple(range(1 << 20, (1 << 20) + n_blocks))
    return Registration("t", "r", "decode-0", "127.0.0.1", 1, 0, 1, blocks, 1, 0, 1)


def test_round_trip_with_certificates_and_the_secret(
    pki: tuple[Files, Files], tls_server: ControlServer, recorder: Recorder
) -> None:
    ours, _ = pki
    ctx = client_ctx(ours)
    with ControlClient("127.0.0.1", tls_server.port, SECRET, timeout=2.0, tls=ctx) as client:
        assert client.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")
        big = registration(150_000)  # ~750 KB: many TLS records in one frame
        client.send(big)
        for i in range(20):
            assert client.request(LeaseRenew(f"t-{i}", i)) == ReadDone(f"t-{i}", i, 0, 1, True, "")
        assert client.alive(client.connection)
    assert big in recorder.messages
    assert tls_server.rejected == {}


def test_round_trip_with_certificates_only(pki: tuple[Files, Files], recorder: Recorder) -> None:
    """No shared secret (insecure: true) but TLS: the certificates authenticate."""
    ours, _ = pki
    server_ctx, ctx = tls_contexts(ours.cert, ours.key, ours.ca)
    with (
        ControlServer("127.0.0.1", 0, recorder, tls=server_ctx) as server,
        ControlClient("127.0.0.1", server.port, timeout=2.0, tls=ctx) as client,
    ):
        assert client.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")


def test_many_threads_share_one_tls_connection(
    pki: tuple[Files, Files], tls_server: ControlServer
) -> None:
    errors: list[str] = []
    ctx = client_ctx(pki[0])
    with ControlClient("127.0.0.1", tls_server.port, SECRET, timeout=2.0, tls=ctx) as client:

        def worker(n: int) -> None:
            for i in range(10):
                if client.request(LeaseRenew(f"{n}-{i}", i)) != ReadDone(
                    f"{n}-{i}", i, 0, 1, True, ""
                ):
                    errors.append(f"{n}/{i}")

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []


def test_the_wire_carries_no_plaintext(pki: tuple[Files, Files], recorder: Recorder) -> None:
    """A relay between client and server sees neither the greeting nor the payload."""
    ours, _ = pki
    server_ctx, ctx = tls_contexts(ours.cert, ours.key, ours.ca)
    seen = bytearray()
    with (
        ControlServer("127.0.0.1", 0, recorder, SECRET, tls=server_ctx) as server,
        socket.create_server(("127.0.0.1", 0)) as relay,
    ):

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while chunk := src.recv(65536):
                    seen.extend(chunk)
                    dst.sendall(chunk)
            except OSError:
                pass
            finally:
                dst.close()

        def serve_relay() -> None:
            inbound, _ = relay.accept()
            outbound = socket.create_connection(("127.0.0.1", server.port))
            threading.Thread(target=pump, args=(outbound, inbound), daemon=True).start()
            pump(inbound, outbound)

        thread = threading.Thread(target=serve_relay, daemon=True)
        thread.start()
        port = relay.getsockname()[1]
        with ControlClient("127.0.0.1", port, SECRET, timeout=2.0, tls=ctx) as client:
            client.send(Registration("t", "r", "decode-0", "10.9.8.7", 1, 0, 1, (1,), 1, 0, 1))
            assert client.request(LeaseRenew("t", 0)) == ReadDone("t", 0, 0, 1, True, "")
    assert len(seen) > 1000
    for plain in (b"KPHI", b"10.9.8.7", b"decode-0"):
        assert plain not in seen


@pytest.mark.parametrize("who", ["stranger", "no certificate", "plain TCP"])
def test_a_client_without_a_valid_certificate_is_refused(
    pki: tuple[Files, Files], tls_server: ControlServer, recorder: Recorder, who: str
) -> None:
    ours, stranger = pki
    ctx: ssl.SSLContext | None = None
    if who != "plain TCP":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(ours.ca)  # it would accept our server
        if who == "stranger":  # its certificate is signed by another CA
            ctx.load_cert_chain(stranger.cert, stranger.key)
    with (
        ControlClient("127.0.0.1", tls_server.port, SECRET, timeout=2.0, tls=ctx) as client,
        pytest.raises(ConnectionError),
    ):
        client.request(LeaseRenew("t", 0))
    wait_for(lambda: tls_server.rejected.get("tls_failed", 0) >= 1)
    assert recorder.received == []


def test_a_client_refuses_a_server_of_another_ca(
    pki: tuple[Files, Files], recorder: Recorder
) -> None:
    ours, stranger = pki
    server_ctx, _ = tls_contexts(stranger.cert, stranger.key, ours.ca)  # trusts our clients
    with (
        ControlServer("127.0.0.1", 0, recorder, SECRET, tls=server_ctx) as server,
        ControlClient("127.0.0.1", server.port, SECRET, timeout=2.0, tls=client_ctx(ours)) as c,
        pytest.raises(ConnectionError, match="certificate verify failed"),
    ):
        c.request(LeaseRenew("t", 0))


def test_a_tls_client_refuses_a_plain_server(pki: tuple[Files, Files], recorder: Recorder) -> None:
    with (
        ControlServer("127.0.0.1", 0, recorder, SECRET) as server,
        ControlClient(
            "127.0.0.1", server.port, SECRET, timeout=2.0, tls=client_ctx(pki[0])
        ) as client,
        pytest.raises(ConnectionError),
    ):
        client.request(LeaseRenew("t", 0))
    assert recorder.received == []


def test_a_stalled_tls_handshake_meets_the_greeting_deadline(
    pki: tuple[Files, Files], recorder: Recorder
) -> None:
    ours, _ = pki
    server_ctx, _ = tls_contexts(ours.cert, ours.key, ours.ca)
    limits = Limits(greeting_timeout_s=0.2)
    with ControlServer("127.0.0.1", 0, recorder, SECRET, limits, tls=server_ctx) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=2.0)
        sock.sendall(b"\x16\x03\x01")  # the start of a ClientHello, then nothing
        with sock:
            assert sock.recv(100) == b""
        assert server.rejected == {"greeting_timeout": 1}


def test_a_restarted_tls_server_is_noticed_and_reconnected(
    pki: tuple[Files, Files], recorder: Recorder
) -> None:
    ours, _ = pki
    server_ctx, ctx = tls_contexts(ours.cert, ours.key, ours.ca)
    first = ControlServer("127.0.0.1", 0, recorder, SECRET, tls=server_ctx)
    first.start()
    client = ControlClient("127.0.0.1", first.port, SECRET, timeout=2.0, tls=ctx)
    assert client.request(LeaseRenew("t-1", 0)) == ReadDone("t-1", 0, 0, 1, True, "")
    connection = client.connection
    first.stop()
    wait_for(lambda: not client.alive(connection))
    with ControlServer("127.0.0.1", first.port, recorder, SECRET, tls=server_ctx):
        assert client.request(LeaseRenew("t-2", 0)) == ReadDone("t-2", 0, 0, 1, True, "")
        assert client.connection == connection + 1
    client.close()


def test_unreadable_tls_files_name_the_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls_cert .* tls_key .* tls_ca"):
        tls_contexts(str(tmp_path / "no.crt"), str(tmp_path / "no.key"), str(tmp_path / "ca"))
