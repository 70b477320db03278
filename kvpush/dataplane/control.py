"""The control channel: small kvpush messages over TCP between instances.

A connection opens with each side's `protocol.greeting` (protocol version and a fresh
random nonce). With a shared secret each side then proves it knows the secret: 32 bytes,
HMAC-SHA256 over both nonces and its role (`proof`). The server sends its proof as soon as
it has the client's nonce and takes no frame before the client's proof checked out; the
client sends no frame (nothing about its worker: no Hello, no block ids) before the
server's proof checked out. So neither side tells anything to a peer that does not hold
the secret, whichever side dialled. Then every frame on the wire is a 4-byte big-endian
length and `protocol.encode(msg, secret, seal)`, sealed with the *receiver's* nonce and the
frame's position in that direction. So a frame recorded on one connection is refused on any
other and at any other position ("replayed"), with no clock and no memory of past frames.

Optionally the whole connection runs inside mutual TLS 1.3 (`tls_contexts`: certificates
from the operator; each side accepts only a peer whose certificate the given CA signed).
Greeting, proofs and frames are the same inside TLS; TLS adds confidentiality. Python 3.11's
`ssl` has no TLS 1.3 PSK support, so TLS here needs certificates.

`ControlServer` runs one thread that blocks in `selectors` (an idle server costs nothing;
its timers are the selector's timeout), decodes each frame with `protocol.decode` (the one
place untrusted bytes are checked) and calls the handler on that thread; a message the
handler returns goes back on the same connection as the reply. A frame that is oversized,
malformed, replayed or not authenticated with the shared secret is counted in
`ControlServer.rejected` by `ProtocolError.kind`, logged (at most one line per kind every
`Limits.log_every_s`) and its connection closed; other connections are unaffected.

Bounds (`Limits`), so that nobody who lacks the secret can hold memory or lock peers out:
a connection must finish TLS, greeting and proof (without a secret: its first valid frame)
within `greeting_timeout_s`; until then it buffers at most the 53 bytes of greeting and
proof (without a secret: one frame of `unauthenticated_frame` bytes); at most
`max_unauthenticated` such connections exist at once (a new one replaces the oldest) and
`max_unauthenticated_per_host` from one address; `max_connections_per_host` and
`max_connections` bound all connections; a connection that sent no frame for
`idle_timeout_s` is closed (the client reconnects before it would be: see `ControlClient`).

`ControlClient` keeps one connection, sends a frame and (for `request`) waits for one reply;
it reconnects once when the connection turns out to be broken (the peer restarted), and
before sending on a connection unused for `idle_s`. `Unreachable` (nothing listens at the
address) tells a peer that is not running from one that is slow.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from kvpush.core.protocol import (
    DEFAULT_MAX_FRAME,
    GREETING_SIZE,
    MAC_SIZE,
    NONCE_SIZE,
    Message,
    ProtocolError,
    Seal,
    decode,
    encode,
    greeting,
    parse_greeting,
)
from kvpush.dataplane import threads

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
_RECV_SIZE = 1 << 16
_SERVER, _CLIENT = b"server", b"client"
_PROOF_LABEL = b"kvpush-proof\0"
_ACCEPT_PAUSE_S = 0.5
# A timer wakes the selector this much after its deadline, so it never wakes just before.
_TIMER_SLACK_S = 1e-3


@dataclass(frozen=True, slots=True)
class Limits:
    """What a `ControlServer` accepts; the defaults suit a cluster of a few hundred ranks."""

    # Largest frame after a connection authenticated (a Hello with its NIXL metadata, a
    # registration with its block ids).
    max_frame: int = DEFAULT_MAX_FRAME
    # Largest frame before: only without a secret, where the first valid frame (a Hello)
    # is what counts as the greeting. A Hello of 256 layers measured 18 KB on UCX over TCP.
    unauthenticated_frame: int = 256 << 10
    # From accept to greeting done: TLS handshake, greeting and the client's proof (without
    # a secret: its first valid frame).
    greeting_timeout_s: float = 5.0
    # An authenticated connection with no frame received for this long is closed.
    idle_timeout_s: float = 600.0
    max_connections: int = 1024
    max_connections_per_host: int = 256
    # Connections still in their greeting, from all hosts / from one address. A legitimate
    # connection greets within a round trip; a host's ranks connecting at once stay far
    # below the per-host bound.
    max_unauthenticated: int = 128
    max_unauthenticated_per_host: int = 32
    # Refused frames and connections: at most one log line per kind this often.
    log_every_s: float = 10.0

    def __post_init__(self) -> None:
        counts = {
            "max_frame": self.max_frame,
            "unauthenticated_frame": self.unauthenticated_frame,
            "max_connections": self.max_connections,
            "max_connections_per_host": self.max_connections_per_host,
            "max_unauthenticated": self.max_unauthenticated,
            "max_unauthenticated_per_host": self.max_unauthenticated_per_host,
        }
        for name, value in counts.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"control limit {name} must be a positive integer, got {value!r}")
        for name, seconds in (
            ("greeting_timeout_s", self.greeting_timeout_s),
            ("idle_timeout_s", self.idle_timeout_s),
        ):
            if not seconds > 0:
                raise ValueError(f"control limit {name} must be positive seconds, got {seconds}")
        if self.log_every_s < 0:
            raise ValueError("log_every_s must not be negative")


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


def proof(secret: bytes, role: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What `role` ("server" or "client") sends after the greetings to show it holds
    `secret`: bound to both nonces, so it is worth nothing on any other connection."""
    label = {"server": _SERVER, "client": _CLIENT}[role]
    data = _PROOF_LABEL + label + server_nonce + client_nonce
    return hmac.digest(secret, data, hashlib.sha256)


def tls_contexts(cert: str, key: str, ca: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for mutual TLS 1.3: each side presents `cert` (with `key`)
    and accepts only a peer whose certificate `ca` signed. Host names are not checked:
    peers dial addresses, and every holder of a certificate from `ca` is a peer."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    server.num_tickets = 0  # no resumption; nothing arrives after the handshake unasked
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_cert_chain(cert, key)
            context.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"cannot load the control channel's TLS files (tls_cert {cert}, tls_key {key}, "
                f"tls_ca {ca}): {exc}"
            ) from exc
    return server, client


class Unreachable(ConnectionError):
    """Nothing listens at the peer's address (connection refused): it is not running."""


def _check_secret(secret: bytes | None) -> None:
    if secret is not None and not secret:
        raise ValueError("the shared secret is empty; configure a non-empty secret or none")


class _HandlerFailed(Exception):
    """The handler raised; the connection is closed so the client fails fast."""


class _Limited:
    """Log lines of one kind at most once per `every` seconds, counting the rest."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._next: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()

    def warning(self, kind: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._skipped[kind] += 1
            return
        self._next[kind] = now + self.every
        skipped = self._skipped.pop(kind, 0)
        more = f" ({skipped} more of kind {kind} not logged since the last line)" if skipped else ""
        log.warning(fmt + "%s", *args, more)


@dataclass(slots=True, eq=False)
class _Conn:
    sock: socket.socket
    peer: Peer
    nonce: bytes  # ours: frames from the client must carry it
    deadline: float  # for the greeting, while not authenticated
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    peer_nonce: bytes = b""  # the client's, from its greeting: our replies carry it
    tls_pending: bool = False  # the TLS handshake is still running
    authenticated: bool = False
    last_frame: float = 0.0
    received: int = 0
    sent: int = 0
    events: int = selectors.EVENT_READ


class ControlServer:
    """Serves kvpush messages on host:port from one background thread.

    `port` 0 picks a free port; `.port` tells which once `start` returned. `tls`: a server
    context from `tls_contexts`, None for plain TCP.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        secret: bytes | None = None,
        limits: Limits | None = None,
        tls: ssl.SSLContext | None = None,
        on_close: Callable[[Peer], None] | None = None,
    ) -> None:
        _check_secret(secret)
        self.host = host
        self._port = port
        self.handler = handler
        # told (on the server thread) when a connection closes, whoever closed it
        self.on_close = on_close
        self.secret = secret
        self.limits = limits or Limits()
        self.tls = tls
        # Replaced, never mutated, so other threads may iterate it while the server runs.
        self.rejected: dict[str, int] = {}
        self.handler_errors = 0
        self.idle_closed = 0
        self._log = _Limited(self.limits.log_every_s)
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._conns: dict[socket.socket, _Conn] = {}
        # Connections in their greeting, oldest first; authenticated ones, least recently
        # active first: the first of each holds the next deadline.
        self._greeting: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._active: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._per_host: Counter[str] = Counter()
        self._greeting_per_host: Counter[str] = Counter()
        self._accept_paused_until = 0.0
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def connections(self) -> int:
        """Open connections (read from another thread: a snapshot)."""
        return len(self._conns)

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
            busy = exc.errno == errno.EADDRINUSE
            raise OSError(
                exc.errno,
                f"cannot listen for control messages on {self.host}:{self._port}: "
                f"{exc.strerror}"
                + ("; pick a free port or stop the process using it" if busy else ""),
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
        threads.background()
        assert self._selector is not None and self._listener is not None
        assert self._wake is not None
        try:
            while not self._stopping:
                for key, events in self._selector.select(self._timeout(time.monotonic())):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake[0]:
                        self._drain_wake()
                    elif key.data is not None and key.data.sock in self._conns:
                        self._service(key.data, events)  # (unless closed meanwhile)
                self._expire(time.monotonic())
        except Exception:
            log.exception("control server on port %d stopped by an unexpected error", self._port)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._selector.close()
            self._listener.close()
            self._wake[0].close()

    def _timeout(self, now: float) -> float | None:
        """Seconds until the next timer (None: none): a greeting or idle deadline, or the
        end of a pause in accepting."""
        deadlines = []
        if self._greeting:
            deadlines.append(next(iter(self._greeting.values())).deadline)
        if self._active:
            oldest = next(iter(self._active.values()))
            deadlines.append(oldest.last_frame + self.limits.idle_timeout_s)
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - now) + _TIMER_SLACK_S

    def _expire(self, now: float) -> None:
        """Close connections past their greeting or idle deadline; resume accepting."""
        while self._greeting:
            conn = next(iter(self._greeting.values()))
            if conn.deadline > now:
                break
            self._refuse(
                conn,
                "greeting_timeout",
                f"no greeting within {self.limits.greeting_timeout_s:g} s",
            )
        idle = self.limits.idle_timeout_s
        while self._active:
            conn = next(iter(self._active.values()))
            if conn.last_frame + idle > now:
                break
            log.info(
                "control server on port %d: closing %s, idle for %g s",
                self._port,
                conn.peer,
                idle,
            )
            self.idle_closed += 1
            self._close(conn)
        if self._accept_paused_until and now >= self._accept_paused_until:
            assert self._selector is not None and self._listener is not None
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _drain_wake(self) -> None:
        assert self._wake is not None
        try:
            while self._wake[0].recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None and self._selector is not None
        limits = self.limits
        while True:
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                # e.g. out of file descriptors: the listener stays readable, so stop
                # accepting for a moment instead of spinning; keep serving the others.
                self._log.warning(
                    "accept_failed",
                    "control server on port %d: accept failed: %s; pausing accepts for %g s",
                    self._port,
                    exc,
                    _ACCEPT_PAUSE_S,
                )
                self._selector.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                return
            host = str(addr[0])
            refused = ""
            if (
                self._per_host[host] >= limits.max_connections_per_host
                or self._greeting_per_host[host] >= limits.max_unauthenticated_per_host
            ):
                refused = "too_many_from_host"
            elif len(self._conns) >= limits.max_connections and not self._greeting:
                refused = "too_many_connections"
            if refused:
                self._count(refused)
                self._log.warning(
                    refused,
                    "control server on port %d: refusing a connection from %s:%s "
                    "(%d open, %d from that address, %d of them in their greeting)",
                    self._port,
                    host,
                    addr[1],
                    len(self._conns),
                    self._per_host[host],
                    self._greeting_per_host[host],
                )
                sock.close()
                continue
            if len(self._conns) >= limits.max_connections or (
                len(self._greeting) >= limits.max_unauthenticated
            ):
                # Full: the connection longest in its greeting makes room for the new one,
                # so connections that never greet cannot lock peers out.
                oldest = next(iter(self._greeting.values()))
                self._refuse(oldest, "greeting_evicted", "replaced by a newer connection")
            self._add(sock, host, int(addr[1]))

    def _add(self, sock: socket.socket, host: str, port: int) -> None:
        assert self._selector is not None
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next_id += 1
        nonce = os.urandom(NONCE_SIZE)
        deadline = time.monotonic() + self.limits.greeting_timeout_s
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError) as exc:
                log.debug("control connection from %s:%d failed: %s", host, port, exc)
                sock.close()
                return
        conn = _Conn(sock, Peer(host, port, self._next_id), nonce, deadline)
        self._conns[sock] = conn
        self._greeting[sock] = conn
        self._per_host[host] += 1
        self._greeting_per_host[host] += 1
        self._selector.register(sock, selectors.EVENT_READ, conn)
        if self.tls is not None:
            conn.tls_pending = True
            return
        conn.outbuf += greeting(nonce)
        try:
            self._flush(conn)
        except OSError as exc:
            log.debug("control connection %s failed: %s", conn.peer, exc)
            self._close(conn)

    def _service(self, conn: _Conn, events: int) -> None:
        try:
            if conn.tls_pending:
                self._tls_handshake(conn)
                if conn.tls_pending or conn.sock not in self._conns:
                    return
                events &= selectors.EVENT_READ  # done: the greeting may have come with it
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
                self._process(conn)
            if conn.events & selectors.EVENT_READ and (
                events & selectors.EVENT_READ or self._tls_buffered(conn)
            ):
                self._read(conn)
        except ProtocolError as exc:
            self._refuse(conn, exc.kind, str(exc), frame_refused=True)
        except _HandlerFailed:
            self._close(conn)
        except ssl.SSLError as exc:
            self._refuse(conn, "tls_failed", f"TLS: {exc}")
        except OSError as exc:
            log.debug("control connection %s failed: %s", conn.peer, exc)
            self._close(conn)

    def _tls_handshake(self, conn: _Conn) -> None:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        conn.tls_pending = False
        conn.outbuf += greeting(conn.nonce)
        self._flush(conn)

    @staticmethod
    def _tls_buffered(conn: _Conn) -> bool:
        """Bytes TLS already decrypted: the selector will not report them."""
        return isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending() > 0

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                data = conn.sock.recv(self._wanted(conn))
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            if not data:
                self._close(conn)
                return
            conn.inbuf += data
            self._process(conn)
            if conn.sock not in self._conns or not conn.events & selectors.EVENT_READ:
                return
            if not self._tls_buffered(conn):
                return

    def _wanted(self, conn: _Conn) -> int:
        """How much to read: in the greeting, no more than it has left (so a connection
        that has not authenticated holds at most a greeting and a proof)."""
        if not conn.peer_nonce:
            return GREETING_SIZE - len(conn.inbuf)
        if self.secret is not None and not conn.authenticated:
            return MAC_SIZE - len(conn.inbuf)
        return _RECV_SIZE

    def _process(self, conn: _Conn) -> None:
        """Greeting and proof, then every complete frame; pause while a reply waits to be
        sent."""
        if not conn.peer_nonce:
            if len(conn.inbuf) < GREETING_SIZE:
                return
            conn.peer_nonce = parse_greeting(bytes(conn.inbuf[:GREETING_SIZE]))
            del conn.inbuf[:GREETING_SIZE]
            if self.secret is not None:
                conn.outbuf += proof(self.secret, "server", conn.nonce, conn.peer_nonce)
                self._flush(conn)
        if self.secret is not None and not conn.authenticated:
            if len(conn.inbuf) < MAC_SIZE:
                return
            theirs = bytes(conn.inbuf[:MAC_SIZE])
            del conn.inbuf[:MAC_SIZE]
            if not hmac.compare_digest(
                theirs, proof(self.secret, "client", conn.nonce, conn.peer_nonce)
            ):
                raise ProtocolError(
                    "bad_mac",
                    "the peer did not prove the shared secret after its greeting; configure "
                    "the same secret on both sides",
                )
            self._authenticated(conn)
        while not conn.outbuf and len(conn.inbuf) >= _LENGTH.size:
            limit = self.limits.max_frame
            if not conn.authenticated:
                limit = min(limit, self.limits.unauthenticated_frame)
            (size,) = _LENGTH.unpack_from(conn.inbuf)
            if size > limit:
                before = "" if conn.authenticated else " before the connection authenticated"
                raise ProtocolError(
                    "too_large",
                    f"frame of {size} bytes exceeds the {limit}-byte limit{before}",
                )
            end = _LENGTH.size + size
            if len(conn.inbuf) < end:
                return
            body = bytes(conn.inbuf[_LENGTH.size : end])
            del conn.inbuf[:end]
            msg = decode(body, self.secret, limit, Seal(conn.nonce, conn.received))
            conn.received += 1
            if conn.authenticated:
                conn.last_frame = time.monotonic()
                self._active.move_to_end(conn.sock)
            else:  # no secret: the first valid frame ends the greeting
                self._authenticated(conn)
            reply = self._call(msg, conn)
            if reply is not None:
                conn.outbuf += reply
                self._flush(conn)

    def _authenticated(self, conn: _Conn) -> None:
        conn.authenticated = True
        conn.last_frame = time.monotonic()
        self._greeting.pop(conn.sock, None)
        self._drop_greeting(conn.peer.host)
        self._active[conn.sock] = conn

    def _drop_greeting(self, host: str) -> None:
        self._greeting_per_host[host] -= 1
        if not self._greeting_per_host[host]:
            del self._greeting_per_host[host]

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
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                sent = 0
            del conn.outbuf[:sent]
        # A client that does not read its replies stops being read from (backpressure).
        self._want(conn, selectors.EVENT_WRITE if conn.outbuf else selectors.EVENT_READ)

    def _want(self, conn: _Conn, events: int) -> None:
        assert self._selector is not None
        if events != conn.events:
            self._selector.modify(conn.sock, events, conn)
            conn.events = events

    def _refuse(self, conn: _Conn, kind: str, reason: str, frame_refused: bool = False) -> None:
        self._count(kind)
        what = "a frame" if frame_refused else "a connection"
        self._log.warning(
            kind,
            "control server on port %d: refused %s from %s (%s); closing the connection",
            self._port,
            what,
            conn.peer,
            reason,
        )
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        assert self._selector is not None
        if self._conns.pop(conn.sock, None) is None:
            return
        host = conn.peer.host
        if self._greeting.pop(conn.sock, None) is not None:
            self._drop_greeting(host)
        self._active.pop(conn.sock, None)
        self._per_host[host] -= 1
        if not self._per_host[host]:
            del self._per_host[host]
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
    """One connection to a `ControlServer`; thread-safe (one request at a time).

    `tls`: a client context from `tls_contexts`, None for plain TCP. `idle_s`: a connection
    unused for this long is replaced before the next frame goes out, so a server's idle
    timeout (set it to at least twice `idle_s`) never closes it under a frame in flight.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes | None = None,
        timeout: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        tls: ssl.SSLContext | None = None,
        idle_s: float | None = None,
    ) -> None:
        _check_secret(secret)
        self.host = host
        self.port = port
        self.secret = secret
        self.timeout = timeout
        self.max_frame = max_frame
        self.tls = tls
        self.idle_s = idle_s
        self._sock: socket.socket | None = None
        self._nonce = b""  # ours: replies must carry it
        self._peer_nonce = b""  # the server's: our frames carry it
        self._sent = 0
        self._received = 0
        self._used = 0.0  # when the connection last carried a frame of ours
        self._lock = threading.Lock()
        # Counts the connections made, so a caller can tell which one a frame went out on.
        self.connection = 0
        # The address the last connection reached (`host` resolved), "" before the first.
        self.peer_ip = ""

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

    def send_now(self, msg: Message, connection: int | None = None) -> bool:
        """Send `msg` only where that cannot wait: on the open connection (with
        `connection`, only if it is that one, as for `send`), with room for the whole frame
        in its socket buffer, no other thread sending, plain TCP. True once it went out;
        False where nothing did (`send` then does what this would not: connect, wait for
        room, say why). For a thread that must never wait on a peer."""
        if self.tls is not None or not self._lock.acquire(blocking=False):
            return False
        try:
            sock = self._sock
            if (
                sock is None
                or (connection is not None and connection != self.connection)
                or self._stale(sock)
            ):
                return False
            sent, used = self._sent, self._used
            data = self._frame(msg)
            try:
                count = sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                count = 0
            except OSError:  # the connection is gone: `send` makes a new one
                self._drop()
                return False
            if count == len(data):
                return True
            if count:  # part of a frame: the peer drops it with the connection
                self._drop()
            else:  # nothing went out: the next frame takes this one's place
                self._sent, self._used = sent, used
            return False
        finally:
            self._lock.release()

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

    def _stale(self, sock: socket.socket) -> bool:
        """The open connection must be replaced before the next frame: the peer closed it,
        or it sat unused for `idle_s`."""
        return self._closed_by_peer(sock) or (
            self.idle_s is not None and time.monotonic() - self._used > self.idle_s
        )

    def _frame(self, msg: Message) -> bytes:
        data = frame(msg, self.secret, Seal(self._peer_nonce, self._sent))
        self._sent += 1
        self._used = time.monotonic()
        return data

    def _connected(self) -> socket.socket:
        """The open connection, replaced first if the peer has closed it or it sat unused
        for `idle_s`."""
        if self._sock is not None and self._stale(self._sock):
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
                self.peer_ip = str(sock.getpeername()[0])
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock)
                nonce = os.urandom(NONCE_SIZE)
                deadline = time.monotonic() + self.timeout
                sock.sendall(greeting(nonce))
                peer_nonce = parse_greeting(self._recv_exactly(sock, GREETING_SIZE, deadline))
                if self.secret is not None:
                    sock.sendall(proof(self.secret, "client", peer_nonce, nonce))
                    theirs = self._recv_exactly(sock, MAC_SIZE, deadline)
                    if not hmac.compare_digest(
                        theirs, proof(self.secret, "server", peer_nonce, nonce)
                    ):
                        raise ProtocolError(
                            "bad_mac",
                            "the peer did not prove the shared secret; configure the same "
                            "shared secret on both sides (nothing was sent to it)",
                        )
            except (OSError, ProtocolError) as exc:
                sock.close()
                if isinstance(exc, ProtocolError) and exc.kind == "bad_mac":
                    raise ConnectionError(
                        f"control channel at {self.address}: {exc.reason}"
                    ) from None
                what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc}"
                raise ConnectionError(
                    f"greeting the kvpush control channel at {self.address} {what}; {hint}; "
                    "check that both sides use the same shared secret and TLS settings"
                ) from exc
            self._sock, self._nonce, self._peer_nonce = sock, nonce, peer_nonce
            self._sent = self._received = 0
            self._used = time.monotonic()
            self.connection += 1
        return self._sock

    @staticmethod
    def _closed_by_peer(sock: socket.socket) -> bool:
        """True if the peer closed (or reset) the connection, or sent something unasked.

        Without this check, the first frame sent after the peer restarted would be lost
        in the kernel buffer of a dead connection. Under TLS the check peeks at the raw
        socket: any record there (a close_notify alert, data) was not asked for either.
        """
        try:
            sock.setblocking(False)
            if isinstance(sock, ssl.SSLSocket):
                if sock.pending():
                    return True
                socket.socket.recv(sock, 1, socket.MSG_PEEK)
            else:
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
                f"{self.max_frame}-byte limit; check that both sides use the same shared "
                "secret (or both none) and kvpush version",
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
