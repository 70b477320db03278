"""Helpers for control-channel tests: a recording handler and hand-made socket clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from kvpush.core.protocol import Hello, LeaseRenew, Message, ReadDone
from kvpush.dataplane.control import Peer


class Recorder:
    """Answers LeaseRenew with ReadDone (and a Hello with `hello`, if given), records
    everything and answers nothing else. A LeaseRenew for transfer "boom" raises."""

    def __init__(self, hello: Hello | None = None) -> None:
        self.hello = hello
        self.received: list[tuple[Message, Peer]] = []
        self.arrived = threading.Event()

    @property
    def messages(self) -> list[Message]:
        return [msg for msg, _ in self.received]

    def __call__(self, msg: Message, peer: Peer) -> Message | None:
        self.received.append((msg, peer))
        self.arrived.set()
        if isinstance(msg, LeaseRenew):
            if msg.transfer_id == "boom":
                raise RuntimeError("handler bug")
            return ReadDone(msg.transfer_id, msg.generation, 0, 1, True, "")
        if isinstance(msg, Hello):
            return self.hello
        return None


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def read_until_closed(sock: socket.socket, timeout: float = 2.0) -> bytes:
    """Everything until the server closes. A server closing with unread bytes makes the
    kernel reset the connection; that counts as closed too."""
    sock.settimeout(timeout)
    received = b""
    with sock:
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def wait_for(done: Callable[[], bool], timeout: float = 3.0) -> float:
    """Poll `done` until true; returns the seconds it took."""
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.005)
    return time.monotonic() - started
