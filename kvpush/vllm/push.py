"""Prefill, push mode: pair registrations with finished prefills and WRITE into decode."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvpush.core.planning import PlanError
from kvpush.core.protocol import Cancel, Registration, WriteDone
from kvpush.core.rendezvous import (
    DropRegistration,
    NotifyFailure,
    ReleaseBlocks,
    Rendezvous,
    StartWrite,
)
from kvpush.dataplane.transport import TransferError
from kvpush.vllm.metadata import SendSpec
from kvpush.vllm.peers import Moving, Peer, PeerLoop, PeerReady
from kvpush.vllm.threads import Aborted

if TYPE_CHECKING:
    from kvpush.vllm.worker import WorkerSide

log = logging.getLogger("kvpush.worker")


class PushWriter(PeerLoop[StartWrite]):
    """Prefill: pair registrations with finished prefills and WRITE into decode."""

    def __init__(self, worker: WorkerSide) -> None:
        super().__init__(worker, "kvpush-push-writer", "decode")
        ident = worker.identity
        self.rendezvous = Rendezvous(ident.tp_rank, ident.tp_size, lease_s=worker.config.lease_s)
        self.registered_at: dict[tuple[str, int], float] = {}

    def gauges(self) -> dict[str, float]:
        r = self.rendezvous
        return {
            "prefill_waiting_registrations": r.waiting_registrations,
            "prefill_waiting_prefills": r.waiting_prefills,
            "prefill_held_blocks": r.held_blocks,
            "prefill_writes_in_flight": r.writes_in_flight,
        }

    def next_deadline(self) -> float | None:
        return self.rendezvous.next_deadline()

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
        elif isinstance(item, PeerReady):
            peer = item.peer
            for start in self.peers.ready(peer):
                if peer.error:
                    self._fail_start(start, peer.error)
                else:
                    self._post(start, peer)

    def tick(self) -> None:
        now = time.monotonic()
        for moving, error in self.ended():
            self._finish(moving, error, now)
        self.act(self.rendezvous.expire(now))

    def act(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, StartWrite):
                self._start(action)
            elif isinstance(action, ReleaseBlocks):
                self.worker.results.sent(action.local.request_id)
            elif isinstance(action, NotifyFailure):
                reg = action.registration
                self.worker.results.count("failures", "write_not_done")
                self.peers.notify(reg.host, reg.port, action.message)
            elif isinstance(action, DropRegistration):
                log.info(
                    "dropped registration %s: %s", action.registration.transfer_id, action.reason
                )

    def _start(self, start: StartWrite) -> None:
        reg = start.registration
        peer = self.peers.get(reg.host, reg.port)
        if peer.error:
            self._fail_start(start, peer.error)
        elif self.peers.when_ready(peer, start):
            self._post(start, peer)

    def _post(self, start: StartWrite, peer: Peer[StartWrite]) -> None:
        reg, local = start.registration, start.local
        try:
            self.post(
                start,
                "WRITE",
                peer,
                local.block_ids,
                reg.block_ids,
                reg.num_tokens,
                local.num_tokens,
            )
        except (PlanError, TransferError) as exc:
            self._fail_start(start, f"cannot write KV: {exc}")
            return
        now = time.monotonic()
        registered = self.registered_at.pop((reg.transfer_id, reg.generation), now)
        self.worker.results.observe(reg_to_write_s=max(0.0, now - registered))

    def _fail_start(self, start: StartWrite, error: str) -> None:
        reg = start.registration
        self.worker.results.count("failures", "write_failed")
        log.warning("transfer %s to %s failed: %s", reg.transfer_id, reg.engine_id, error)
        self.act(
            self.rendezvous.write_finished(
                reg.transfer_id, reg.generation, False, error, time.monotonic()
            )
        )

    def _finish(self, moving: Moving[StartWrite], error: str, now: float) -> None:
        start, peer = moving.job, moving.peer
        reg = start.registration
        if error:
            self._fail_start(start, error)
            return
        self.worker.results.observe(write_s=now - moving.posted, bytes=float(moving.nbytes))
        ident = self.worker.identity
        done = WriteDone(reg.transfer_id, reg.generation, ident.tp_rank, ident.tp_size, True, "")
        try:
            peer.client.send(done)
        except (ConnectionError, OSError) as exc:
            self._fail_start(start, f"decode unreachable after the WRITE: {exc}")
            return
        self.act(self.rendezvous.write_finished(reg.transfer_id, reg.generation, True, "", now))
