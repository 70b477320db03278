"""What the control server hands a node's parts besides plain messages."""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.core.protocol import Hello, Registration


@dataclass(frozen=True, slots=True)
class Registered:
    """A registration, with the Hello its sender handshook with on the same connection
    (`connection`, the server's id for it): the only peer prefill may write for it."""

    registration: Registration
    hello: Hello
    connection: int


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """A peer's control connection to us closed: what it registered on it is void."""

    connection: int
    hello: Hello
