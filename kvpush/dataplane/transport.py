"""One NIXL agent: register KV memory, learn peers, WRITE and READ blocks.

Progress model. NIXL's progress thread (`enable_prog_thread`, on by default) busy-polls a
whole core even when idle: the Python agent hard-codes its delay to 0. On a 2-core machine
that thread competes with model compute and turns microsecond notifications into
millisecond ones (8-16 ms measured). So every agent here runs with the progress thread off
and nothing progresses NIXL in the background; instead:

- the initiator drives its own transfers: `Transfer.poll` (and `NixlTransport.wait`) call
  into NIXL, which progresses the UCX worker and reports completion;
- the UCX backend is created with ``ucx_error_handling_mode=none``. In UCX's default
  ("peer") mode a WRITE completes only once the *target* process also calls into NIXL,
  which a decode instance busy with model steps does late; in "none" mode one-sided WRITEs
  and READs complete with no help from the target (~4 us round trips on loopback, and
  shared-memory transports work). A killed peer is still reported: later posts raise
  NIXL_ERR_REMOTE_DISCONNECT, surfaced as `TransferError(kind="remote_disconnect")`.
  If a NIXL build refuses that parameter, the backend falls back to the default mode
  (logged), and then the target must call `get_notifs` regularly for WRITEs to finish;
- "no help from the target" holds for shared memory and RDMA, not for UCX's TCP transport
  (two machines without RDMA): there the target's UCX worker must run for the bytes to
  move, so a node progresses its agent (`get_notifs`) while it may be the target of a
  transfer, and only then (`kvpush.node.progress`);
- notifications attached to a transfer are only seen when the target calls `get_notifs`
  (kvpush attaches none: completions travel on the control channel);
- over TCP, releasing a transfer that has not completed does not recall it: what a
  WRITE's writer already handed its kernel, or a READ's whole answer, lands when the link
  lets it. A target that reuses the memory a WRITE named first cuts the connection
  (`cut_connections_from`, `kvpush.dataplane.sockets`).

The agent is created with NIXL's strict thread synchronisation, so one transport may be
used from several threads (a handshake thread adding peers, a writer thread posting).

Errors: every failure NIXL reports becomes a `TransferError` whose `kind` is a short code
("remote_disconnect", "not_found", "invalid", "not_allowed", "cancelled", "timeout",
"failed") and whose message says what was attempted; bad arguments raise `ValueError`.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from kvpush.dataplane import sockets

log = logging.getLogger(__name__)

Piece = tuple[int, int]
# (address, length) pieces: a list, or a [pieces, 2] uint64 array (`node.layout.block_pieces`)
Pieces = Sequence[Piece] | np.ndarray[Any, np.dtype[np.uint64]]
# Prepared descriptors named by index: a list, or an int32 array (`node.layout.piece_indices`)
Indices = Sequence[int] | np.ndarray[Any, np.dtype[np.int32]]
"""(address, length) in bytes."""

MEM_TYPES = ("DRAM", "VRAM")
_SPIN_S = 50e-6
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3

_ERROR_KINDS = {
    "nixlRemoteDisconnectError": "remote_disconnect",
    "nixlNotFoundError": "not_found",
    "nixlInvalidParamError": "invalid",
    "nixlMismatchError": "invalid",
    "nixlNotAllowedError": "not_allowed",
    "nixlCancelledError": "cancelled",
}
_HINTS = {
    "remote_disconnect": "the peer process exited or restarted; handshake with it again",
    "not_found": "the peer or its memory is unknown here; load its metadata (add_peer) "
    "and make sure both sides registered the memory they transfer",
    "invalid": "descriptors do not match (count, lengths or indices)",
}


class TransferError(Exception):
    """A NIXL operation that failed; `kind` is a short code to count as a metric."""

    KINDS = (
        "remote_disconnect",
        "not_found",
        "invalid",
        "not_allowed",
        "cancelled",
        "timeout",
        "closed",
        "failed",
    )

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _error(exc: BaseException, what: str) -> TransferError:
    """`exc`, raised by NIXL while doing `what`, as a TransferError."""
    if isinstance(exc, TransferError):
        return exc
    kind = _ERROR_KINDS.get(type(exc).__name__, "failed")
    hint = _HINTS.get(kind)
    detail = f"{what}: {type(exc).__name__}: {exc}"
    return TransferError(kind, f"{detail} ({hint})" if hint else detail)


def _nixl_api() -> Any:
    try:
        return importlib.import_module("nixl._api")
    except ImportError as exc:
        raise ImportError(
            f"NIXL is not importable ({exc}); install nixl (after the CPU or CUDA torch, "
            "see scripts/setup.sh)"
        ) from exc


class Transfer:
    """One posted WRITE or READ. Poll it until done, then release it."""

    __slots__ = ("_agent", "_handle", "_done", "_failure", "what", "_on_release")

    def __init__(
        self,
        agent: Any,
        handle: Any,
        what: str,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._agent = agent
        self._handle = handle
        self._done = handle is None
        self._failure: TransferError | None = None
        self.what = what
        # Called once NIXL freed the request: the peer's agent may then be unloaded.
        self._on_release = on_release

    @classmethod
    def completed(cls, what: str) -> Transfer:
        """A transfer with nothing to move (only a notification, or nothing at all)."""
        return cls(None, None, what)

    @property
    def done(self) -> bool:
        return self._done

    def poll(self) -> bool:
        """True once complete; raises `TransferError` if it failed."""
        if self._done:
            return True
        if self._failure is not None:
            raise self._failure
        if self._handle is None:
            raise TransferError("failed", f"{self.what}: released before it completed")
        try:
            state = self._agent.check_xfer_state(self._handle)
        except Exception as exc:
            self._failure = _error(exc, self.what)
            raise self._failure from exc
        if state == "DONE":
            self._done = True
            return True
        if state == "PROC":
            return False
        self._failure = TransferError("failed", f"{self.what}: NIXL reported state {state}")
        raise self._failure

    def release(self) -> bool:
        """Free NIXL's request; False if NIXL could not cancel a transfer still in flight.

        Never raises, so it is safe in `finally` blocks. A refused release is logged; NIXL
        keeps such a handle and retries when the agent is destroyed.
        """
        handle, self._handle = self._handle, None
        if handle is None:
            return True
        try:
            handle.release()
        except Exception as exc:
            # NIXL keeps the request: its peer's agent stays loaded until the transport closes.
            log.warning("releasing %s failed: %s", self.what, _error(exc, "release"))
            return False
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()
        return True

    def __enter__(self) -> Transfer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "done" if self._done else "failed" if self._failure else "in flight"
        return f"Transfer({self.what!r}, {state})"


@dataclass(slots=True)
class _Prepared:
    """Prepared descriptor lists for one peer: one entry per block on each side."""

    local: Any
    remote: Any
    num_local: int
    num_remote: int

    def release(self) -> None:
        for handle in (self.local, self.remote):
            try:
                handle.release()
            except Exception as exc:
                log.warning("releasing a prepared descriptor list failed: %s", exc)


class NixlTransport:
    """A NIXL agent for one process (one TP rank), with the progress model above."""

    def __init__(self, name: str, backend: str = "UCX") -> None:
        api = _nixl_api()
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent: Any = api.nixl_agent(name, config)
        except Exception as exc:
            raise _error(exc, f"creating NIXL agent {name!r}") from exc
        self.name = name
        self.backend = backend
        before = sockets.listening_ports()
        self.error_handling = self._create_backend(backend)
        # the ports UCX's TCP transport listens on: peers' WRITEs come in through them
        self.listen_ports = sockets.listening_ports() - before
        self._lock = threading.RLock()
        self._peers: dict[str, _Prepared | None] = {}
        # Loaded peers' metadata, posted transfers not yet released per peer, and peers
        # removed while transfers were in flight: unloaded when the last one is released.
        self._metadata: dict[str, bytes] = {}
        self._in_flight: dict[str, int] = {}
        self._retiring: dict[str, _Prepared | None] = {}
        self._registered: list[Any] = []
        self._mem = "DRAM"
        self._device = 0
        self._closed = False

    def _create_backend(self, backend: str) -> str:
        """Create `backend`; returns the UCX error handling mode in use ("" if not UCX)."""
        if backend == "UCX":
            try:
                self._agent.create_backend(backend, {"ucx_error_handling_mode": "none"})
                return "none"
            except Exception as exc:
                log.warning(
                    "NIXL agent %s: UCX refused ucx_error_handling_mode=none (%s); using "
                    "UCX's default mode, in which WRITEs complete only when the target "
                    "calls into NIXL (get_notifs) - expect slower transfers",
                    self.name,
                    exc,
                )
        try:
            self._agent.create_backend(backend, {})
        except Exception as exc:
            plugins = self._agent.get_plugin_list()
            raise _error(
                exc, f"creating NIXL backend {backend} (plugins available: {plugins})"
            ) from exc
        return "peer" if backend == "UCX" else ""

    # Memory and peers

    def register_regions(
        self, regions: list[tuple[int, int]], mem: str = "DRAM", device: int = 0
    ) -> None:
        """Register (base address, length) regions; VRAM regions live on GPU `device`.

        All regions of one transport share one memory type and device; peers' memory may be
        of another type (`remote_mem` of the transfer methods, default: the local type).
        """
        if mem not in MEM_TYPES:
            raise ValueError(f"memory type must be one of {MEM_TYPES}, got {mem!r}")
        if self._registered and (mem, device) != (self._mem, self._device):
            raise ValueError(
                f"this transport registered {self._mem} memory of device {self._device}; "
                f"use one transport per memory type and device, not {mem} of device {device}"
            )
        if not regions:
            raise ValueError("no memory regions to register")
        bad = [(base, length) for base, length in regions if base < 0 or length <= 0]
        if bad:
            raise ValueError(f"invalid (base, length) regions {bad[:3]}")
        descs = [(base, length, device, "") for base, length in regions]
        agent = self._live()
        with self._lock:
            try:
                self._registered.append(agent.register_memory(descs, mem))
            except Exception as exc:
                raise _error(exc, f"registering {len(regions)} {mem} regions") from exc
            self._mem, self._device = mem, device

    def metadata(self) -> bytes:
        """This agent's metadata for peers: connection info and the memory registered so far
        (so call it after `register_regions`)."""
        try:
            return bytes(self._live().get_agent_metadata())
        except Exception as exc:
            raise _error(exc, "reading local NIXL metadata") from exc

    def add_peer(self, metadata: bytes, name: str | None = None) -> str:
        """Load a peer's metadata; returns the peer's agent name.

        Pass `name` (the peer's agent name, e.g. from its Hello) to replace an agent of
        that name already loaded: a peer restarted under the same name sends new metadata,
        and NIXL refuses to load it over the old one. While transfers to that agent are in
        flight it is not unloaded: the same metadata keeps it (a handshake repeated with the
        same process), other metadata is refused until they are released.
        """
        agent = self._live()
        with self._lock:
            if name is not None and (name in self._retiring or self._in_flight.get(name)):
                if self._metadata.get(name) != metadata:
                    raise TransferError(
                        "not_allowed",
                        f"peer agent {name!r} comes with new metadata while transfers to its "
                        "previous agent are in flight; it can be loaded once they end",
                    )
                if name in self._retiring:
                    self._peers[name] = self._retiring.pop(name)
                return name
            if name is not None and name in self._peers:
                log.info("NIXL agent %s: replacing peer %s", self.name, name)
                self._forget(name)
            try:
                loaded = agent.add_remote_agent(metadata)
            except Exception as exc:
                error = _error(exc, "loading peer NIXL metadata")
                if error.kind == "not_allowed":
                    error = TransferError(
                        "not_allowed",
                        f"{error.message}; an agent of that name is already loaded (a "
                        "restarted peer?): pass its name to add_peer to replace it",
                    )
                raise error from exc
            peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name is not None and peer != name:
                self._unload(peer)
                raise TransferError(
                    "invalid", f"peer metadata names agent {peer!r}, expected {name!r}"
                )
            self._peers[peer] = None
            self._metadata[peer] = metadata
        return peer

    def remove_peer(self, name: str) -> None:
        """Forget a peer: its prepared blocks and its connection. Unknown names are ignored.

        Transfers to it still in flight keep it loaded (unloading frees what they use);
        it is unloaded when the last of them is released. New transfers to it are refused
        at once either way.
        """
        with self._lock:
            if name not in self._peers:
                return
            if self._in_flight.get(name):
                log.info(
                    "NIXL agent %s: peer %s is unloaded once its %d transfers in flight end",
                    self.name,
                    name,
                    self._in_flight[name],
                )
                self._retiring[name] = self._peers.pop(name)
                return
            self._forget(name)

    def cut_connections_from(self, ips: Collection[str]) -> int:
        """Shut down the TCP connections peers at `ips` opened to this agent; returns how
        many. Bytes of a WRITE released unfinished that the writer's kernel still holds can
        then never land here (`kvpush.dataplane.sockets`); the peer's next transfer on such a
        connection fails as the peer's disconnection, and it loads this agent again. Nothing
        to do where UCX moves no bytes over TCP."""
        if not self.listen_ports or not ips:
            return 0
        cut = sockets.cut(self.listen_ports, ips)
        if cut:
            log.warning(
                "NIXL agent %s: shut down %d connection(s) from %s, so that no byte of a "
                "WRITE given up can still land",
                self.name,
                len(cut),
                ", ".join(sorted({f"{s.remote[0]}:{s.remote[1]}" for s in cut})),
            )
        return len(cut)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def loaded_peers(self) -> list[str]:
        """Every peer agent loaded in NIXL: `peers()` and those removed but still in use."""
        with self._lock:
            return [*self._peers, *self._retiring]

    def connect(self, peer: str) -> None:
        """Optionally set up the connection now, so the first transfer does not pay for it."""
        self._require_peer(peer)
        try:
            self._live().make_connection(peer)
        except Exception as exc:
            raise _error(exc, f"connecting to {peer}") from exc

    def _forget(self, name: str) -> None:
        prepared = self._peers.pop(name, None)
        if name in self._retiring:
            prepared = self._retiring.pop(name)
        if prepared is not None:
            prepared.release()
        self._metadata.pop(name, None)
        self._unload(name)

    def _released(self, peer: str) -> None:
        """A transfer to `peer` was released: unload the peer if it was removed meanwhile."""
        with self._lock:
            left = self._in_flight.get(peer, 0) - 1
            if left > 0:
                self._in_flight[peer] = left
                return
            self._in_flight.pop(peer, None)
            if peer in self._retiring and not self._closed:
                log.info("NIXL agent %s: unloading peer %s, its transfers ended", self.name, peer)
                self._forget(peer)

    def _unload(self, name: str) -> None:
        try:
            self._live().remove_remote_agent(name)
        except Exception as exc:
            log.warning("NIXL agent %s: unloading peer %s failed: %s", self.name, name, exc)

    def _require_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise TransferError(
                "not_found", f"unknown peer {peer!r}: load its metadata with add_peer first"
            )

    # Prepared blocks: the fast path

    def prepare_peer_blocks(
        self,
        peer: str,
        local_blocks: Pieces,
        remote_blocks: Pieces,
        remote_mem: str | None = None,
    ) -> None:
        """Prepare descriptor lists once per peer: every local and every remote block.

        Transfers then name blocks by index (`write_blocks`, `read_blocks`); NIXL merges
        descriptors adjacent on both sides, so a run of consecutive blocks moves as one.
        Preparing again replaces the previous lists.
        """
        if not len(local_blocks) or not len(remote_blocks):
            raise ValueError("prepare_peer_blocks needs at least one local and one remote block")
        agent = self._live()
        with self._lock:
            self._require_peer(peer)
            what = f"preparing {len(local_blocks)} local / {len(remote_blocks)} blocks of {peer}"
            try:
                local = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self._descs(local_blocks), self._mem
                )
                try:
                    remote = agent.prep_xfer_dlist(
                        peer, self._descs(remote_blocks), remote_mem or self._mem
                    )
                except Exception:
                    local.release()
                    raise
            except Exception as exc:
                raise _error(exc, what) from exc
            old = self._peers.get(peer)
            self._peers[peer] = _Prepared(local, remote, len(local_blocks), len(remote_blocks))
        if old is not None:
            old.release()

    def write_blocks(
        self, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes = b""
    ) -> Transfer:
        """WRITE local blocks `local_idx` into the peer's blocks `remote_idx` (pairwise)."""
        return self._post_prepared("WRITE", peer, local_idx, remote_idx, notif)

    def read_blocks(
        self, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes = b""
    ) -> Transfer:
        """READ the peer's blocks `remote_idx` into local blocks `local_idx` (pairwise)."""
        return self._post_prepared("READ", peer, local_idx, remote_idx, notif)

    def _post_prepared(
        self, op: str, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes
    ) -> Transfer:
        if len(local_idx) != len(remote_idx):
            raise ValueError(
                f"{op} names {len(local_idx)} local and {len(remote_idx)} remote blocks; "
                "they pair up one to one"
            )
        local_idx = np.asarray(local_idx, dtype=np.int32)
        remote_idx = np.asarray(remote_idx, dtype=np.int32)
        with self._lock:
            self._require_peer(peer)
            prepared = self._peers[peer]
            if prepared is None:
                raise TransferError(
                    "not_found", f"no blocks prepared for peer {peer!r}: call prepare_peer_blocks"
                )
            for side, idx, size in (
                ("local", local_idx, prepared.num_local),
                ("remote", remote_idx, prepared.num_remote),
            ):
                if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= size):
                    raise ValueError(
                        f"{op}: {side} block index outside the {size} prepared blocks"
                    )
            if len(local_idx):  # in flight from here: the peer stays loaded
                self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
        what = f"{op} of {len(local_idx)} blocks {'to' if op == 'WRITE' else 'from'} {peer}"
        if not len(local_idx):
            return self._notify_only(peer, notif, what)
        try:
            agent = self._live()
            handle = agent.make_prepped_xfer(
                op,
                prepared.local,
                local_idx,
                prepared.remote,
                remote_idx,
                notif,
            )
        except Exception as exc:
            self._released(peer)
            raise _error(exc, what) from exc
        return self._post(agent, handle, what, peer)

    # Unprepared transfers: any pieces, descriptors built per call

    def write(
        self,
        peer: str,
        src: Pieces,
        dst: Pieces,
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> Transfer:
        """WRITE local pieces `src` into the peer's pieces `dst` (same count and lengths)."""
        return self._post_pieces("WRITE", peer, src, dst, notif, remote_mem)

    def read(
        self,
        peer: str,
        src_remote: Pieces,
        dst_local: Pieces,
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> Transfer:
        """READ the peer's pieces `src_remote` into local pieces `dst_local`."""
        return self._post_pieces("READ", peer, dst_local, src_remote, notif, remote_mem)

    def _post_pieces(
        self,
        op: str,
        peer: str,
        local: Pieces,
        remote: Pieces,
        notif: bytes,
        remote_mem: str | None,
    ) -> Transfer:
        if len(local) != len(remote):
            raise ValueError(
                f"{op} has {len(local)} local and {len(remote)} remote pieces; "
                "they pair up one to one"
            )
        local_descs, remote_descs = self._descs(local), self._descs(remote)
        differ = np.flatnonzero(local_descs[:, 1] != remote_descs[:, 1])
        if differ.size:
            i = int(differ[0])
            raise ValueError(
                f"{op} piece {i}: local length {local_descs[i, 1]} != remote length "
                f"{remote_descs[i, 1]}"
            )
        what = f"{op} of {len(local)} pieces {'to' if op == 'WRITE' else 'from'} {peer}"
        with self._lock:
            self._require_peer(peer)
            if len(local):  # in flight from here: the peer stays loaded
                self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
        if not len(local):
            return self._notify_only(peer, notif, what)
        try:
            agent = self._live()
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local_descs, self._mem),
                agent.get_xfer_descs(remote_descs, remote_mem or self._mem),
                peer,
                notif,
            )
        except Exception as exc:
            self._released(peer)
            raise _error(exc, what) from exc
        return self._post(agent, handle, what, peer)

    def _post(self, agent: Any, handle: Any, what: str, peer: str) -> Transfer:
        """Post a created request; counted in flight for `peer` until released."""
        transfer = Transfer(agent, handle, what, lambda: self._released(peer))
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            transfer.release()
            raise _error(exc, what) from exc
        if state == "ERR":
            transfer.release()
            raise TransferError("failed", f"{what}: NIXL refused to post it")
        if state == "DONE":
            transfer._done = True
        return transfer

    def _notify_only(self, peer: str, notif: bytes, what: str) -> Transfer:
        if notif:
            self.send_notif(peer, notif)
        return Transfer.completed(what)

    def _descs(self, pieces: Pieces) -> np.ndarray[Any, np.dtype[np.uint64]]:
        descs = np.empty((len(pieces), 3), dtype=np.uint64)
        if len(pieces):
            descs[:, :2] = pieces
        descs[:, 2] = self._device
        return descs

    # Completion and notifications

    def wait(self, transfer: Transfer, timeout: float) -> None:
        """Poll `transfer` until done: spin ~50 us, then sleep 20 us growing to 1 ms.

        Raises `TransferError` if it fails, or with kind "timeout" after `timeout` seconds
        (the transfer is then still in flight; release it to cancel).
        """
        start = time.perf_counter()
        spin_until = start + _SPIN_S
        deadline = start + timeout
        delay = _FIRST_SLEEP_S
        while not transfer.poll():
            now = time.perf_counter()
            if now < spin_until:
                continue
            if now >= deadline:
                raise TransferError(
                    "timeout",
                    f"{transfer.what} did not complete within {timeout:g} s; the peer may "
                    "be overloaded or unreachable",
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, _MAX_SLEEP_S)

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a notification to `peer` outside any transfer."""
        self._require_peer(peer)
        try:
            self._live().send_notif(peer, msg)
        except Exception as exc:
            raise _error(exc, f"notifying {peer}") from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent name.

        Also progresses this agent's UCX worker (see the progress model above).
        """
        try:
            raw = self._live().get_new_notifs()
        except Exception as exc:
            raise _error(exc, "reading NIXL notifications") from exc
        return {
            (name.decode() if isinstance(name, bytes) else str(name)): list(msgs)
            for name, msgs in raw.items()
        }

    # Lifetime

    def _live(self) -> Any:
        if self._closed:
            raise TransferError("closed", f"NIXL transport {self.name} is closed")
        return self._agent

    def close(self) -> None:
        """Forget all peers, deregister memory and drop the agent. Idempotent.

        Transfers still in flight must be released first; their memory is deregistered here.
        """
        with self._lock:
            if self._closed:
                return
            for name in [*self._peers, *self._retiring]:
                self._forget(name)
            for regs in self._registered:
                try:
                    self._agent.deregister_memory(regs)
                except Exception as exc:
                    log.warning("NIXL agent %s: deregistering memory failed: %s", self.name, exc)
            self._registered.clear()
            self._closed = True
            self._agent = None

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
