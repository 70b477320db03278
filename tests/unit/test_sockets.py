"""`kvpush.dataplane.sockets`: reading this process's TCP sockets from /proc, and cutting
the connections a peer's late bytes could arrive on (no NIXL: plain sockets on loopback)."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator

import pytest

from kvpush.dataplane import sockets
from kvpush.dataplane.sockets import ESTABLISHED, LISTEN, TcpSocket

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")

# Lines as Linux prints them (little-endian host): 127.0.0.1:8080 listening, and an
# established IPv6 connection from ::ffff:198.18.0.3:51603 to [::1]:32971.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4711 1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue
   0: 00000000000000000000000001000000:80CB 0000000000000000FFFF0000030012C6:C993 01 \
00000000:00000000 00:00000000 00000000     0        0 4712 1
"""


def test_addresses_read_as_the_kernel_prints_them() -> None:
    assert sockets.parse_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert sockets.parse_address("030012C6:C993") == ("198.18.0.3", 51603)
    ipv6 = "00000000000000000000000001000000:80CB"
    assert sockets.parse_address(ipv6) == ("::1", 32971)
    mapped = "0000000000000000FFFF0000030012C6:C993"
    assert sockets.parse_address(mapped) == ("198.18.0.3", 51603), "IPv4 mapped into IPv6"
    with pytest.raises(ValueError):
        sockets.parse_address("0100:1F90")


def test_tables_map_inodes_to_both_ends_and_state() -> None:
    assert sockets.parse_table(TCP) == {4711: (("127.0.0.1", 8080), ("0.0.0.0", 0), LISTEN)}
    parsed = sockets.parse_table(TCP6)
    assert parsed == {4712: (("::1", 32971), ("198.18.0.3", 51603), ESTABLISHED)}


def test_only_open_connections_on_the_given_ports_from_the_given_hosts_are_cut() -> None:
    found = [
        TcpSocket(5, ("198.18.0.2", 40000), ("198.18.0.3", 51603), ESTABLISHED),  # cut
        TcpSocket(6, ("198.18.0.2", 40000), ("198.18.0.4", 51604), ESTABLISHED),  # other host
        TcpSocket(7, ("198.18.0.2", 5555), ("198.18.0.3", 51605), ESTABLISHED),  # other port
        TcpSocket(8, ("198.18.0.2", 40000), ("0.0.0.0", 0), LISTEN),  # UCX's listener
        TcpSocket(9, ("::ffff:198.18.0.2", 40000), ("::ffff:198.18.0.3", 1), ESTABLISHED),
    ]
    chosen = sockets.connections_to_cut(found, {40000}, ["198.18.0.3"])
    assert [s.fd for s in chosen] == [5, 9]


@pytest.fixture
def connected() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """A listener on loopback, a client connected to it, and the accepted end."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        with client, accepted:
            yield listener, client, accepted


@linux
def test_this_processes_sockets_are_found(
    connected: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listener, client, accepted = connected
    port = listener.getsockname()[1]
    assert port in sockets.listening_ports()
    mine = {s.fd: s for s in sockets.own_sockets()}
    assert mine[accepted.fileno()].local == ("127.0.0.1", port)
    assert mine[accepted.fileno()].remote == client.getsockname()[:2]
    assert mine[accepted.fileno()].state == ESTABLISHED


@linux
def test_a_cut_connection_reads_nothing_more_and_its_peer_sees_it_closed(
    connected: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listener, client, accepted = connected
    port = listener.getsockname()[1]
    assert sockets.cut({port}, ["127.0.0.2"]) == [], "another host: left alone"
    client.sendall(b"before")
    [done] = sockets.cut({port}, ["127.0.0.1"])
    assert done.fd == accepted.fileno()
    client.sendall(b"after")
    assert b"after" not in _drained(accepted), "nothing sent after the cut is read"
    assert _drained(client) == b"", "the peer sees the connection closed (or reset)"
    assert port in sockets.listening_ports(), "the listener itself is not touched"


def _drained(sock: socket.socket) -> bytes:
    """What `sock` still reads, until the connection's end or reset."""
    sock.settimeout(2.0)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(100):
            got += chunk
    return got
