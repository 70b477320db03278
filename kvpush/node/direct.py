"""A finished prefill, straight from the scheduler to its workers on the same host.

vLLM tells the scheduler that a prefill finished (`request_finished`) after the step's
forward, and the step's metadata reaches the workers only with the next step. Under vLLM's
multiprocess executor (every TP above 1, and vLLM's CPU backend at any TP) that is a whole
engine step between the end of a prefill and the start of its WRITE: 2-3 ms measured on a
2-core CPU host, longer behind a busy step. So in push mode the scheduler side also sends
each finished prefill's `SendSpec` as one datagram to a Unix socket of each of its worker
ranks (`DirectSender`), whose thread hands it to the writer at once (`DirectReceiver`).

The next step's metadata still carries the spec: the writer acts on whichever copy comes
first and drops the other (`FirstCopies`), so a datagram that is lost, refused or never sent
(a rank on another host, a socket that could not be made) costs the step and nothing else.

Who may hand a worker a spec: only this user's processes. The sockets live in a directory
of the system's temp directory that only this user can enter (`kvpush-<uid>`, mode 0700,
checked before use), each worker's socket is named after its engine id, host and control
port, and each datagram names its engine, which the worker checks.
"""

from __future__ import annotations

import array
import contextlib
import errno
import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpush.dataplane import threads
from kvpush.node.specs import SendSpec

log = logging.getLogger("kvpush.worker")

VERSION = 1
# version, finished_at, num_tokens, sampled, then the byte lengths of the engine id,
# transfer id and request id; after them those three strings and the block ids (int64)
_HEAD = struct.Struct("<BdQqHHH")
_BLOCK = "q"
# A datagram larger than this is not sent (the metadata carries it): 256k blocks of int64.
MAX_DATAGRAM = 2 * 1024 * 1024
_SUN_PATH_MAX = 107  # Linux: sockaddr_un's 108 bytes, less the terminating NUL


def pack(engine_id: str, spec: SendSpec) -> bytes:
    """`spec` as one datagram from `engine_id`'s scheduler."""
    names = [s.encode() for s in (engine_id, spec.transfer_id, spec.request_id)]
    head = _HEAD.pack(
        VERSION, spec.finished_at, spec.num_tokens, spec.sampled, *(len(n) for n in names)
    )
    return b"".join((head, *names, array.array(_BLOCK, spec.block_ids).tobytes()))


def unpack(data: bytes, engine_id: str) -> SendSpec:
    """The `SendSpec` in `data`, marked `direct`; ValueError (with why) if `data` is not a
    datagram of this version from `engine_id`'s scheduler."""
    if len(data) < _HEAD.size:
        raise ValueError(f"{len(data)} bytes, shorter than a header")
    version, finished_at, num_tokens, sampled, *lengths = _HEAD.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"version {version}, this worker speaks {VERSION}")
    start = _HEAD.size
    names = []
    for length in lengths:
        names.append(data[start : start + length].decode())
        start += length
    blocks = array.array(_BLOCK)
    if start > len(data) or (len(data) - start) % blocks.itemsize:
        raise ValueError("truncated")
    blocks.frombytes(data[start:])
    sender, transfer_id, request_id = names
    if sender != engine_id:
        raise ValueError(f"it comes from engine {sender!r}, this worker is {engine_id!r}'s")
    if not (transfer_id and request_id and blocks) or min(blocks) < 0:
        raise ValueError("no request or no blocks")
    return SendSpec(
        transfer_id,
        request_id,
        tuple(blocks),
        num_tokens,
        sampled=sampled,
        finished_at=finished_at,
        direct=True,
    )


def private_dir() -> tuple[Path | None, str]:
    """The directory of this user's sockets, made if needed, and "" - or None and why it
    cannot be used (someone else's, or open to others)."""
    path = Path(tempfile.gettempdir()) / f"kvpush-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        return None, f"cannot make {path}: {exc}"
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return None, f"{path} is not a directory of this user (uid {os.getuid()})"
    if info.st_mode & 0o077:
        return None, f"{path} is open to other users (mode {oct(info.st_mode & 0o777)})"
    return path, ""


def socket_path(directory: Path, engine_id: str, host: str, port: int) -> str:
    """The socket of the worker rank of `engine_id` whose control port is `host`:`port`."""
    digest = hashlib.sha256(f"{engine_id}\0{host}\0{port}".encode()).hexdigest()[:24]
    return str(directory / f"{digest}.sock")


class DirectSender:
    """The scheduler side's end: one datagram per rank, never blocking the engine loop."""

    def __init__(self, engine_id: str, paths: Sequence[str]) -> None:
        self.engine_id = engine_id
        self.paths = tuple(paths)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sent = 0
        self.failed = 0

    @classmethod
    def open(cls, engine_id: str, host: str, ports: Sequence[int]) -> DirectSender | None:
        """A sender to the ranks of `engine_id` listening at `host`:`ports`, or None (and a
        warning saying why) when this host offers no private place for the sockets."""
        directory, why = private_dir()
        if directory is None:
            log.warning(
                "kvpush: finished prefills will reach the workers with the next engine step "
                "only: %s",
                why,
            )
            return None
        paths = [socket_path(directory, engine_id, host, port) for port in ports]
        missing = [p for p in paths if not os.path.exists(p)]
        log.info(
            "kvpush: finished prefills go to %d of %d worker rank(s) directly (%s), and with "
            "the next engine step",
            len(paths) - len(missing),
            len(paths),
            directory,
        )
        return cls(engine_id, paths)

    def send(self, spec: SendSpec) -> int:
        """Send `spec` to every rank; the number of ranks it reached. A rank whose socket is
        missing or full is skipped: the next step's metadata brings it the spec."""
        data = pack(self.engine_id, spec)
        if len(data) > MAX_DATAGRAM:
            return 0
        reached = 0
        for path in self.paths:
            try:
                self.sock.sendto(data, path)
                reached += 1
            except OSError:
                self.failed += 1
        self.sent += reached
        return reached

    def close(self) -> None:
        self.sock.close()


class FirstCopies:
    """Which finished prefills a worker has had, by either way: the first copy of each goes
    to the writer, the second is dropped before it wakes anyone. The direct thread and
    vLLM's worker thread both ask, under one lock; a copy whose twin never comes (its
    datagram was not sent) is forgotten after `keep_s`.

    A finished prefill is known by its request id and the time the scheduler finished it
    (`SendSpec.finished_at`): a client may reuse a request id (vLLM takes X-Request-Id),
    never that pair. A spec without a finish time was not the scheduler's, and is never
    taken for a twin (`WorkerSide.queue`)."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, float], float] = {}  # -> when its first copy came

    def first(self, spec: SendSpec, now: float) -> bool:
        key = (spec.request_id, spec.finished_at)
        with self._lock:
            if self._seen.pop(key, None) is not None:
                return False
            seen = self._seen
            seen[key] = now
            while next(iter(seen.values())) < now - self.keep_s:
                del seen[next(iter(seen))]
            return True

    def __len__(self) -> int:
        return len(self._seen)


class DirectReceiver(threading.Thread):
    """A worker rank's end: a thread that blocks on its socket and delivers each spec."""

    def __init__(
        self,
        engine_id: str,
        path: str,
        sock: socket.socket,
        deliver: Callable[[SendSpec, float], None],
        reject: Callable[[str], None],
    ) -> None:
        super().__init__(name="kvpush-direct", daemon=True)
        self.engine_id = engine_id
        self.path = path
        self.sock = sock
        self.deliver = deliver
        self.reject = reject
        self._stopping = False

    @classmethod
    def open(
        cls,
        engine_id: str,
        host: str,
        port: int,
        deliver: Callable[[SendSpec, float], None],
        reject: Callable[[str], None],
    ) -> DirectReceiver | None:
        """Bind this rank's socket and start its thread; None (and a warning saying why)
        when it cannot be bound: specs then come with the next engine step only."""
        directory, why = private_dir()
        path = socket_path(directory, engine_id, host, port) if directory else ""
        if directory is not None and len(path.encode()) > _SUN_PATH_MAX:
            why = f"{path} is longer than a Unix socket's path may be (set TMPDIR shorter)"
        sock = None
        if not why:
            sock, why = _bind(path)
        if sock is None:
            log.warning(
                "kvpush: finished prefills will reach this worker with the next engine step "
                "only: %s",
                why,
            )
            return None
        receiver = cls(engine_id, path, sock, deliver, reject)
        receiver.start()
        return receiver

    def run(self) -> None:
        threads.background()
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM)
            except OSError:
                return  # closed
            if self._stopping:
                return
            at = time.monotonic()
            try:
                spec = unpack(data, self.engine_id)
            except (ValueError, UnicodeDecodeError, struct.error) as exc:
                log.warning("kvpush: dropped a direct hand-off datagram: %s", exc)
                self.reject("bad_direct_handoff")
                continue
            self.deliver(spec, at)

    def stop(self) -> None:
        self._stopping = True
        # wake the thread blocked in recv (never blocking here: a full socket is refused)
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as poke:
            poke.setblocking(False)
            poke.sendto(b"", self.path)
        self.join(timeout=5)
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _bind(path: str) -> tuple[socket.socket | None, str]:
    """A datagram socket bound at `path`, replacing a stale socket file a dead process
    left; None and why if a live process holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        try:
            sock.bind(path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            if _alive(path):
                sock.close()
                return None, f"another process serves {path}"
            os.unlink(path)
            sock.bind(path)
        os.chmod(path, 0o600)
    except OSError as exc:
        sock.close()
        return None, f"cannot bind {path}: {exc}"
    return sock, ""


def _alive(path: str) -> bool:
    """Whether a process is bound at `path` (connecting to a dead one's file is refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
