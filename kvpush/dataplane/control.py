"""The control channel: small kvpush messages over TCP between instances.

A connection opens with each side's `protocol.greeting` (protocol version and a fresh
random nonce); then every frame on the wire is a 4-byte big-endian length and
`protocol.encode(msg, secret, seal)`, sealed with the *receiver's* nonce and the frame's
position in that direction. So a frame recorded on one connection is refused on any other
and at any other position ("replayed"), with no clock and no memory of past frames.

`ControlServer` runs one thread that blocks in `selectors` (an idle server costs nothing),
decodes each frame with `protocol.decode` (the one place untrusted bytes are checked) and
calls the handler on that thread; a message the handler returns goes back on the same
connection as the reply. A frame that is oversized, malformed, replayed or not
authenticated with the shared secret is counted in `ControlServer.rejected` by
`ProtocolError.kind`, logged, and its connection closed; other connections are unaffected.

`ControlClient` keeps one connection, sends a frame and (for `request`) waits for one reply;
it reconnects once when the connection turns out to be broken (the peer restarted).
`Unreachable` (nothing listens at the address) tells a peer that is not running from one
that is slow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from kvpush.core.protocol import (
    DEFAULT_MAX_FRAME,
    GREETING_SIZE,
    NONCE_SIZE,
    Message,
    ProtocolError,
    Seal,
    decode,
    encode,
    greeting,
    parse_greeting,
)

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
_RECV_SIZE = 1 << 16


@dataclass(frozen=True, slots=True)
class Peer:
    """The remote end of one control connection, as the server saw it."""

    host: str
    port: int
    conn_id: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


Handler = Callable[[Message, Peer], Message | None]


def frame(msg: Message, secret: bytes | None = None, seal: Seal | None = None) -> bytes:
    """`msg` framed for the control channel."""
    body = encode(msg, secret, seal)
    return _LENGTH.pack(len(body)) + body


class Unreachable(ConnectionError):
    """Nothing listens at the peer's address (connection refused): it is not running."""


def _check_secret(secret: bytes | None) -> None:
    if secret is not None and not secret:
        raise ValueError("the shared secret is empty; configure a non-empty secret or none")


class _HandlerFailed(Exception):
    """The handler raised; the connection is closed so the client fails fast."""


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    peer: Peer
    inbuf: bytearray
    outbuf: bytearray
    nonce: bytes  # ours: frames from the client must carry it
    peer_nonce: bytes = b""  # the client's, from its greeting: our replies carry it
    received: int = 0
    sent: int = 0
    events: int = selectors.EVENT_READ


class ControlServer:
    """Serves kvpush messages on host:port from one background thread.

    `port` 0 picks a free port; `.port` tells which once `start` returned.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        secret: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_connections: int = 1024,
        on_close: Callable[[Peer], None] | None = None,
    ) -> None:
        _check_secret(secret)
        if max_frame <= 0:
            raise ValueError(f"max_frame must be positive, got {max_frame}")
        self.host = host
        self._port = port
        self.handler = handler
        # told (on the server thread) when a connection closes, whoever closed it
        self.on_close = on_close
        self.secret = secret
        self.max_frame = max_frame
        self.max_connections = max_connections
        # Replaced, never mutated, so other threads may iterate it while the server runs.
        self.rejected: dict[str, int] = {}
        self.handler_errors = 0
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._conns: dict[socket.socket, _Conn] = {}
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("control server already started")
        try:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            both = self.host == "::" and socket.has_dualstack_ipv6()  # "::": IPv4 too
            listener = socket.create_server(
                (self.host, self._port), family=family, backlog=128, dualstack_ipv6=both
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot listen for control messages on {self.host}:{self._port}: "
                f"{exc.strerror}; pick a free port or stop the process using it",
            ) from exc
        listener.setblocking(False)
        self._port = listener.getsockname()[1]
        self._stopping = False
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        self._listener, self._wake, self._selector = listener, (wake_r, wake_w), selector
        self._thread = threading.Thread(
            target=self._run, name=f"kvpush-control-{self._port}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close every connection. Idempotent."""
        thread = self._thread
        if thread is None or self._wake is None:
            return
        self._stopping = True
        with contextlib.suppress(OSError):  # the wake socket is full: a wake-up is pending
            self._wake[1].send(b"x")
        thread.join(timeout=5.0)
        if thread.is_alive():
            log.error("control server on port %d did not stop within 5 s", self._port)
            return
        self._wake[1].close()
        self._thread = None

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # The server thread

    def _run(self) -> None:
        assert self._selector is not None and self._listener is not None
        assert self._wake is not None
        try:
            while not self._stopping:
                for key, events in self._selector.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake[0]:
                        self._drain_wake()
                    else:
                        self._service(key.data, events)
        except Exception:
            log.exception("control server on port %d stopped by an unexpected error", self._port)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._selector.close()
            self._listener.close()
            self._wake[0].close()

    def _drain_wake(self) -> None:
        assert self._wake is not None
        try:
            while self._wake[0].recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("control server on port %d: accept failed: %s", self._port, exc)
                return
            if len(self._conns) >= self.max_connections:
                self._count("too_many_connections")
                log.warning(
                    "control server on port %d: refusing %s:%s, %d connections already open",
                    self._port,
                    addr[0],
                    addr[1],
                    len(self._conns),
                )
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._next_id += 1
            nonce = os.urandom(NONCE_SIZE)
            conn = _Conn(
                sock,
                Peer(str(addr[0]), int(addr[1]), self._next_id),
                bytearray(),
                bytearray(greeting(nonce)),
                nonce,
            )
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            try:
                self._flush(conn)
            except OSError as exc:
                log.debug("control connection %s failed: %s", conn.peer, exc)
                self._close(conn)

    def _service(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
                self._process(conn)
            if events & selectors.EVENT_READ and conn.events & selectors.EVENT_READ:
                data = conn.sock.recv(_RECV_SIZE)
                if not data:
                    self._close(conn)
                    return
                conn.inbuf += data
                self._process(conn)
        except ProtocolError as exc:
            self._count(exc.kind)
            log.warning(
                "control server on port %d: refused a frame from %s (%s); closing the connection",
                self._port,
                conn.peer,
                exc,
            )
            self._close(conn)
        except _HandlerFailed:
            self._close(conn)
        except OSError as exc:
            log.debug("control connection %s failed: %s", conn.peer, exc)
            self._close(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle every complete frame; pause while a reply waits to be sent."""
        if not conn.peer_nonce:
            if len(conn.inbuf) < GREETING_SIZE:
                return
            conn.peer_nonce = parse_greeting(bytes(conn.inbuf[:GREETING_SIZE]))
            del conn.inbuf[:GREETING_SIZE]
        while not conn.outbuf and len(conn.inbuf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(conn.inbuf)
            if size > self.max_frame:
                raise ProtocolError(
                    "too_large",
                    f"frame of {size} bytes exceeds the {self.max_frame}-byte limit",
                )
            end = _LENGTH.size + size
            if len(conn.inbuf) < end:
                return
            body = bytes(conn.inbuf[_LENGTH.size : end])
            del conn.inbuf[:end]
            msg = decode(body, self.secret, self.max_frame, Seal(conn.nonce, conn.received))
            conn.received += 1
            reply = self._call(msg, conn)
            if reply is not None:
                conn.outbuf += reply
                self._flush(conn)

    def _call(self, msg: Message, conn: _Conn) -> bytes | None:
        peer = conn.peer
        try:
            reply = self.handler(msg, peer)
            if reply is None:
                return None
            data = frame(reply, self.secret, Seal(conn.peer_nonce, conn.sent))
            conn.sent += 1
            return data
        except Exception as exc:
            self.handler_errors += 1
            log.exception(
                "control server on port %d: handler failed on %s from %s; closing the connection",
                self._port,
                type(msg).__name__,
                peer,
            )
            raise _HandlerFailed from exc

    def _flush(self, conn: _Conn) -> None:
        assert self._selector is not None
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                sent = 0
            del conn.outbuf[:sent]
        # A client that does not read its replies stops being read from (backpressure).
        wanted = selectors.EVENT_WRITE if conn.outbuf else selectors.EVENT_READ
        if wanted != conn.events:
            self._selector.modify(conn.sock, wanted, conn)
            conn.events = wanted

    def _close(self, conn: _Conn) -> None:
        assert self._selector is not None
        if self._conns.pop(conn.sock, None) is None:
            return
        self._selector.unregister(conn.sock)
        conn.sock.close()
        if self.on_close is not None:
            try:
                self.on_close(conn.peer)
            except Exception:
                log.exception("control server on port %d: on_close failed", self._port)

    def _count(self, kind: str) -> None:
        counts = dict(self.rejected)
        counts[kind] = counts.get(kind, 0) + 1
        self.rejected = counts


class ControlClient:
    """One connection to a `ControlServer`; thread-safe (one request at a time)."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes | None = None,
        timeout: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        _check_secret(secret)
        self.host = host
        self.port = port
        self.secret = secret
        self.timeout = timeout
        self.max_frame = max_frame
        self._sock: socket.socket | None = None
        self._nonce = b""  # ours: replies must carry it
        self._peer_nonce = b""  # the server's: our frames carry it
        self._sent = 0
        self._received = 0
        self._lock = threading.Lock()
        # Counts the connections made, so a caller can tell which one a frame went out on.
        self.connection = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self, connection: int) -> bool:
        """Whether connection number `connection` (see `.connection`) is still open: False
        once the peer closed it (it exited or restarted) or this client dropped or replaced
        it. A client busy with a request right now is taken to be alive."""
        if not self._lock.acquire(blocking=False):
            return True
        try:
            return self._is_open(connection)
        finally:
            self._lock.release()

    def request(self, msg: Message, timeout: float | None = None) -> Message:
        """Send `msg` and return the reply; only for messages the peer answers.

        Raises `Unreachable` if nothing listens at the address, `ConnectionError` if the
        peer cannot be reached otherwise or closes the connection without replying,
        `TimeoutError` if no reply comes within `timeout` (default: the client's),
        `ProtocolError` if the reply is not a valid frame. When the connection breaks after
        the frame was sent, the retry delivers it a second time: handlers must be
        idempotent (kvpush messages carry transfer id and generation for that).
        """
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            for attempt in range(2):
                sock = self._connected()
                try:
                    sock.settimeout(limit)
                    sock.sendall(self._frame(msg))
                    return self._reply(sock, time.monotonic() + limit)
                except TimeoutError as exc:
                    self._drop()
                    raise TimeoutError(
                        f"no reply to {type(msg).__name__} from {self.address} within {limit:g} s"
                    ) from exc
                except ProtocolError:
                    self._drop()
                    raise
                except OSError as exc:  # EOF, reset, broken pipe: the connection is gone
                    self._drop()
                    if attempt:
                        raise ConnectionError(
                            f"control channel to {self.address} closed without replying to "
                            f"{type(msg).__name__} ({exc}); check that both sides use the same "
                            "shared secret and kvpush version"
                        ) from exc
        raise AssertionError("unreachable")

    def send(self, msg: Message, connection: int | None = None) -> None:
        """Send `msg` without waiting for a reply (errors as for `request`).

        With `connection` (a `.connection` number), only on that connection: a message
        bound to the handshake made on it raises `ConnectionError` rather than going out
        on a new one.
        """
        with self._lock:
            for attempt in range(2):
                if connection is not None and not self._is_open(connection):
                    raise ConnectionError(
                        f"the control connection to {self.address} that carried the "
                        f"handshake is gone; {type(msg).__name__} needs a new handshake"
                    )
                sock = self._connected()
                try:
                    sock.settimeout(self.timeout)
                    sock.sendall(self._frame(msg))
                    return
                except OSError as exc:
                    self._drop()
                    if attempt:
                        raise ConnectionError(
                            f"cannot send {type(msg).__name__} to {self.address}: {exc}"
                        ) from exc

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _is_open(self, connection: int) -> bool:
        return (
            self._sock is not None
            and self.connection == connection
            and not self._closed_by_peer(self._sock)
        )

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _frame(self, msg: Message) -> bytes:
        data = frame(msg, self.secret, Seal(self._peer_nonce, self._sent))
        self._sent += 1
        return data

    def _connected(self) -> socket.socket:
        """The open connection, replaced first if the peer has closed it."""
        if self._sock is not None and self._closed_by_peer(self._sock):
            self._drop()
        if self._sock is None:
            hint = "check that the peer is running and listens on that address"
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except ConnectionRefusedError as exc:
                raise Unreachable(
                    f"nothing listens for kvpush control messages at {self.address}; {hint}"
                ) from exc
            except OSError as exc:
                raise ConnectionError(
                    f"cannot reach the kvpush control channel at {self.address}: {exc}; {hint}"
                ) from exc
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = os.urandom(NONCE_SIZE)
                sock.sendall(greeting(nonce))
                peer_nonce = parse_greeting(
                    self._recv_exactly(sock, GREETING_SIZE, time.monotonic() + self.timeout)
                )
            except (OSError, ProtocolError) as exc:
                sock.close()
                what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc}"
                raise ConnectionError(
                    f"greeting the kvpush control channel at {self.address} {what}; {hint}"
                ) from exc
            self._sock, self._nonce, self._peer_nonce = sock, nonce, peer_nonce
            self._sent = self._received = 0
            self.connection += 1
        return self._sock

    @staticmethod
    def _closed_by_peer(sock: socket.socket) -> bool:
        """True if the peer closed (or reset) the connection, or sent something unasked.

        Without this check, the first frame sent after the peer restarted would be lost
        in the kernel buffer of a dead connection.
        """
        try:
            sock.setblocking(False)
            sock.recv(1, socket.MSG_PEEK)  # b"" (closed) or bytes nobody asked for
        except BlockingIOError:
            return False
        except OSError:
            pass
        return True

    def _reply(self, sock: socket.socket, deadline: float) -> Message:
        header = self._recv_exactly(sock, _LENGTH.size, deadline)
        (size,) = _LENGTH.unpack(header)
        if size > self.max_frame:
            raise ProtocolError(
                "too_large",
                f"reply from {self.address} of {size} bytes exceeds the "
                f"{self.max_frame}-byte limit",
            )
        seal = Seal(self._nonce, self._received)
        msg = decode(self._recv_exactly(sock, size, deadline), self.secret, self.max_frame, seal)
        self._received += 1
        return msg

    @staticmethod
    def _recv_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise ConnectionResetError("connection closed by the peer")
            data += chunk
        return bytes(data)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
