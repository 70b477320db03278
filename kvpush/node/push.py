"""Prefill, push mode: pair registrations with finished prefills and WRITE into decode.

Failure rules kept here (the pairing rules are `core.rendezvous`'s):
- a WRITE is never posted after its registration's deadline (decode stops waiting then),
  even when the writer was held up (a slow handshake, a frozen process);
- a WRITE still in flight after `transfer_timeout_s` is cancelled and fails;
- decode is told of a WRITE still in flight after `TELL_AFTER_S` (`Writing`): over TCP it
  completes only while decode calls into NIXL, which decode does only when told;
- decode hears of every write that will not happen (`NotifyFailure`), and of a cancel it
  asked for only once no WRITE of that transfer can land in its blocks any more;
- a transfer this rank writes to several decode ranks (`core.fanout`) is paired, written
  and cancelled per decode rank, and its blocks are released once, when the last is done;
  messages to decode name the transfer, never a leg.

A paired WRITE is posted at once. Holding it on a one-core prefill until the first token
has left (a timer wait after a prefill whose answer is the client's first token) was built
and measured twice: ahead one evening, behind the next (docs/benchmarks.md, "The wait
built into the product, measured again").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvpush.core.fanout import Fanout, leg_id, split_leg
from kvpush.core.planning import PlanError, blocks_from, destinations
from kvpush.core.protocol import Cancel, Hello, LeaseRenew, Registration, WriteDone, Writing
from kvpush.core.rendezvous import (
    DropRegistration,
    LocalBlocks,
    NotifyFailure,
    ReleaseBlocks,
    Rendezvous,
    StartWrite,
)
from kvpush.dataplane.control import ControlClient
from kvpush.dataplane.transport import TransferError
from kvpush.node.context import Context
from kvpush.node.inbox import ConnectionClosed, Registered
from kvpush.node.peers import Moving, PeerLoop, PeerReady, RemoteRank
from kvpush.node.specs import AbortSpec, SendSpec

log = logging.getLogger("kvpush.worker")

# A WRITE still in flight this long after it was posted is told to decode (`Writing`), so
# decode progresses its NIXL agent, which UCX's TCP transport needs to take the bytes in.
# With shared memory or RDMA a small WRITE has finished by then and decode hears nothing.
TELL_AFTER_S = 200e-6
# A post refused as decode's disconnection is tried again this much later, once the news of
# a decode that died (its control connection closing) has had time to arrive first.
REPOST_AFTER_S = 0.05


class PushWriter(PeerLoop[StartWrite]):
    """Prefill: pair registrations with finished prefills and WRITE into decode."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "kvpush-push-writer", "decode")
        ident = ctx.identity
        self.rendezvous = Rendezvous(
            ident.tp_rank,
            ident.tp_size,
            lease_s=ctx.config.lease_s,
            max_wait_s=ctx.config.prefill_timeout_s,
            pp_rank=ident.pp_rank,
        )
        self.registered_at: dict[tuple[str, int], float] = {}
        # request id -> when vLLM finished its prefill, until its blocks are released
        self.finished_at: dict[str, float] = {}
        # transfer id -> (connection, generation) of its newest registration, to void what
        # a connection registered when it closes (its decode exited or restarted)
        self._sources: dict[str, tuple[int, int]] = {}
        self._held: set[str] = set()  # test hook hold_prefill: transfers already held
        self.fanout = Fanout()
        # fanned-out transfer -> when its fan opened, to forget fans whose prefill never came
        self._fan_opened: dict[str, float] = {}
        self._counted = dict.fromkeys(_FAILURE_STATS, 0)

    def gauges(self) -> dict[str, float]:
        r = self.rendezvous
        return {
            "prefill_waiting_registrations": r.waiting_registrations,
            "prefill_waiting_prefills": r.waiting_prefills,
            "prefill_held_blocks": r.held_blocks,
            "prefill_writes_in_flight": r.writes_in_flight,
            "prefill_tombstones": r.tombstones,
            "prefill_dropped_tombstones": r.stats.dropped_tombstones,
            "prefill_fanned_transfers": len(self.fanout),
        }

    def next_deadline(self) -> float | None:
        return self.rendezvous.next_deadline()

    def handle(self, item: object, at: float) -> None:
        now = time.monotonic()
        self.act(self.rendezvous.expire(now))  # nothing past its deadline pairs up
        if isinstance(item, Registered):
            self.peers.adopt(item.hello)
            reg, exact = self._leg(item.registration, now)
            self._note_arrival(reg, at)
            self._sources[reg.transfer_id] = (item.connection, reg.generation)
            self.act(self.rendezvous.register(reg, now, exact))
        elif isinstance(item, ConnectionClosed):
            self._connection_closed(item, now)
        elif isinstance(item, SendSpec):
            hold = self.ctx.config.faults.seconds("hold_prefill", item.transfer_id)
            if hold and item.transfer_id not in self._held:
                self._held.add(item.transfer_id)
                self.later(item, at, hold)
                return
            self._held.discard(item.transfer_id)
            # the copy of the finished prefill that came first (`WorkerSide.queue`)
            self.results.count("handoffs", "direct" if item.direct else "next_step")
            if item.finished_at:  # vLLM's hop: its step that ended the prefill -> here
                self.finished_at[item.request_id] = item.finished_at
                self.results.observe(finish_to_handoff_s=max(0.0, at - item.finished_at))
            local = LocalBlocks(
                item.transfer_id, item.request_id, item.block_ids, item.num_tokens, item.sampled
            )
            if self.fanout.get(local.transfer_id) is not None:
                self._feed(local, now)
            else:
                self.act(
                    self.rendezvous.prefill_done(
                        local.transfer_id,
                        local.request_id,
                        local.block_ids,
                        local.num_tokens,
                        now,
                        sampled=local.sampled,
                    )
                )
        elif isinstance(item, Cancel):
            ack_to = (item.ack_host, item.ack_port) if item.ack_port else None
            for leg in self._cancelled_legs(item.transfer_id, ack_to):
                self.act(self.rendezvous.cancel(leg, item.generation, item.reason, now, ack_to))
        elif isinstance(item, AbortSpec):
            why = "prefill request aborted"
            fan = self.fanout.get(item.transfer_id)
            for leg in self.fanout.legs(item.transfer_id):
                self.act(self.rendezvous.abort_local(leg, item.request_id, why, now))
            if fan is not None and fan.local is None:
                # no prefill will feed the fan: later registrations meet its tombstone
                self._close_unfed(item.transfer_id)
                self.act(self.rendezvous.abort_local(item.transfer_id, item.request_id, why, now))
        elif isinstance(item, LeaseRenew):
            # decode's request waits for its blocks: keep the finished prefill for it
            for leg in self.fanout.legs(item.transfer_id):
                self.rendezvous.renew(leg, now)
        elif isinstance(item, _Announced):
            self._announced(item, now)
        elif isinstance(item, _Repost):
            self._repost(item)
        elif isinstance(item, PeerReady):
            peer = item.peer
            for start in self.peers.ready(peer):
                if peer.error:
                    self._fail_start(start, peer.error, peer.error_kind or "handshake_failed")
                else:
                    self._post(start, peer)

    def tick(self) -> None:
        now = time.monotonic()
        for moving, error in self.ended():
            self._finish(moving, error, now)
        for moving in self.inflight.moving:
            if not moving.told and now - moving.posted >= TELL_AFTER_S:
                moving.told = True
                reg = moving.job.registration
                writing = Writing(split_leg(reg.transfer_id)[0], reg.generation)
                # best effort: a decode that cannot hear it fails or times out the WRITE
                self.peers.tell(moving.peer.client, writing)
        self.act(self.rendezvous.expire(now))
        # a fan whose prefill never came (it ran elsewhere, or never ended): its legs
        # expired long ago; forget it (its prefill, should it end, waits out a lease)
        too_old = now - 2 * (self.ctx.config.prefill_timeout_s + self.ctx.config.lease_s)
        while self._fan_opened:
            transfer_id, opened = next(iter(self._fan_opened.items()))
            if opened > too_old:
                break
            self._close_unfed(transfer_id)

    # Fan-out: one prefill written to several decode ranks

    def _leg(self, reg: Registration, now: float) -> tuple[Registration, bool]:
        """`reg` as the rendezvous pairs it, and whether only by its exact id: under its
        leg when this rank writes the transfer to several decode ranks (decode splits the
        heads finer than prefill). The first such registration opens the fan."""
        transfer_id = reg.transfer_id
        fan = self.fanout.get(transfer_id)
        if fan is None:
            ident = self.ctx.identity
            total = self.ctx.layout.total_heads
            ranks = destinations(ident.tp_rank, ident.tp_size, reg.tp_size, total)
            if len(ranks) < 2 or reg.tp_rank not in ranks or self.rendezvous.is_gone(transfer_id):
                return reg, False  # one destination, or a transfer already ended
            fan = self.fanout.open(transfer_id, tuple(ranks))
            self._fan_opened[transfer_id] = now
            local = self.rendezvous.take_finished(transfer_id)
            if local is not None:
                self._feed(local, now)
        if reg.tp_rank not in fan.ranks:
            return reg, False  # not a destination of ours: it pairs with nothing
        fan.senders[(reg.host, reg.port)] = reg.tp_rank
        return dataclasses.replace(reg, transfer_id=leg_id(transfer_id, reg.tp_rank)), True

    def _feed(self, local: LocalBlocks, now: float) -> None:
        """A fanned-out transfer's prefill finished: each leg gets the blocks."""
        self._fan_opened.pop(local.transfer_id, None)
        for leg in self.fanout.feed(local):
            self.act(
                self.rendezvous.prefill_done(
                    leg.transfer_id, leg.request_id, leg.block_ids, leg.num_tokens, now, True,
                    leg.sampled,
                )
            )

    def _close_unfed(self, transfer_id: str) -> None:
        self._fan_opened.pop(transfer_id, None)
        self.fanout.close_unfed(transfer_id)

    def _cancelled_legs(self, transfer_id: str, ack_to: tuple[str, int] | None) -> list[str]:
        """The legs a decode's Cancel stops: with an acknowledgement asked for, only the
        leg registered from that address (the rank that cancels); without, every leg."""
        legs = self.fanout.legs(transfer_id)
        if ack_to is None or len(legs) == 1:
            return legs
        fan = self.fanout.get(transfer_id)
        assert fan is not None
        rank = fan.senders.get(ack_to)
        return legs if rank is None else [leg_id(transfer_id, rank)]

    def _connection_closed(self, closed: ConnectionClosed, now: float) -> None:
        """Void every registration that came on the closed connection: no WRITE of them
        may land in the blocks of the decode's next incarnation."""
        why = (
            f"decode {closed.hello.engine_id} rank {closed.hello.tp_rank} closed its control "
            "connection (it exited or restarted)"
        )
        for transfer_id, (connection, generation) in list(self._sources.items()):
            if connection == closed.connection:
                del self._sources[transfer_id]
                self.act(self.rendezvous.cancel(transfer_id, generation, why, now))

    def _forget_source(self, reg: Registration) -> None:
        if self._sources.get(reg.transfer_id, (0, -1))[1] == reg.generation:
            del self._sources[reg.transfer_id]

    def _note_arrival(self, reg: Registration, at: float) -> None:
        """Remember when `reg` arrived, for the registration-to-write metric. Arrivals are
        in time order, so the oldest go first: a registration never written (dropped,
        stale, expired) is forgotten once it could no longer be."""
        self.registered_at[(reg.transfer_id, reg.generation)] = at
        too_old = at - 2 * self.ctx.config.prefill_timeout_s
        while (oldest := next(iter(self.registered_at.items()))) and oldest[1] < too_old:
            del self.registered_at[oldest[0]]

    def act(self, actions: list[Any]) -> None:
        if not actions:  # most calls (every step's `expire`): nothing to do or count
            return
        for action in actions:
            if isinstance(action, StartWrite):
                self._start(action)
            elif isinstance(action, ReleaseBlocks):
                self._release(action)
            elif isinstance(action, NotifyFailure):
                message = action.message
                leg = message.transfer_id
                transfer_id, rank = split_leg(leg)
                if rank is not None:  # decode knows the transfer, not our legs
                    error = message.error.replace(leg, _shown(leg))
                    message = dataclasses.replace(message, transfer_id=transfer_id, error=error)
                self.peers.notify(action.host, action.port, message)
            elif isinstance(action, DropRegistration):
                self._forget_source(action.registration)
                log.info(
                    "dropped registration %s: %s",
                    _shown(action.registration.transfer_id),
                    action.reason,
                )
        self._count_failures()

    def _release(self, release: ReleaseBlocks) -> None:
        """Free the blocks - for a fan-out, once its last leg let go of them."""
        local = release.local
        if split_leg(local.transfer_id)[1] is not None:
            shared = self.fanout.released(local.transfer_id)
            if shared is None:
                return  # other legs still write from them
            local = shared
        self.finished_at.pop(local.request_id, None)
        self.results.sent(local.request_id)
        if release.reason != "written":
            reason = release.reason.replace(
                release.local.transfer_id, _shown(release.local.transfer_id)
            )
            log.info("released KV of %s: %s", local.request_id, reason)

    def _count_failures(self) -> None:
        """Export the state machine's failure counters as `failures{kind}` (each failure
        the state machine counts comes with an action)."""
        stats = self.rendezvous.stats
        for name, kind in _FAILURE_STATS.items():
            new = getattr(stats, name) - self._counted[name]
            if new:
                self._counted[name] += new
                self.results.count("failures", kind, new)

    def _start(self, start: StartWrite) -> None:
        reg = start.registration
        peer = self.peers.peers.get((reg.host, reg.port))
        if peer is None or peer.offered is None or peer.offered.agent_name != reg.agent_name:
            why = "decode restarted since it registered (another incarnation answers there)"
            self._fail_start(start, why, "peer_gone")
        elif peer.error:
            self._fail_start(start, peer.error, peer.error_kind or "handshake_failed")
        elif self.peers.when_ready(peer, start):
            self._post(start, peer)

    def _post(self, start: StartWrite, peer: RemoteRank[StartWrite]) -> None:
        reg, local = start.registration, start.local
        if time.monotonic() > start.deadline:
            why = (
                "the registration expired before the WRITE could be posted (a slow handshake "
                "or a busy or frozen prefill); decode no longer expects it"
            )
            self._fail_start(start, why, "registration_expired")
            return
        layout = self.ctx.layout
        try:
            self.post(
                start,
                split_leg(reg.transfer_id)[0],
                "WRITE",
                peer,
                blocks_from(layout, local.block_ids, reg.first_token),
                reg.block_ids,
                reg.num_tokens,
                local.num_tokens,
                reg.first_token,
            )
        except (PlanError, TransferError) as exc:
            # Refused at the post, so nothing was sent: decode cut the connection (to stop
            # a WRITE it had given up, `dataplane/sockets.py`), or it died.
            if _kind(exc) != "peer_gone" or not self._try_again(start, peer, str(exc)):
                self._fail_start(start, f"cannot write KV: {exc}", _kind(exc))
            return
        now = time.monotonic()
        registered = self.registered_at.pop((reg.transfer_id, reg.generation), now)
        finished = self.finished_at.get(local.request_id, now)
        self.results.observe(
            reg_to_write_s=max(0.0, now - registered), finish_to_write_s=max(0.0, now - finished)
        )

    def _try_again(self, start: StartWrite, peer: RemoteRank[StartWrite], error: str) -> bool:
        """After decode's NIXL connection was found gone, post `start` once more a little
        later (`_repost`); False where it was tried again already."""
        if start.again or peer.offered is None:
            return False
        log.info("decode %s: its NIXL connection is gone (%s); trying again", peer, error)
        again = _Repost(dataclasses.replace(start, again=True), peer.offered)
        self.later(again, time.monotonic(), REPOST_AFTER_S)
        return True

    def _repost(self, item: _Repost) -> None:
        """Post a WRITE failed as decode's disconnection once more, on a new connection to
        the same decode process, unless that decode's registration was voided meanwhile
        (its control connection closed: it died) or another incarnation answers there."""
        start, reg = item.start, item.start.registration
        if self._sources.get(reg.transfer_id, (0, -1))[1] != reg.generation:
            why = "decode went away during the WRITE (its control connection closed)"
            self._fail_start(start, why, "peer_gone")
            return
        if (reg.host, reg.port) not in self.peers.peers:
            self.peers.adopt(item.hello)  # the same incarnation, handshaken anew
        self._start(start)

    def _fail_start(self, start: StartWrite, error: str, kind: str = "write_failed") -> None:
        reg = start.registration
        self._forget_source(reg)
        self.results.count("failures", kind)
        log.warning("transfer %s to %s failed: %s", _shown(reg.transfer_id), reg.engine_id, error)
        self.act(
            self.rendezvous.write_finished(
                reg.transfer_id, reg.generation, False, error, time.monotonic()
            )
        )

    def _finish(self, moving: Moving[StartWrite], error: str, now: float) -> None:
        start, peer = moving.job, moving.peer
        reg = start.registration
        if error:
            # Failed in flight on a connection decode had cut (prefill's UCX learns it only
            # then): decode reads nothing more from it, so none of this WRITE lands, and the
            # blocks it named are still this transfer's. Post it again on a new connection.
            if error.startswith("remote_disconnect:") and self._try_again(start, peer, error):
                return
            kind = "write_timeout" if error.startswith("timeout:") else "write_failed"
            self._fail_start(start, error, kind)
            return
        self.results.observe(write_s=now - moving.posted, bytes=float(moving.nbytes))
        self._forget_source(reg)
        ident = self.ctx.identity
        transfer_id = split_leg(reg.transfer_id)[0]
        done = WriteDone(
            transfer_id,
            reg.generation,
            ident.tp_rank,
            ident.tp_size,
            True,
            "",
            start.local.sampled,
            ident.pp_rank,
        )
        # Said at once where the connection is open and has room (a wake of the message
        # pool and one of this thread fewer, on prefill's cores while its first token
        # leaves). Where telling decode may mean reconnecting or waiting: on the message
        # pool, never here, so one slow decode does not hold up every other transfer.
        if peer.client.send_now(done):
            self.act(self.rendezvous.write_finished(reg.transfer_id, reg.generation, True, "", now))
        else:
            self.peers.submit(self._announce, start, peer.client, done)

    def _announce(self, start: StartWrite, client: ControlClient, done: WriteDone) -> None:
        """Message pool: send `done`; the writer thread settles the transfer either way."""
        error = ""
        try:
            client.send(done)
        except (ConnectionError, OSError) as exc:
            error = f"decode unreachable after the WRITE: {exc}"
        self.enqueue(_Announced(start, error))

    def _announced(self, item: _Announced, now: float) -> None:
        if item.error:
            self._fail_start(item.start, item.error, "peer_gone")
            return
        reg = item.start.registration
        self.act(self.rendezvous.write_finished(reg.transfer_id, reg.generation, True, "", now))


@dataclasses.dataclass(frozen=True, slots=True)
class _Repost:
    """Writer thread, later: post `start` again, to the decode that sent `hello`."""

    start: StartWrite
    hello: Hello


@dataclasses.dataclass(frozen=True, slots=True)
class _Announced:
    """Message pool -> writer thread: decode was told a WRITE finished, or could not be."""

    start: StartWrite
    error: str


# Rendezvous counters that are failures, and the `failures{kind}` they are exported as.
_FAILURE_STATS = {
    "expired_registrations": "registration_expired",
    "expired_leases": "lease_expired",
    "refused_registrations": "registration_refused",
    "capped_registrations": "registration_capped",
}


def _kind(exc: Exception) -> str:
    if isinstance(exc, TransferError) and exc.kind == "remote_disconnect":
        return "peer_gone"
    return "write_failed"


def _shown(transfer_id: str) -> str:
    """A transfer or leg id as logs show it: "chat-42" or "chat-42 (decode rank 1)"."""
    base, rank = split_leg(transfer_id)
    return base if rank is None else f"{base} (decode rank {rank})"
