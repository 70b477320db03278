"""Decode, both modes: get a request's KV into the blocks vLLM just allocated for it.

Push: send prefill a `Registration` at once; each producer rank WRITEs and sends
`WriteDone`. Pull: handshake with each producer rank, READ its blocks, and confirm with a
`ReadDone`, whose answer says whether prefill held the blocks for the whole READ (only then
are the bytes read valid); while waiting, renew the lease every half lease. Either way
`Arrivals` counts one completion per producer rank and enforces the transfer's deadline.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpush.core import planning
from kvpush.core.planning import PlanError
from kvpush.core.protocol import (
    MAX_TEXT_LEN,
    Cancel,
    LeaseRenew,
    Message,
    ProtocolError,
    ReadDone,
    Registration,
    WriteDone,
)
from kvpush.core.rendezvous import ArrivalFailed, Arrivals, Deadlines, Outcome
from kvpush.dataplane.control import ControlClient
from kvpush.dataplane.transport import TransferError
from kvpush.vllm.metadata import RecvSpec
from kvpush.vllm.peers import Moving, Peer, PeerLoop, PeerReady
from kvpush.vllm.threads import Aborted

if TYPE_CHECKING:
    from kvpush.vllm.worker import WorkerSide

log = logging.getLogger("kvpush.worker")

_ALL_GENERATIONS = 2**62


@dataclass(eq=False, slots=True)
class _Expecting:
    spec: RecvSpec
    started: float
    producers: range
    deadline: float = math.inf  # next lease renewal (pull)
    alive: bool = True
    aborted: bool = False  # push: the request ended, its blocks wait for the last WRITE


@dataclass(frozen=True, slots=True)
class _Read:
    """Pull: one READ of a transfer from one producer (prefill) rank."""

    spec: RecvSpec
    rank: int


@dataclass(frozen=True, slots=True)
class _Answered:
    """Pull: prefill's answer to a ReadDone (`confirms_read`) or a LeaseRenew.

    An empty `problem` means prefill held the blocks: the READ's bytes are valid, or the
    lease was extended."""

    spec: RecvSpec
    rank: int
    confirms_read: bool
    problem: str


class Receiver(PeerLoop[_Read]):
    """Decode: one per worker; push registers and waits, pull reads."""

    def __init__(self, worker: WorkerSide) -> None:
        self.pull = worker.config.mode == "pull"
        name = "kvpush-pull-reader" if self.pull else "kvpush-push-receiver"
        super().__init__(worker, name, "prefill")
        self.arrivals = Arrivals()
        self.expecting: dict[str, _Expecting] = {}
        self.renewals: Deadlines[_Expecting] = Deadlines()

    def gauges(self) -> dict[str, float]:
        return {
            "decode_waiting_transfers": self.arrivals.pending,
            "decode_reads_in_flight": len(self.inflight),
        }

    def next_deadline(self) -> float | None:
        due = [d for d in (self.arrivals.next_deadline(), self.renewals.next()) if d is not None]
        return min(due, default=None)

    def handle(self, item: object, at: float) -> None:
        now = time.monotonic()
        if isinstance(item, RecvSpec):
            self._expect(item, now)
        elif isinstance(item, WriteDone):
            self._outcomes(self.arrivals.on_write_done(item, now))
        elif isinstance(item, Cancel):
            self._outcomes(self.arrivals.on_cancel(item, now))
        elif isinstance(item, Aborted):
            self._abort(item)
        elif isinstance(item, PeerReady):
            peer = item.peer
            if peer.error:
                self.worker.results.count("failures", peer.error_kind)
            for read in self.peers.ready(peer):
                if peer.error:
                    self._read_failed(read, peer.error)
                else:
                    self._post_read(read, peer)
        elif isinstance(item, _Answered):
            if item.problem:
                why = f"prefill rank {item.rank} no longer holds the KV: {item.problem}"
                self._producer_done(item.spec, item.rank, False, why)
            elif item.confirms_read:
                self._producer_done(item.spec, item.rank, True, "")

    def tick(self) -> None:
        now = time.monotonic()
        for moving, error in self.ended():
            self._read_ended(moving, error, now)
        for expecting in self.renewals.pop_due(now):
            self._renew(expecting, now)
        self._outcomes(self.arrivals.expire(now))

    # Both modes

    def _expect(self, spec: RecvSpec, now: float) -> None:
        ident = self.worker.identity
        producers = planning.peer_ranks(ident.tp_rank, ident.tp_size, spec.prefill_tp)
        deadline = now + self.worker.config.transfer_timeout_s
        self.arrivals.expect(spec.transfer_id, spec.generation, len(producers), deadline)
        old = self.expecting.get(spec.transfer_id)
        if old is not None:
            old.alive = False
        expecting = _Expecting(spec, now, producers)
        self.expecting[spec.transfer_id] = expecting
        if self.pull:
            expecting.deadline = now + self.worker.config.lease_s / 2
            self.renewals.add(expecting)
            for rank in producers:
                peer = self.peers.get(spec.prefill_host, spec.prefill_port + rank)
                read = _Read(spec, rank)
                if self.peers.when_ready(peer, read):
                    self._post_read(read, peer)
        else:
            self._register(spec, producers)

    def _outcomes(self, outcomes: list[Outcome]) -> None:
        now = time.monotonic()
        results = self.worker.results
        for outcome in outcomes:
            expecting = self.expecting.pop(outcome.transfer_id, None)
            if expecting is None:
                continue
            expecting.alive = False
            spec = expecting.spec
            if expecting.aborted:
                results.received(spec.request_id)  # nothing lands in its blocks any more
            elif isinstance(outcome, ArrivalFailed):
                if self.pull:
                    self._stop_reading(expecting, f"decode gave up: {outcome.reason}")
                log.warning("request %s: KV did not arrive: %s", spec.request_id, outcome.reason)
                results.count("failures", "receive_failed")
                results.received(spec.request_id, spec.block_ids)
            else:
                results.received(spec.request_id)
                results.observe(wait_s=now - expecting.started)

    def _abort(self, item: Aborted) -> None:
        """The request ended while waiting for its KV. vLLM frees its blocks once we report
        it received, so that waits until no transfer can land in them any more."""
        expecting = self.expecting.get(item.transfer_id)
        if expecting is None or expecting.aborted:
            return
        spec = expecting.spec
        if self.pull:
            # Our own READs are cancelled or never posted: the blocks are free now.
            del self.expecting[item.transfer_id]
            self.arrivals.forget(item.transfer_id)
            expecting.alive = False
            self._stop_reading(expecting, "decode request ended")
            self.worker.results.received(spec.request_id)
            return
        # A WRITE may be in flight: wait for its WriteDone, or the deadline after which
        # prefill no longer starts one.
        expecting.aborted = True
        cancel = Cancel(item.transfer_id, _ALL_GENERATIONS, "decode request ended")
        for rank in expecting.producers:
            try:
                self._client(spec.prefill_host, spec.prefill_port + rank).send(cancel)
            except (ConnectionError, OSError) as exc:
                log.warning("could not cancel %s at prefill: %s", item.transfer_id, exc)

    def _client(self, host: str, port: int) -> ControlClient:
        return self.peers.get(host, port).client

    # Push

    def _register(self, spec: RecvSpec, producers: range) -> None:
        worker = self.worker
        ident = worker.identity
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
        for rank in producers:
            try:
                self._client(spec.prefill_host, spec.prefill_port + rank).send(reg)
            except (ConnectionError, OSError) as exc:
                why = f"prefill {spec.prefill_host}:{spec.prefill_port + rank} unreachable: {exc}"
                self._outcomes([ArrivalFailed(spec.transfer_id, spec.generation, why)])
                self.arrivals.forget(spec.transfer_id)
                return

    # Pull

    def _current(self, spec: RecvSpec) -> bool:
        expecting = self.expecting.get(spec.transfer_id)
        return expecting is not None and expecting.spec.generation == spec.generation

    def _post_read(self, read: _Read, peer: Peer[_Read]) -> None:
        spec = read.spec
        if not self._current(spec):
            return  # ended (aborted, failed, timed out) while the handshake ran
        if not spec.remote_block_ids:
            self._read_failed(
                read,
                "kv_transfer_params carry no remote_block_ids: the prefill instance is not in "
                "kvpush pull mode, or the router dropped its answer's kv_transfer_params",
            )
            return
        try:
            self.post(
                read,
                "READ",
                peer,
                spec.block_ids,
                spec.remote_block_ids,
                spec.num_tokens,
                spec.remote_num_tokens,
            )
        except (PlanError, TransferError) as exc:
            self._read_failed(read, f"cannot read KV from prefill {peer}: {exc}")

    def _read_ended(self, moving: Moving[_Read], error: str, now: float) -> None:
        read = moving.job
        if error:
            self._read_failed(read, f"READ from prefill {moving.peer} failed: {error}")
            return
        self.worker.results.observe(read_s=now - moving.posted, bytes=float(moving.nbytes))
        done = self._read_done(read.spec, True, "")
        self.peers.submit(self._ask, read.spec, read.rank, moving.peer.client, done)

    def _read_failed(self, read: _Read, why: str) -> None:
        self._producer_done(read.spec, read.rank, False, why)

    def _producer_done(self, spec: RecvSpec, rank: int, ok: bool, why: str) -> None:
        self._outcomes(
            self.arrivals.on_producer_done(
                spec.transfer_id, spec.generation, rank, ok, why, time.monotonic()
            )
        )

    def _stop_reading(self, expecting: _Expecting, reason: str) -> None:
        """Cancel the transfer's READs still in flight and let prefill free its blocks."""
        spec = expecting.spec
        self.inflight.cancel(lambda read: read.spec is spec)
        done = self._read_done(spec, False, reason)
        for rank in expecting.producers:
            peer = self.peers.peers.get((spec.prefill_host, spec.prefill_port + rank))
            if peer is not None and peer.hello is not None:  # never bother a refused peer
                self.peers.submit(self._ask, spec, rank, peer.client, done)

    def _read_done(self, spec: RecvSpec, ok: bool, error: str) -> ReadDone:
        ident = self.worker.identity
        return ReadDone(
            spec.transfer_id,
            spec.generation,
            ident.tp_rank,
            ident.tp_size,
            ok,
            error[:MAX_TEXT_LEN],
        )

    def _renew(self, expecting: _Expecting, now: float) -> None:
        spec = expecting.spec
        renew = LeaseRenew(spec.transfer_id, spec.generation)
        for rank in expecting.producers:
            client = self._client(spec.prefill_host, spec.prefill_port + rank)
            self.peers.submit(self._ask, spec, rank, client, renew)
        expecting.deadline = now + self.worker.config.lease_s / 2
        self.renewals.add(expecting)

    def _ask(self, spec: RecvSpec, rank: int, client: ControlClient, msg: Message) -> None:
        """Pool thread: send a ReadDone or LeaseRenew and hand prefill's answer back."""
        try:
            reply = client.request(msg)
        except (ConnectionError, TimeoutError, OSError, ProtocolError) as exc:
            problem = f"no answer from {client.address} to {type(msg).__name__}: {exc}"
        else:
            if isinstance(reply, Cancel):
                problem = reply.reason
            elif type(reply) is type(msg):
                problem = ""
            else:
                problem = f"unexpected answer {type(reply).__name__} from {client.address}"
        if isinstance(msg, ReadDone) and not msg.ok:
            return  # decode already gave up; the answer only matters to prefill
        answered = _Answered(spec, rank, isinstance(msg, ReadDone), problem)
        self.inbox.put((answered, time.monotonic()))
