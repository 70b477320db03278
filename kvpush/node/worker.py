"""A node: one TP rank's kvpush - its NIXL agent, control server and background threads.

The engine-loop hooks (`bind_connector_metadata`, `get_finished`) only put specs on a queue
and swap result sets: O(1) per request. Everything slow - handshakes, descriptor planning,
posting and polling transfers, control messages - runs on the threads below:

  control-server  (per node) blocks in select(); decodes control messages, answers
                  handshakes and lease questions, routes the rest (`_routes`)
  push-writer     (prefill, push) rendezvous of registrations with finished prefills; WRITEs
  direct          (prefill, push) finished prefills straight from the scheduler's process
                  (`kvpush.node.direct`), an engine step before its metadata brings them
  pull-leases     (prefill, pull) holds finished prefills' blocks until decode read them
  push-receiver   (decode, push)  sends registrations, counts WriteDone per producer rank
  pull-reader     (decode, pull)  READs from each producer rank, confirms, renews leases
  handshakes      (per thread above) a small pool: first contact with a peer never delays
                  transfers to peers already known
  messages        (per thread above) a small pool for messages that may block on a peer

Threading rules: each part's state belongs to its own thread, which takes work from its
inbox; other threads only put items there. Two exceptions, both bounded: the writer sends
a WRITE's `WriteDone` itself, right after the WRITE completed (the notification must not
overtake nothing and must not queue behind slow peers' messages: it goes on the connection
the WRITE's peer already has), and the lease keeper's state is shared under one lock with
the control-server thread, which answers `ReadDone`/`LeaseRenew` on the spot (the answer
says whether decode's READ was valid, so it cannot wait for a queue).

Progress model: NIXL's own progress thread is off (it spins a core); transfers are
initiator-driven (UCX with error handling "none"), so the initiator polls only while a
transfer it posted is in flight, and completions travel as frames on the control channel.
The target of a transfer (decode in push, prefill in pull) calls into NIXL only while one
may be under way (`kvpush.node.progress`; in push, from prefill's `Writing` on): UCX's TCP
transport, used between machines without RDMA, moves bytes only while the target's worker
runs. Idle, nothing spins.

Nothing here imports vLLM: `kvpush.vllm` reads vLLM's KV cache into a `KVLayout` and calls
`start`, so the node runs (and is tested) on any memory a `KVLayout` describes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvpush.core.planning import KVLayout
from kvpush.core.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    LeaseRenew,
    Message,
    ReadDone,
    Registration,
    WriteDone,
    Writing,
    check_compatible,
)
from kvpush.dataplane import threads
from kvpush.dataplane.control import ControlServer, Peer, tls_contexts
from kvpush.dataplane.transport import NixlTransport
from kvpush.node.address import listen_failed
from kvpush.node.config import KvpushConfig
from kvpush.node.context import Context, Identity, Transport
from kvpush.node.direct import DirectReceiver, FirstCopies
from kvpush.node.inbox import ConnectionClosed, Registered
from kvpush.node.progress import TargetProgress
from kvpush.node.progress import for_part as target_progress
from kvpush.node.pull import LeaseKeeper
from kvpush.node.push import PushWriter
from kvpush.node.receiver import Receiver
from kvpush.node.results import HookTimer, Results
from kvpush.node.sampled import PIN_TIMER
from kvpush.node.specs import AbortSpec, HoldSpec, RecvSpec, SendSpec

log = logging.getLogger("kvpush.worker")

Part = PushWriter | LeaseKeeper | Receiver
Route = Callable[[Any, Peer], Message | None]

# The started nodes of this process that are their engine's only rank, by engine id. With
# one rank vLLM runs the worker inside the engine core process, on the scheduler's own
# thread (its in-process executor), and the scheduler side hands its specs straight to
# the node (`in_process`) instead of shipping them in the next step's metadata: a
# finished prefill's WRITE then starts a whole engine step earlier.
_IN_PROCESS: dict[str, WorkerSide] = {}


def in_process(engine_id: str) -> WorkerSide | None:
    """The node of `engine_id` if it runs in this process and is the engine's only rank."""
    return _IN_PROCESS.get(engine_id)


class WorkerSide:
    """One TP rank's node; `start` it once vLLM's KV cache is allocated."""

    def __init__(self, config: KvpushConfig, identity: Identity) -> None:
        self.config = config
        self.identity = identity
        self.timer = HookTimer("worker")
        self._hand_off_span = self.timer("bind_connector_metadata")
        self._finished_span = self.timer("get_finished")
        self.results = Results()
        self.transport: NixlTransport | None = None
        self.server: ControlServer | None = None
        self.ctx: Context | None = None
        # Prefill: the writer (push) or the lease keeper (pull); decode: the receiver.
        self.part: Part | None = None
        self.progress: TargetProgress | None = None  # the target's NIXL progress, if needed
        # Push prefill: finished prefills straight from the scheduler (`kvpush.node.direct`),
        # and which of them came already (the next step's metadata brings each again)
        self.direct: DirectReceiver | None = None
        self.copies = FirstCopies()
        self._routes: dict[type, Route] = {}
        # Server thread only: the Hello each open connection handshook with (compatible
        # or not), so a registration binds to the incarnation that sent it.
        self._hellos: dict[int, Hello] = {}
        self._rejected_reported: dict[str, int] = {}

    @property
    def port(self) -> int:
        return self.config.port + self.identity.port_offset

    def start(
        self,
        layout: KVLayout,
        memory: Sequence[tuple[int, int]],
        kv_dtype: str,
        mem: str = "DRAM",
        device: int = 0,
        transport: Transport | None = None,
    ) -> None:
        """Register `memory` (where `layout` lies) with NIXL, start the part this role and
        mode needs and the control server. `mem` is "VRAM" for GPU KV, so NIXL moves it
        with GPUDirect where the backend can; `transport` replaces NIXL in tests."""
        ident, config = self.identity, self.config
        threads.configure(config.thread_policy)  # before any of our threads starts
        server_tls = client_tls = None
        if config.tls:  # first: unreadable files fail before anything is registered
            server_tls, client_tls = tls_contexts(config.tls_cert, config.tls_key, config.tls_ca)
        stage = f"-pp{ident.pp_rank}" if ident.pp_size > 1 else ""
        name = f"{ident.engine_id}{stage}-tp{ident.tp_rank}-{uuid.uuid4().hex[:8]}"
        if transport is None:
            self.transport = NixlTransport(name, self.config.backend)
            self.transport.register_regions(list(memory), mem=mem, device=device)
            transport = self.transport
            metadata = self.transport.metadata()
        else:
            metadata = b""
        hello = Hello(
            version=PROTOCOL_VERSION,
            engine_id=ident.engine_id,
            role=ident.role,  # type: ignore[arg-type]
            mode=self.config.mode,  # type: ignore[arg-type]
            model=ident.model,
            kv_dtype=kv_dtype,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            layout=layout,
            agent_name=name,
            agent_metadata=metadata,
            memory=tuple(memory),
            host=self.config.host,
            port=self.port,
            pp_rank=ident.pp_rank,
            pp_size=ident.pp_size,
        )
        self.results.by_request = layout.groups > 1
        self.ctx = ctx = Context(config, ident, transport, hello, self.results, client_tls)
        self.part = self._make_part(ctx)
        self.part.start()
        if self.transport is not None:
            self.progress = target_progress(self.transport, self.part)
        self.server = ControlServer(
            config.listen_host,
            self.port,
            self._on_message,
            secret=config.secret,
            limits=config.control,
            tls=server_tls,
            on_close=self._closed,
        )
        try:
            self.server.start()
        except OSError as exc:
            raise listen_failed(exc, config.listen_host, config.host) from exc
        if ident.tp_size * ident.pp_size == 1:
            _IN_PROCESS[ident.engine_id] = self
        if isinstance(self.part, PushWriter):
            self.direct = DirectReceiver.open(
                ident.engine_id,
                config.host,
                self.port,
                deliver=self._direct,
                reject=lambda kind: self.results.count("rejected", kind),
            )
        log.info(
            "kvpush %s worker %d/%d%s: %d KV regions x %d blocks of %d tokens%s, %d of %d KV "
            "heads (%s), control on %s:%d (listening on %s)",
            ident.role,
            ident.tp_rank,
            ident.tp_size,
            f" of pipeline stage {ident.pp_rank}/{ident.pp_size}" if ident.pp_size > 1 else "",
            layout.num_regions,
            layout.scheduler_blocks,
            layout.block_tokens,
            f" in {layout.groups} KV cache groups" if layout.groups > 1 else "",
            layout.num_heads,
            layout.total_heads,
            kv_dtype,
            self.config.host,
            self.port,
            self.config.listen_host,
        )
        if self.config.secret is None:
            log.warning(
                "INSECURE: kvpush control messages on %s:%d are not authenticated (%s): anyone "
                "who can reach the port gets this worker's NIXL metadata and KV addresses and "
                "can then read and write its KV cache over NIXL, and can forge registrations "
                "and completions. Only for a private test network; otherwise set the same "
                "secret in KVPUSH_SECRET (or the variable kv_connector_extra_config.secret_env "
                "names) on every prefill and decode",
                self.config.host,
                self.port,
                "insecure: true" if self.config.insecure else "no shared secret",
            )
        if self.config.tls:
            log.info("kvpush control channel on %s:%d uses mutual TLS", self.config.host, self.port)
        if self.config.faults:
            log.warning(
                "kvpush test hooks enabled (KVPUSH_FAULTS): %s; never in production",
                ", ".join(sorted(self.config.faults.enabled)),
            )

    def _make_part(self, ctx: Context) -> Part:
        """The part this role and mode runs, and which messages go to it."""
        self._routes = {Hello: self._answer_hello}
        if self.identity.role == "decode":
            receiver = Receiver(ctx)
            self._routes |= dict.fromkeys((WriteDone, Cancel, Writing), _deliver(receiver))
            return receiver
        if self.config.mode == "pull":
            keeper = LeaseKeeper(ctx)
            self._routes |= dict.fromkeys((ReadDone, LeaseRenew), _answer(keeper))
            self._routes[Registration] = self._registration(keeper)
            return keeper
        writer = PushWriter(ctx)
        self._routes[Registration] = self._registration(writer)
        self._routes[Cancel] = self._cancel(writer)
        self._routes[LeaseRenew] = _acknowledge(writer)
        return writer

    def _registration(self, part: PushWriter | LeaseKeeper) -> Route:
        """Hand `part` a registration bound to the Hello of the connection it came on; one
        that names another incarnation or address than that Hello is dropped (the test
        hook drop_registration loses chosen ones)."""

        def route(msg: Registration, peer: Peer) -> Message | None:
            hello = self._hellos.get(peer.conn_id)
            problem = _unbound(msg, hello)
            if problem or hello is None:
                self.results.count("rejected", "unbound_registration")
                log.warning("dropped registration %s from %s: %s", msg.transfer_id, peer, problem)
                return None
            if self.config.faults.fires("drop_registration", msg.transfer_id):
                return None
            part.enqueue(Registered(msg, hello, peer.conn_id))
            return None

        return route

    def _cancel(self, writer: PushWriter) -> Route:
        """A decode's Cancel; it is acknowledged at that decode's own address (its Hello on
        this connection), never at one the message names."""

        def route(msg: Cancel, peer: Peer) -> Message | None:
            hello = self._hellos.get(peer.conn_id)
            ack = (hello.host, hello.port) if hello is not None and msg.ack_port else ("", 0)
            writer.enqueue(dataclasses.replace(msg, ack_host=ack[0], ack_port=ack[1]))
            return None

        return route

    def _on_message(self, msg: Message, peer: Peer) -> Message | None:
        """Runs on the control-server thread: route `msg` to the part that takes it; a
        message nobody takes is counted as rejected."""
        route = self._routes.get(type(msg))
        if route is None:
            self.results.count("rejected", f"unexpected_{type(msg).__name__}")
            return None
        return route(msg, peer)

    def _answer_hello(self, msg: Hello, peer: Peer) -> Message:
        """Our own Hello, even to an incompatible peer, so the peer's own check names the
        mismatch too (e.g. both modes) and fails its requests. The peer's Hello is kept
        for the connection: its registrations bind to it."""
        assert self.ctx is not None
        problem = check_compatible(self.ctx.hello, msg)
        if problem:
            log.error("refusing handshake from %s: %s", msg.engine_id, problem)
            self.results.count("failures", "incompatible_peer")
        self._hellos[peer.conn_id] = msg
        return self.ctx.hello

    def _closed(self, peer: Peer) -> None:
        """Server thread: a connection closed; a writer voids what was registered on it."""
        hello = self._hellos.pop(peer.conn_id, None)
        if hello is not None and isinstance(self.part, PushWriter):
            self.part.enqueue(ConnectionClosed(peer.conn_id, hello))

    def hand_off(
        self,
        recv: Sequence[RecvSpec | HoldSpec],
        send: Sequence[SendSpec],
        aborted: Sequence[AbortSpec],
    ) -> None:
        """The engine loop's specs for this step, queued for the part (O(1) each); called
        as vLLM binds the step's metadata, before its forward."""
        with self._hand_off_span:
            self.queue(recv, send, aborted)

    def queue(
        self,
        recv: Sequence[RecvSpec | HoldSpec],
        send: Sequence[SendSpec],
        aborted: Sequence[AbortSpec],
    ) -> None:
        """`hand_off` untimed: the scheduler side's hooks call it directly when this node
        runs in their process (`in_process`), inside their own timed span."""
        part = self.part
        if part is None or not (recv or send or aborted):
            return
        now = time.monotonic()
        # prefill takes finished prefills, decode its allocations (and the requests that
        # wait for theirs); both take aborts but
        # a pull prefill, whose request that ended early granted no lease
        items = send if self.identity.role == "prefill" else recv
        direct = self.direct is not None  # a push prefill's: its items are SendSpecs
        for item in items:
            if (
                direct
                and isinstance(item, SendSpec)
                and item.finished_at  # not the scheduler's: never a twin
                and not self.copies.first(item, now)
            ):
                continue  # it came straight from the scheduler, a step ago
            part.inbox.put((item, now))
        if not isinstance(part, LeaseKeeper):
            for abort in aborted:
                part.inbox.put((abort, now))

    def _direct(self, spec: SendSpec, at: float) -> None:
        """The direct thread: a finished prefill straight from the scheduler, to the writer
        unless the step's metadata brought it first."""
        part = self.part
        if part is not None and self.copies.first(spec, at):
            part.inbox.put((spec, at))

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._finished_span:
            return self.results.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.results.take_load_errors()

    def has_news(self) -> bool:
        """Whether the threads recorded anything for the stats since they were taken (no
        lock: a racing write shows at the next call)."""
        return self.results.news

    def stats_data(self) -> dict[str, Any]:
        data = self.results.take_data()
        self.timer.drain(data)
        PIN_TIMER.drain(data)
        if self.server is not None:
            # The server keeps running totals; stats carry what is new since last time.
            for kind, total in self.server.rejected.items():
                new = total - self._rejected_reported.get(kind, 0)
                if new:
                    data["rejected"][kind] = data["rejected"].get(kind, 0) + new
                    self._rejected_reported[kind] = total
        if self.part is not None:
            data["gauges"].update(self.part.gauges())
        return data

    def shutdown(self) -> None:
        if _IN_PROCESS.get(self.identity.engine_id) is self:
            del _IN_PROCESS[self.identity.engine_id]
        if self.direct is not None:
            self.direct.stop()
        if self.server is not None:
            self.server.stop()
        if self.part is not None:
            self.part.stop()
        if self.progress is not None:
            self.progress.stop()
        if self.transport is not None:
            self.transport.close()


def _deliver(part: Receiver) -> Route:
    def route(msg: Message, peer: Peer) -> Message | None:
        part.enqueue(msg)
        return None

    return route


def _acknowledge(writer: PushWriter) -> Route:
    """Push: decode renews a finished prefill its request waits to register for; the writer
    applies it on its own thread, so the answer only says it arrived."""

    def route(msg: LeaseRenew, peer: Peer) -> Message | None:
        writer.enqueue(msg)
        return msg

    return route


def _answer(keeper: LeaseKeeper) -> Route:
    def route(msg: ReadDone | LeaseRenew, peer: Peer) -> Message | None:
        return keeper.answer(msg)

    return route


def _unbound(reg: Registration, hello: Hello | None) -> str:
    """Why `reg` is not its connection's Hello's to send ("" when it is)."""
    if hello is None:
        return "no handshake on its connection"
    if reg.agent_name != hello.agent_name:
        return f"it names incarnation {reg.agent_name!r}, its connection {hello.agent_name!r}"
    if (reg.engine_id, reg.tp_rank, reg.tp_size) != (hello.engine_id, hello.tp_rank, hello.tp_size):
        return f"it names {reg.engine_id} rank {reg.tp_rank}/{reg.tp_size}, unlike its Hello"
    if (reg.host, reg.port) != (hello.host, hello.port):
        return f"it names {reg.host}:{reg.port}, its Hello {hello.host}:{hello.port}"
    return ""
