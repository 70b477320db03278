"""Worker side: owns the KV memory, the NIXL agent and the background threads.

The engine-loop hooks (`start_load_kv`, `get_finished`) only put specs on a queue and swap
result sets: O(1) per request. Everything slow - handshakes, descriptor planning, posting
and polling WRITEs, sending registrations - runs on the threads below:

  control-server  (per worker) blocks in select(); decodes control messages and queues them
  push-writer     (prefill)   rendezvous of registrations with finished prefills; WRITEs
  push-receiver   (decode)    sends registrations, counts WriteDone per producer rank
  handshakes      (prefill)   a small pool: first contact with a decode never delays
                              writes to decodes already known

Progress model: NIXL's own progress thread is off (it spins a core); WRITEs are
initiator-driven (UCX with error handling "none"), so the writer polls only while a WRITE
it posted is in flight, and the completion travels as a WriteDone frame on the control
channel once the initiator saw the WRITE complete. Idle, nothing spins.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpush.core import planning
from kvpush.core.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Hello,
    Message,
    Registration,
    WriteDone,
    check_compatible,
)
from kvpush.core.rendezvous import (
    ArrivalFailed,
    Arrivals,
    DropRegistration,
    NotifyFailure,
    ReleaseBlocks,
    Rendezvous,
    StartWrite,
)
from kvpush.dataplane.control import ControlClient, ControlServer
from kvpush.dataplane.transport import NixlTransport, Transfer, TransferError
from kvpush.vllm.config import KvpushConfig
from kvpush.vllm.layout import block_pieces, describe_kv_caches
from kvpush.vllm.metadata import KvpushMetadata, RecvSpec, SendSpec
from kvpush.vllm.stats import HookTimer, empty_data

log = logging.getLogger("kvpush.worker")


@dataclass(frozen=True, slots=True)
class Identity:
    engine_id: str
    role: str  # "prefill" or "decode"
    model: str
    dtype: str
    tp_rank: int
    tp_size: int


class Results:
    """What the background threads tell the engine loop; swapped out under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.data = empty_data()

    def take(self) -> tuple[set[str], set[str]]:
        with self.lock:
            sending, recving = self.sending, self.recving
            self.sending, self.recving = set(), set()
            return sending, recving

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self.load_errors = self.load_errors, set()
            return errors

    def take_data(self) -> dict[str, Any]:
        with self.lock:
            data, self.data = self.data, empty_data()
            return data

    def count(self, table: str, key: str, n: int = 1) -> None:
        with self.lock:
            self.data[table][key] = self.data[table].get(key, 0) + n

    def observe(self, **series: float) -> None:
        with self.lock:
            for name, value in series.items():
                self.data[name].append(value)


class WorkerSide:
    def __init__(self, config: KvpushConfig, identity: Identity) -> None:
        self.config = config
        self.identity = identity
        self.timer = HookTimer("worker")
        self.results = Results()
        self.transport: NixlTransport | None = None
        self.server: ControlServer | None = None
        self.writer: PushWriter | None = None
        self.receiver: PushReceiver | None = None
        self.hello: Hello | None = None

    @property
    def port(self) -> int:
        return self.config.port + self.identity.tp_rank

    def register_kv_caches(
        self, kv_caches: dict[str, Any], block_size: int, num_heads: int, head_dim: int
    ) -> None:
        ident = self.identity
        layout, memory = describe_kv_caches(kv_caches, block_size, num_heads, head_dim)
        name = f"{ident.engine_id}-tp{ident.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.transport = NixlTransport(name, self.config.backend)
        # GPU KV (kv_buffer_device "cuda") is registered as VRAM so NIXL moves it with
        # GPUDirect where the backend supports it; CPU KV as DRAM.
        first = next(iter(kv_caches.values()))
        on_gpu = first.device.type == "cuda"
        self.transport.register_regions(
            list(memory), mem="VRAM" if on_gpu else "DRAM", device=first.device.index or 0
        )
        self.hello = Hello(
            version=PROTOCOL_VERSION,
            engine_id=ident.engine_id,
            role=ident.role,  # type: ignore[arg-type]
            mode=self.config.mode,  # type: ignore[arg-type]
            model=ident.model,
            dtype=ident.dtype,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            layout=layout,
            agent_name=name,
            agent_metadata=self.transport.metadata(),
            memory=memory,
        )
        if ident.role == "prefill":
            self.writer = PushWriter(self)
            self.writer.start()
        else:
            self.receiver = PushReceiver(self)
            self.receiver.start()
        self.server = ControlServer(
            self.config.host, self.port, self._on_message, secret=self.config.secret
        )
        self.server.start()
        log.info(
            "kvpush %s worker %d/%d: %d KV regions x %d blocks of %d tokens, control on %s:%d",
            ident.role,
            ident.tp_rank,
            ident.tp_size,
            layout.num_regions,
            layout.num_blocks,
            layout.block_size,
            self.config.host,
            self.port,
        )

    def _on_message(self, msg: Message, peer: Any) -> Message | None:
        """Runs on the control-server thread: answer handshakes, hand the rest over."""
        if isinstance(msg, Hello):
            assert self.hello is not None
            problem = check_compatible(self.hello, msg)
            if problem:
                log.error("refusing handshake from %s: %s", msg.engine_id, problem)
                self.results.count("failures", "incompatible_peer")
            return self.hello
        if self.writer is not None and isinstance(msg, Registration | Cancel):
            self.writer.inbox.put((msg, time.monotonic()))
        elif self.receiver is not None and isinstance(msg, WriteDone | Cancel):
            self.receiver.inbox.put((msg, time.monotonic()))
        else:
            self.results.count("rejected", f"unexpected_{type(msg).__name__}")
        return None

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        with self.timer("start_load_kv"):
            now = time.monotonic()
            if self.receiver is not None:
                for spec in meta.recv:
                    self.receiver.inbox.put((spec, now))
            if self.writer is not None:
                for send in meta.send:
                    self.writer.inbox.put((send, now))
            for transfer_id, request_id in meta.aborted:
                target = self.writer or self.receiver
                if target is not None:
                    target.inbox.put((Aborted(transfer_id, request_id), now))

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self.timer("get_finished"):
            return self.results.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.results.take_load_errors()

    def stats_data(self) -> dict[str, Any]:
        data = self.results.take_data()
        self.timer.drain(data)
        if self.server is not None:
            for kind, n in self.server.rejected.items():
                data["rejected"][kind] = n
        if self.writer is not None:
            data["gauges"].update(self.writer.gauges())
        if self.receiver is not None:
            data["gauges"]["decode_waiting_transfers"] = self.receiver.arrivals.pending
        return data

    def shutdown(self) -> None:
        for part in (self.server, self.writer, self.receiver):
            if part is not None:
                part.stop()
        if self.transport is not None:
            self.transport.close()


@dataclass(frozen=True, slots=True)
class Aborted:
    transfer_id: str
    request_id: str


class _Loop(threading.Thread):
    """A daemon thread draining `inbox`; subclasses handle items and timeouts."""

    def __init__(self, worker: WorkerSide, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.worker = worker
        self.inbox: queue.Queue[tuple[object, float]] = queue.Queue()
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put((None, 0.0))
        self.join(timeout=5)

    def run(self) -> None:
        while not self._stopping:
            try:
                item, at = self.inbox.get(timeout=self.wait_time())
            except queue.Empty:
                item, at = None, 0.0
            try:
                if item is not None:
                    self.handle(item, at)
                self.tick()
            except Exception:  # a bug must not kill the thread silently
                log.exception("%s: unexpected error", self.name)
                self.worker.results.count("failures", "internal_error")

    def wait_time(self) -> float | None:
        raise NotImplementedError

    def handle(self, item: object, at: float) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class Peer:
    """A decode rank this prefill writes into."""

    host: str
    port: int
    client: ControlClient
    hello: Hello | None = None
    agent: str = ""
    error: str = ""
    same_shape: bool = False
    waiting: list[StartWrite] = field(default_factory=list)


@dataclass(slots=True)
class InFlight:
    start: StartWrite
    transfer: Transfer
    peer: Peer
    posted: float
    nbytes: int


class PushWriter(_Loop):
    """Prefill: pair registrations with finished prefills and WRITE into decode."""

    def __init__(self, worker: WorkerSide) -> None:
        super().__init__(worker, "kvpush-push-writer")
        ident = worker.identity
        self.rendezvous = Rendezvous(ident.tp_rank, ident.tp_size, lease_s=worker.config.lease_s)
        self.peers: dict[tuple[str, int], Peer] = {}
        self.inflight: list[InFlight] = []
        self.registered_at: dict[tuple[str, int], float] = {}
        self.handshakes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpush-handshake")
        self._poll_sleep = 0.0

    def gauges(self) -> dict[str, float]:
        r = self.rendezvous
        return {
            "prefill_waiting_registrations": r.waiting_registrations,
            "prefill_waiting_prefills": r.waiting_prefills,
            "prefill_held_blocks": r.held_blocks,
            "prefill_writes_in_flight": r.writes_in_flight,
        }

    def stop(self) -> None:
        super().stop()
        self.handshakes.shutdown(wait=False, cancel_futures=True)

    def wait_time(self) -> float | None:
        if self.inflight:
            # A WRITE is moving: poll it, sleeping a little longer each idle round.
            self._poll_sleep = min(max(self._poll_sleep * 2, 20e-6), 1e-3)
            return self._poll_sleep
        deadline = self.rendezvous.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def handle(self, item: object, at: float) -> None:
        now = time.monotonic()
        if isinstance(item, Registration):
            self.registered_at[(item.transfer_id, item.generation)] = at
            self.act(self.rendezvous.register(item, now))
        elif isinstance(item, SendSpec):
            self.act(
                self.rendezvous.prefill_done(
                    item.transfer_id, item.request_id, item.block_ids, item.num_tokens, now
                )
            )
        elif isinstance(item, Cancel):
            self.act(self.rendezvous.cancel(item.transfer_id, item.generation, item.reason, now))
        elif isinstance(item, Aborted):
            self.act(
                self.rendezvous.abort_local(
                    item.transfer_id, item.request_id, "prefill request aborted", now
                )
            )
        elif isinstance(item, _PeerReady):
            self._peer_ready(item.peer)

    def tick(self) -> None:
        now = time.monotonic()
        still: list[InFlight] = []
        for job in self.inflight:
            try:
                done = job.transfer.poll()
                error = ""
            except TransferError as exc:
                done, error = True, f"{exc.kind}: {exc}"
            if not done:
                still.append(job)
                continue
            self._poll_sleep = 0.0
            self._finish(job, error, now)
        self.inflight = still
        self.act(self.rendezvous.expire(now))

    def act(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, StartWrite):
                self._start(action)
            elif isinstance(action, ReleaseBlocks):
                with self.worker.results.lock:
                    self.worker.results.sending.add(action.local.request_id)
            elif isinstance(action, NotifyFailure):
                reg = action.registration
                self.worker.results.count("failures", "write_not_done")
                self.handshakes.submit(self._notify, reg.host, reg.port, action.message)
            elif isinstance(action, DropRegistration):
                log.info(
                    "dropped registration %s: %s", action.registration.transfer_id, action.reason
                )

    def _notify(self, host: str, port: int, msg: Message) -> None:
        try:
            self._peer(host, port).client.send(msg)
        except (ConnectionError, OSError) as exc:
            log.warning("could not tell decode %s:%d about a failure: %s", host, port, exc)

    def _peer(self, host: str, port: int) -> Peer:
        key = (host, port)
        if key not in self.peers:
            self.peers[key] = Peer(
                host, port, ControlClient(host, port, secret=self.worker.config.secret, timeout=5.0)
            )
        return self.peers[key]

    def _start(self, start: StartWrite) -> None:
        reg = start.registration
        peer = self._peer(reg.host, reg.port)
        if peer.error:
            self._fail_start(start, peer.error)
        elif peer.hello is None:
            peer.waiting.append(start)
            if len(peer.waiting) == 1:
                self.handshakes.submit(self._handshake, peer)
        else:
            self._post(start, peer)

    def _handshake(self, peer: Peer) -> None:
        """Handshake thread: learn the decode's layout and NIXL agent, then hand back."""
        worker = self.worker
        assert worker.hello is not None and worker.transport is not None
        try:
            remote = peer.client.request(worker.hello, timeout=10.0)
            if not isinstance(remote, Hello):
                raise ConnectionError(f"expected a Hello, got {type(remote).__name__}")
            problem = check_compatible(worker.hello, remote)
            if problem:
                raise ConnectionError(f"incompatible peer {remote.engine_id}: {problem}")
            agent = worker.transport.add_peer(remote.agent_metadata, name=remote.agent_name)
            local = worker.hello.layout
            same = (
                remote.layout.block_size == local.block_size
                and remote.tp_size == worker.identity.tp_size
                and remote.layout.num_heads == local.num_heads
            )
            if same:
                worker.transport.prepare_peer_blocks(
                    agent, block_pieces(local), block_pieces(remote.layout)
                )
            peer.agent, peer.same_shape, peer.hello = agent, same, remote
        except Exception as exc:  # any failure here fails this peer's writes, clearly
            peer.error = f"handshake with decode {peer.host}:{peer.port} failed: {exc}"
            log.error("%s", peer.error)
        self.inbox.put((_PeerReady(peer), time.monotonic()))

    def _peer_ready(self, peer: Peer) -> None:
        waiting, peer.waiting = peer.waiting, []
        if peer.error:
            # Let a later registration retry the handshake (the decode may have restarted).
            error = peer.error
            self.peers.pop((peer.host, peer.port), None)
            for start in waiting:
                self._fail_start(start, error)
            return
        for start in waiting:
            self._post(start, peer)

    def _post(self, start: StartWrite, peer: Peer) -> None:
        worker = self.worker
        assert worker.transport is not None and worker.hello is not None and peer.hello
        reg, local = start.registration, start.local
        if local.num_tokens < reg.num_tokens:
            self._fail_start(
                start,
                (f"prefill computed {local.num_tokens} tokens but decode expects {reg.num_tokens}"),
            )
            return
        src, dst = worker.hello.layout, peer.hello.layout
        try:
            if peer.same_shape:
                n = math.ceil(reg.num_tokens / src.block_size)
                if n > len(local.block_ids) or n > len(reg.block_ids):
                    raise planning.PlanError(
                        f"{reg.num_tokens} tokens need {n} blocks; prefill has "
                        f"{len(local.block_ids)}, decode registered {len(reg.block_ids)}"
                    )
                _check_ids(reg.block_ids[:n], dst.num_blocks, "decode")
                local_idx = [
                    r * src.num_blocks + b
                    for r in range(src.num_regions)
                    for b in local.block_ids[:n]
                ]
                remote_idx = [
                    r * dst.num_blocks + b
                    for r in range(dst.num_regions)
                    for b in reg.block_ids[:n]
                ]
                descriptors = len(planning.merge_runs(local.block_ids[:n])) * src.num_regions
                nbytes = n * src.num_regions * src.block_bytes
                transfer = worker.transport.write_blocks(peer.agent, local_idx, remote_idx)
            else:
                plan = planning.plan_transfer(
                    src,
                    local.block_ids,
                    dst,
                    reg.block_ids,
                    reg.num_tokens,
                    src_rank=worker.identity.tp_rank,
                    src_tp=worker.identity.tp_size,
                    dst_rank=reg.tp_rank,
                    dst_tp=reg.tp_size,
                )
                pieces = [d for region in plan.regions for d in region]
                descriptors, nbytes = plan.num_descriptors, plan.total_bytes
                transfer = worker.transport.write(
                    peer.agent, [(s, n) for s, _, n in pieces], [(d, n) for _, d, n in pieces]
                )
        except (planning.PlanError, TransferError) as exc:
            self._fail_start(start, f"cannot write KV: {exc}")
            return
        now = time.monotonic()
        registered = self.registered_at.pop((reg.transfer_id, reg.generation), now)
        worker.results.observe(
            reg_to_write_s=max(0.0, now - registered), descriptors=float(descriptors)
        )
        self.inflight.append(InFlight(start, transfer, peer, now, nbytes))

    def _fail_start(self, start: StartWrite, error: str) -> None:
        reg = start.registration
        self.worker.results.count("failures", "write_failed")
        log.warning("transfer %s to %s failed: %s", reg.transfer_id, reg.engine_id, error)
        self.act(
            self.rendezvous.write_finished(
                reg.transfer_id, reg.generation, False, error, time.monotonic()
            )
        )

    def _finish(self, job: InFlight, error: str, now: float) -> None:
        reg = job.start.registration
        job.transfer.release()
        if error:
            self._fail_start(job.start, error)
            return
        self.worker.results.observe(write_s=now - job.posted, bytes=float(job.nbytes))
        ident = self.worker.identity
        done = WriteDone(reg.transfer_id, reg.generation, ident.tp_rank, ident.tp_size, True, "")
        try:
            job.peer.client.send(done)
        except (ConnectionError, OSError) as exc:
            self._fail_start(job.start, f"decode unreachable after the WRITE: {exc}")
            return
        self.act(self.rendezvous.write_finished(reg.transfer_id, reg.generation, True, "", now))


@dataclass(frozen=True, slots=True)
class _PeerReady:
    peer: Peer


def _check_ids(ids: tuple[int, ...], num_blocks: int, side: str) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise planning.PlanError(f"{side} block ids {bad[:5]} outside 0..{num_blocks - 1}")


@dataclass(slots=True)
class _Expecting:
    request_id: str
    block_ids: tuple[int, ...]
    prefill: tuple[str, int]
    sent: float


class PushReceiver(_Loop):
    """Decode: register blocks with prefill at once, then count WriteDone per producer."""

    def __init__(self, worker: WorkerSide) -> None:
        super().__init__(worker, "kvpush-push-receiver")
        self.arrivals = Arrivals()
        self.expecting: dict[str, _Expecting] = {}
        self.clients: dict[tuple[str, int], ControlClient] = {}

    def wait_time(self) -> float | None:
        deadline = self.arrivals.next_deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def stop(self) -> None:
        super().stop()
        for client in self.clients.values():
            client.close()

    def _client(self, host: str, port: int) -> ControlClient:
        key = (host, port)
        if key not in self.clients:
            self.clients[key] = ControlClient(
                host, port, secret=self.worker.config.secret, timeout=5.0
            )
        return self.clients[key]

    def handle(self, item: object, at: float) -> None:
        now = time.monotonic()
        if isinstance(item, RecvSpec):
            self._register(item, now)
        elif isinstance(item, WriteDone):
            self._outcomes(self.arrivals.on_write_done(item, now))
        elif isinstance(item, Cancel):
            self._outcomes(self.arrivals.on_cancel(item, now))
        elif isinstance(item, Aborted):
            expecting = self.expecting.pop(item.transfer_id, None)
            if expecting is not None and self.arrivals.forget(item.transfer_id):
                cancel = Cancel(item.transfer_id, 2**62, "decode request ended")
                try:
                    self._client(*expecting.prefill).send(cancel)
                except (ConnectionError, OSError) as exc:
                    log.warning("could not cancel %s at prefill: %s", item.transfer_id, exc)

    def tick(self) -> None:
        self._outcomes(self.arrivals.expire(time.monotonic()))

    def _register(self, spec: RecvSpec, now: float) -> None:
        worker = self.worker
        ident = worker.identity
        producers = len(planning.peer_ranks(ident.tp_rank, ident.tp_size, spec.prefill_tp))
        deadline = now + worker.config.transfer_timeout_s
        self.arrivals.expect(spec.transfer_id, spec.generation, producers, deadline)
        self.expecting[spec.transfer_id] = _Expecting(
            spec.request_id, spec.block_ids, (spec.prefill_host, spec.prefill_port), now
        )
        reg = Registration(
            transfer_id=spec.transfer_id,
            request_id=spec.request_id,
            engine_id=ident.engine_id,
            host=worker.config.host,
            port=worker.port,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            block_ids=spec.block_ids,
            num_tokens=spec.num_tokens,
            generation=spec.generation,
            deadline_ms=int(worker.config.transfer_timeout_s * 1000),
        )
        for rank in planning.peer_ranks(ident.tp_rank, ident.tp_size, spec.prefill_tp):
            try:
                self._client(spec.prefill_host, spec.prefill_port + rank).send(reg)
            except (ConnectionError, OSError) as exc:
                why = f"prefill {spec.prefill_host}:{spec.prefill_port + rank} unreachable: {exc}"
                self._outcomes([ArrivalFailed(spec.transfer_id, spec.generation, why)])
                self.arrivals.forget(spec.transfer_id)
                return

    def _outcomes(self, outcomes: list[Any]) -> None:
        now = time.monotonic()
        results = self.worker.results
        for outcome in outcomes:
            expecting = self.expecting.pop(outcome.transfer_id, None)
            if expecting is None:
                continue
            with results.lock:
                results.recving.add(expecting.request_id)
                if isinstance(outcome, ArrivalFailed):
                    results.load_errors.update(expecting.block_ids)
            if isinstance(outcome, ArrivalFailed):
                log.warning(
                    "request %s: KV did not arrive: %s", expecting.request_id, outcome.reason
                )
                results.count("failures", "receive_failed")
            else:
                results.observe(wait_s=now - expecting.sent)
