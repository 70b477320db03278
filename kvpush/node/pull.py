"""Prefill, pull mode: keep finished prefills' blocks under a lease until decode read them.

Decode initiates everything (see `receiver.py`); this side only answers. The lease state
(`core.lease.Leases`) is shared by two threads under one lock: the control-server thread
answers `ReadDone` and `LeaseRenew` on the spot - the answer tells decode whether the blocks
were still held, i.e. whether what it read is valid - and this thread takes new leases from
the engine loop and ends expired ones.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from kvpush.core.lease import Leases
from kvpush.core.planning import destinations
from kvpush.core.protocol import (
    MAX_TEXT_LEN,
    Cancel,
    LeaseRenew,
    ReadDone,
    Registration,
    Wait,
    WriteDone,
)
from kvpush.core.rendezvous import LocalBlocks, ReleaseBlocks
from kvpush.node.context import Context
from kvpush.node.inbox import Registered
from kvpush.node.peers import PeerLoop
from kvpush.node.specs import SendSpec

log = logging.getLogger("kvpush.worker")


class LeaseKeeper(PeerLoop[None]):
    """Prefill: lease finished prefills' blocks to decode until its READ is done."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "kvpush-pull-leases", "decode")
        self.leases = Leases(ctx.config.lease_s)
        self.lock = threading.Lock()
        # Target progress runs while leases are held, and until then after one expired, or
        # after a decode renewed a lease no longer held: its decode went silent (a link
        # down, say), and may still have a READ of it pending, which it keeps, renewing,
        # until it ends, its blocks unused meanwhile. Served now, the READ ends into those
        # blocks and decode gives them back; left unserved until the next lease woke the
        # progress, it would hold them that long.
        self.serve_until = 0.0
        config = ctx.config
        self._serve_s = config.transfer_timeout_s + config.fence_s

    def gauges(self) -> dict[str, float]:
        with self.lock:
            return {
                "prefill_leases": self.leases.active,
                "prefill_held_blocks": self.leases.held_blocks,
                "prefill_dropped_lease_records": self.leases.stats.capped,
            }

    def next_deadline(self) -> float | None:
        with self.lock:
            return self.leases.next_deadline()

    def handle(self, item: object, at: float) -> None:
        with self.lock:
            self._apply(item, time.monotonic())

    def tick(self) -> None:
        with self.lock:
            expired = self.leases.expire(time.monotonic())
        for release in expired:
            log.warning("lease of transfer %s ended: %s", release.local.transfer_id, release.reason)
        if expired:
            self.serve_until = time.monotonic() + self._serve_s
            self.on_target()
        self._release(expired)

    def answer(self, msg: ReadDone | LeaseRenew) -> ReadDone | LeaseRenew | Cancel | Wait:
        """Control-server thread: apply `msg`; echo it if the blocks were held, `Wait` if
        no lease exists yet (decode asks again), else a `Cancel` saying why."""
        ident = self.ctx.identity
        now = time.monotonic()
        with self.lock:
            self._absorb(now)
            if isinstance(msg, ReadDone):
                total = self.ctx.layout.total_heads
                readers = len(destinations(ident.tp_rank, ident.tp_size, msg.tp_size, total))
                if readers == 0:
                    # no decode rank reads our replica heads: free the KV (now or when held)
                    why = f"no decode rank reads it: {msg.error or 'replica heads'}"
                    verdict, problem = "held", ""
                    released = self.leases.refuse(msg.transfer_id, why, now)
                else:
                    verdict, problem, released = self.leases.read_done(
                        msg.transfer_id,
                        msg.generation,
                        msg.tp_rank,
                        readers,
                        msg.ok,
                        msg.error,
                        now,
                    )
            else:
                verdict, problem = self.leases.renew(msg.transfer_id, msg.generation, now)
                released = []
        self._release(released)
        if verdict == "held":
            return msg
        if verdict == "not_yet":
            return Wait(msg.transfer_id, msg.generation)
        log.warning("%s from decode refused: %s", type(msg).__name__, problem)
        if isinstance(msg, LeaseRenew):  # decode may keep a READ of it: answer that READ
            self.serve_until = max(self.serve_until, now + self._serve_s)
            self.on_target()
        return Cancel(msg.transfer_id, msg.generation, problem[:MAX_TEXT_LEN])

    def _absorb(self, now: float) -> None:
        """Apply what the engine loop queued, so a lease granted a moment ago is known."""
        while True:
            try:
                item, _ = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:  # stop() is waiting for the thread: leave its wake-up
                self.inbox.put((None, 0.0))
                return
            self._apply(item, now)

    def _apply(self, item: object, now: float) -> None:
        if isinstance(item, SendSpec):
            local = LocalBlocks(item.transfer_id, item.request_id, item.block_ids, item.num_tokens)
            self._release(self.leases.hold(local, now))
            self.on_target()  # decode's READ of these blocks over TCP needs our progress
        elif isinstance(item, Registered):
            self._refuse(item.registration, now)

    def _refuse(self, reg: Registration, now: float) -> None:
        """A push-mode decode registered blocks: refuse clearly, and free ours at once (its
        address is the one its Hello on the same connection gave)."""
        ident = self.ctx.identity
        why = (
            f"mode mismatch: decode {reg.engine_id} ({reg.host}:{reg.port}) runs kvpush in push "
            f"mode (it sent a Registration), prefill {ident.engine_id} in pull mode; set the "
            "same kv_connector_extra_config.mode on prefill and decode, and the same proxy --mode"
        )
        log.error("refusing transfer %s: %s", reg.transfer_id, why)  # counted at handshake
        self._release(self.leases.refuse(reg.transfer_id, why, now))
        refusal = WriteDone(
            reg.transfer_id, reg.generation, ident.tp_rank, ident.tp_size, False, why,
            pp_rank=ident.pp_rank,
        )
        self.peers.notify(reg.host, reg.port, refusal)

    def _release(self, actions: list[ReleaseBlocks]) -> None:
        for action in actions:
            self.results.sent(action.local.request_id)
