"""This process's TCP sockets, read from Linux's `/proc`: which ports NIXL's UCX listens on,
and cutting the connections a peer's late bytes could still arrive on.

Why: over UCX's TCP transport a released WRITE is not recalled. What the writer's kernel
already holds in its send queue (hundreds of KB to a few MB) is delivered whenever the
link lets it, and UCX on the target copies it into the blocks the WRITE named, even after
both sides gave the transfer up and the target handed the blocks to another request.
Shutting down the target's end of that connection stops it: UCX reads nothing more from
it (what its kernel holds is dropped with it) and closes it, and the writer's next WRITE
on it fails at once as the peer's disconnection (`remote_disconnect`), after which kvpush
handshakes again.

The target tells UCX's connections from the others (vLLM's own, kvpush's control
channel) by their local port: the ports UCX listens on, read around the creation of the
NIXL agent (`listening_ports` before and after). It tells the peer's by the remote
address. Linux only: elsewhere nothing is found and nothing is cut.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from collections.abc import Collection, Iterator
from dataclasses import dataclass

log = logging.getLogger("kvpush.transport")

ESTABLISHED, LISTEN = 0x01, 0x0A
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One TCP socket of this process, as `/proc/net/tcp{,6}` shows it."""

    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int


def parse_address(field: str) -> tuple[str, int]:
    """`/proc/net/tcp`'s "0100007F:1F90" (or tcp6's 32 hex digits) -> ("127.0.0.1", 8080).

    The kernel prints each 32-bit word of the address in host order (little-endian here);
    an IPv4 address mapped into IPv6 comes back as plain IPv4.
    """
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    if len(raw) not in (4, 16):
        raise ValueError(f"not an address of /proc/net/tcp: {field!r}")
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _normal(str(ipaddress.ip_address(ordered))), int(hex_port, 16)


def parse_table(text: str) -> dict[int, tuple[tuple[str, int], tuple[str, int], int]]:
    """`/proc/net/tcp{,6}` -> {socket inode: (local, remote, state)}."""
    table = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote = parse_address(fields[1]), parse_address(fields[2])
        table[int(fields[9])] = (local, remote, int(fields[3], 16))
    return table


def own_sockets(proc: str = "/proc/self") -> list[TcpSocket]:
    """Every TCP socket this process holds (each once, by its lowest descriptor)."""
    inodes: dict[int, int] = {}
    try:
        names = os.listdir(f"{proc}/fd")
    except OSError:
        return []
    for name in names:
        try:
            match = _SOCKET_LINK.fullmatch(os.readlink(f"{proc}/fd/{name}"))
        except OSError:  # closed meanwhile
            continue
        if match:
            inode, fd = int(match.group(1)), int(name)
            inodes[inode] = min(fd, inodes.get(inode, fd))
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}", encoding="ascii") as lines:
                parsed = parse_table(lines.read())
        except OSError:
            continue
        for inode, (local, remote, state) in parsed.items():
            if inode in inodes:
                found.append(TcpSocket(inodes[inode], local, remote, state))
    return found


def listening_ports() -> frozenset[int]:
    """The TCP ports this process listens on."""
    return frozenset(s.local[1] for s in own_sockets() if s.state == LISTEN)


def connections_to_cut(
    found: Collection[TcpSocket], local_ports: Collection[int], remote_ips: Collection[str]
) -> Iterator[TcpSocket]:
    """The open connections accepted on one of `local_ports` from one of `remote_ips`."""
    ips = {_normal(ip) for ip in remote_ips}
    for s in found:
        if s.state == ESTABLISHED and s.local[1] in local_ports and _normal(s.remote[0]) in ips:
            yield s


def cut(local_ports: Collection[int], remote_ips: Collection[str]) -> list[TcpSocket]:
    """Shut down (both ways) this process's connections accepted on one of `local_ports`
    from one of `remote_ips`; returns those it shut down.

    A shutdown acts on the connection, not the descriptor: it reaches the owner's (UCX's)
    descriptor through a duplicate, which is then closed (the owner's stays open until the
    owner closes it)."""
    done = []
    for s in connections_to_cut(own_sockets(), local_ports, remote_ips):
        try:
            dup = socket.socket(fileno=os.dup(s.fd))
        except OSError:  # closed meanwhile
            continue
        try:
            if dup.type != socket.SOCK_STREAM or _local(dup) != s.local:
                continue  # the descriptor was reused for something else meanwhile
            dup.shutdown(socket.SHUT_RDWR)
            done.append(s)
        except OSError as exc:
            log.info("shutting down the connection from %s:%d: %s", *s.remote, exc)
        finally:
            dup.close()
    return done


def _local(sock: socket.socket) -> tuple[str, int]:
    name = sock.getsockname()
    return _normal(name[0]), int(name[1])


def _normal(ip: str) -> str:
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)
