"""Decode, both modes: get a request's KV into the blocks vLLM just allocated for it.

Push: send prefill a `Registration` at once; each producer rank WRITEs and sends
`WriteDone`. Pull: handshake with each producer rank, READ its blocks, and confirm with a
`ReadDone`, whose answer says whether prefill held the blocks for the whole READ (only then
are the bytes read valid); while waiting, renew the lease every half lease. Either way
`Arrivals` counts one completion per producer rank and enforces the transfer's deadline.

A failed transfer - past its deadline, failed by prefill, its prefill gone, or its request
ended - is reported to vLLM (which then frees or reuses the blocks) only once no producer
can write into them any more: push sends each prefill rank that may still write a `Cancel`
and waits for its acknowledgement, for it to be unreachable, or for the fence deadline;
pull cancels its own READs. Prefill ranks with transfers pending are watched: one whose
control connection closed (it exited or restarted) fails them at once, not at the deadline.

A request still waiting for decode's blocks (`HoldSpec`: decode's KV cache is full, or its
queue long) has nothing to move yet, but prefill holds its finished KV only `lease_s`:
decode renews it every half lease until the request has blocks, ends, or has waited
`prefill_timeout_s`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from kvpush.core import planning
from kvpush.core.arrivals import ArrivalFailed, Arrivals, Arrived, Outcome, Released
from kvpush.core.deadlines import Deadlines
from kvpush.core.planning import PlanError
from kvpush.core.protocol import (
    MAX_TEXT_LEN,
    NO_TOKEN,
    Cancel,
    Hello,
    LeaseRenew,
    Message,
    ProtocolError,
    ReadDone,
    Registration,
    Wait,
    WriteDone,
    Writing,
    grant_ok,
    producer_rank,
)
from kvpush.dataplane.control import ControlClient, Unreachable
from kvpush.dataplane.transport import TransferError
from kvpush.node.context import Context
from kvpush.node.peers import Moving, PeerLoop, PeerReady, RemoteRank
from kvpush.node.sampled import SAMPLED
from kvpush.node.specs import AbortSpec, HoldSpec, RecvSpec

log = logging.getLogger("kvpush.worker")

_ALL_GENERATIONS = 2**62
WATCH_S = 0.5  # how often prefill ranks with transfers pending are checked for liveness
ASK_AGAIN_S = 0.02  # pull: how soon to ask a prefill again that has no lease yet


@dataclass(eq=False, slots=True)
class _Expecting:
    spec: RecvSpec
    started: float
    producers: tuple[int, ...]
    deadline: float = math.inf  # next lease renewal (pull)
    alive: bool = True
    aborted: bool = False  # the request ended: report it received, not failed
    forged: bool = False  # pull: its coordinates failed the grant check; tell prefill nothing
    # Producer rank -> the control connection (`ControlClient.connection`) that carried
    # this transfer to it; the liveness watch judges only that connection.
    connections: dict[int, int] = field(default_factory=dict)
    # push: the producer ranks a registration was handed to (only they can write)
    registered: set[int] = field(default_factory=set)
    # push: a producer said a WRITE of this generation was under way (`Writing`)
    written_to: bool = False


@dataclass(eq=False, slots=True)
class _Holding:
    """A request from prefill that waits for decode's blocks; prefill's KV is renewed."""

    spec: HoldSpec
    until: float  # renewals stop here: `prefill_timeout_s` after it began to wait
    deadline: float  # the next renewal
    alive: bool = True


@dataclass(frozen=True, slots=True)
class _HoldLost:
    """Prefill answered a renewal of `holding`: it no longer holds the KV."""

    holding: _Holding


def _misplaced(spec: RecvSpec, rank: int, hello: Hello | None, fix: str) -> str | None:
    """Why the prefill rank that answered at the engine's port + `rank` is not the one
    decode counts on there (None when it is): a TP or pipeline size other than
    kv_transfer_params say would leave heads or layers that nobody writes."""
    if hello is None:
        return None
    if (hello.tp_size, hello.pp_size) != (spec.prefill_tp, spec.prefill_pp):
        return (
            f"prefill runs TP {hello.tp_size} x {hello.pp_size} pipeline stage(s), but "
            f"kv_transfer_params say TP {spec.prefill_tp} x {spec.prefill_pp}: {fix}"
        )
    if producer_rank(hello.pp_rank, hello.tp_rank, hello.tp_size) != rank:
        return (
            f"it is rank {hello.tp_rank} of stage {hello.pp_rank}, not the rank {rank} its "
            "port stands for: the prefill's control ports are not one block per engine"
        )
    return None


@dataclass(frozen=True, slots=True)
class _ForRank:
    """A transfer's work with one producer (prefill) rank, waiting for the handshake with
    it: its registration (push) or its READ (pull)."""

    spec: RecvSpec
    rank: int


@dataclass(frozen=True, slots=True)
class _Answered:
    """Pull: prefill's answer to `asked`, a ReadDone or a LeaseRenew.

    An empty `problem` means prefill held the blocks: the READ's bytes are valid, or the
    lease was extended; `wait` means prefill has no lease yet and is to be asked again."""

    spec: RecvSpec
    rank: int
    asked: Message
    problem: str
    wait: bool = False

    @property
    def confirms_read(self) -> bool:
        return isinstance(self.asked, ReadDone)


@dataclass(frozen=True, slots=True)
class _AskAgain:
    """Pull: send `msg` to producer rank `rank` again (it answered `Wait`)."""

    spec: RecvSpec
    rank: int
    client: ControlClient
    msg: Message


@dataclass(frozen=True, slots=True)
class _NotSent:
    """Push: a message to producer rank `rank` could not be sent; `gone`: nothing listens
    there, so that rank cannot write any more."""

    spec: RecvSpec
    rank: int
    why: str
    gone: bool


class Receiver(PeerLoop[_ForRank]):
    """Decode: one per worker; push registers and waits, pull reads."""

    def __init__(self, ctx: Context) -> None:
        self.pull = ctx.config.mode == "pull"
        name = "kvpush-pull-reader" if self.pull else "kvpush-push-receiver"
        # push moves no KV from here: its handshakes need no prefill NIXL agent
        # a READ given up unfinished is kept until it ends: its answer still lands
        super().__init__(ctx, name, "prefill", load_agents=self.pull, keep_given_up=True)
        self.arrivals = Arrivals(ctx.config.fence_s)
        # How long a request waits for its KV once decode has blocks: pull READs a prefill
        # that has finished; push waits for prefill's queue and forward too.
        config = ctx.config
        self._wait_s = config.transfer_timeout_s if self.pull else config.prefill_timeout_s
        self.expecting: dict[str, _Expecting] = {}
        self.renewals: Deadlines[_Expecting] = Deadlines()
        # requests without blocks yet, whose prefill KV is renewed meanwhile
        self.holding: dict[str, _Holding] = {}
        self.hold_renewals: Deadlines[_Holding] = Deadlines()
        # push: transfers a prefill rank said it is writing (`Writing`), until they settle
        self.writing: set[str] = set()
        # pull: failed transfers past their fence whose blocks wait for a READ to end
        self.outlived: dict[RecvSpec, _Expecting] = {}
        self._next_watch = 0.0

    def gauges(self) -> dict[str, float]:
        return {
            "decode_waiting_transfers": self.arrivals.pending - self.arrivals.fenced,
            "decode_fenced_transfers": self.arrivals.fenced + len(self.outlived),
            "decode_reads_in_flight": len(self.inflight),
            "decode_requests_without_blocks": len(self.holding),
        }

    def next_deadline(self) -> float | None:
        watch = self._next_watch if self.expecting else None
        due = (
            self.arrivals.next_deadline(),
            self.renewals.next(),
            self.hold_renewals.next(),
            watch,
        )
        return min((d for d in due if d is not None), default=None)

    def handle(self, item: object, at: float) -> None:
        now = time.monotonic()
        if isinstance(item, RecvSpec):
            self._expect(item, now)
        elif isinstance(item, HoldSpec):
            self._hold(item, now)
        elif isinstance(item, WriteDone):
            first = item.sampled
            if first != NO_TOKEN and self.arrivals.is_waiting(item.transfer_id, item.generation):
                # before the transfer can count as arrived; from a failed WRITE too, for a
                # decode that then computes the prompt itself (kv_load_failure_policy)
                SAMPLED.put(item.transfer_id, first)
            self._outcomes(self.arrivals.on_write_done(item, now))
        elif isinstance(item, Writing):
            expecting = self.expecting.get(item.transfer_id)
            if expecting is not None and expecting.spec.generation == item.generation:
                expecting.written_to = True
            if self.arrivals.is_waiting(item.transfer_id, item.generation):
                self.writing.add(item.transfer_id)
                self.on_target()  # over TCP the WRITE's bytes move only while we progress
        elif isinstance(item, Cancel):
            self._outcomes(self.arrivals.on_cancel(item, now))
        elif isinstance(item, AbortSpec):
            self._abort(item, now)
        elif isinstance(item, _NotSent):
            spec = item.spec
            if item.gone:
                settled = self.arrivals.settle(spec.transfer_id, spec.generation, item.rank, False)
                self._outcomes(settled)
            kind = "peer_gone" if item.gone else "peer_unreachable"
            self._outcomes(self.arrivals.fail(spec.transfer_id, item.why, kind, now))
        elif isinstance(item, PeerReady):
            self._handshook(item.peer)
        elif isinstance(item, _Answered):
            if not self._current(item.spec):
                # failed meanwhile: prefill's KV no longer matters, and a READ kept in
                # flight settles its rank only when it ends, whatever prefill holds
                return
            if item.wait:
                spec = item.spec
                client = self._client(spec.prefill_host, spec.prefill_port + item.rank)
                self.later(_AskAgain(spec, item.rank, client, item.asked), at, ASK_AGAIN_S)
            elif item.problem:
                why = f"prefill rank {item.rank} no longer holds the KV: {item.problem}"
                self._producer_done(item.spec, item.rank, False, why, "lease_lost")
            elif item.confirms_read:
                self._producer_done(item.spec, item.rank, True, "")
        elif isinstance(item, _HoldLost):
            self._unhold(item.holding.spec.transfer_id, item.holding)
        elif isinstance(item, _AskAgain) and self._current(item.spec):
            self.peers.submit(self._ask, item.spec, item.rank, item.client, item.msg)

    def tick(self) -> None:
        now = time.monotonic()
        for moving, error in self.ended():
            self._read_ended(moving, error, now)
        for moving, failure in self.inflight.ended_given_up(now):
            self._given_up_read_ended(moving, failure, now)
        for expecting in self.renewals.pop_due(now):
            self._renew(expecting, now)
        for holding in self.hold_renewals.pop_due(now):
            self._renew_hold(holding, now)
        self._outcomes(self.arrivals.expire(now))
        if now >= self._next_watch:
            self._next_watch = now + WATCH_S
            self._watch(now)

    # Both modes

    def _expect(self, spec: RecvSpec, now: float) -> None:
        self._unhold(spec.transfer_id)
        producers = self._producers(spec.prefill_tp, spec.prefill_pp)
        deadline = now + self._wait_s
        self.arrivals.expect(spec.transfer_id, spec.generation, producers, deadline)
        old = self.expecting.get(spec.transfer_id)
        if old is not None:
            old.alive = False
            self.inflight.let_go(lambda read: read.spec is old.spec)
        expecting = _Expecting(spec, now, producers)
        self.expecting[spec.transfer_id] = expecting
        if self.pull:
            expecting.deadline = now + self.ctx.config.lease_s / 2
            self.renewals.add(expecting)
        for rank in producers:
            peer = self.peers.get(spec.prefill_host, spec.prefill_port + rank)
            job = _ForRank(spec, rank)
            if self.peers.when_ready(peer, job):
                self._go(job, peer)
        if spec.generation == 0:
            self._release_unread(spec)

    def _release_unread(self, spec: RecvSpec) -> None:
        """Prefill ranks whose heads no decode rank reads (replicas another rank sends) hold
        the request's KV for nobody: tell them to free it now, not at the end of a lease.
        Each such rank hears from one decode rank."""
        why = "no decode rank reads this prefill rank's KV: its heads come from a replica"
        for rank in self._unread(spec.prefill_tp, spec.prefill_pp):
            host, port = spec.prefill_host, spec.prefill_port + rank
            if self.pull:  # with no readers, prefill takes a ReadDone as "free it"
                done = self._read_done(spec, False, why)
                self.peers.submit(_request, self._client(host, port), done)
            else:
                self.peers.notify(host, port, Cancel(spec.transfer_id, _ALL_GENERATIONS, why))

    def _go(self, job: _ForRank, peer: RemoteRank[_ForRank]) -> None:
        """Handshaken with the job's rank: READ (pull), or register (push)."""
        if self.pull:
            self._post_read(job, peer)
        else:
            self._register(job, peer)

    def _handshook(self, peer: RemoteRank[_ForRank]) -> None:
        for job in self.peers.ready(peer):
            if not peer.error:
                self._go(job, peer)
                continue
            if not self.pull and peer.error_kind == "incompatible_peer" and peer.connection:
                # a pull-mode prefill takes the registration as the sign to free its KV
                self._register(job, peer)
            self._read_failed(job, peer.error, peer.error_kind or "handshake_failed")

    def _producers(self, prefill_tp: int, prefill_pp: int = 1) -> tuple[int, ...]:
        """The prefill ranks that send this rank its KV heads, on every pipeline stage
        (`producer_rank`: the engine's first control port + this is the rank's)."""
        ident = self.ctx.identity
        total = self.ctx.layout.total_heads
        heads = sorted(planning.sources(ident.tp_rank, ident.tp_size, prefill_tp, total))
        return tuple(producer_rank(p, r, prefill_tp) for p in range(prefill_pp) for r in heads)

    def _unread(self, prefill_tp: int, prefill_pp: int = 1) -> list[int]:
        """The prefill ranks nobody reads (`planning.unread`) that this rank tells to free
        their KV: one decode rank each, on every pipeline stage."""
        ident = self.ctx.identity
        unread = planning.unread(prefill_tp, ident.tp_size, self.ctx.layout.total_heads)
        mine = [rank for rank in unread if rank % ident.tp_size == ident.tp_rank]
        return [producer_rank(p, r, prefill_tp) for p in range(prefill_pp) for r in mine]

    def _holders(self, prefill_tp: int, prefill_pp: int = 1) -> tuple[int, ...]:
        """Every prefill rank that holds KV this rank speaks for: its producers and the
        unread ranks it tells to free theirs."""
        return (*self._producers(prefill_tp, prefill_pp), *self._unread(prefill_tp, prefill_pp))

    def _outcomes(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            self.writing.discard(outcome.transfer_id)  # settled, or fenced (progressed)
            expecting = self.expecting.get(outcome.transfer_id)
            if expecting is None or expecting.spec.generation != outcome.generation:
                continue
            if isinstance(outcome, ArrivalFailed):
                self._failed(expecting, outcome)
                continue
            del self.expecting[outcome.transfer_id]
            spec, results = expecting.spec, self.results
            if isinstance(outcome, Released) and outcome.by_time and self._reads_kept(spec):
                self._outlive(expecting)  # renewals go on while its READs may be answered
                continue
            expecting.alive = False
            if isinstance(outcome, Arrived):
                results.received(spec.request_id)
                results.observe(wait_s=time.monotonic() - expecting.started)
                continue
            if outcome.by_time:
                log.warning(
                    "request %s: reusing its blocks after a %g s fence without every prefill "
                    "rank confirming that no WRITE can land (frozen or partitioned?)",
                    spec.request_id,
                    self.ctx.config.fence_s,
                )
                results.count("failures", "fence_timeout")
            under_way = outcome.by_time or expecting.written_to
            if not self.pull and outcome.unsure and under_way:
                self._cut_late_bytes(expecting)
            # vLLM frees (or, on a load failure, fails) the request once reported; its
            # blocks are safe to reuse now.
            if expecting.aborted:
                results.received(spec.request_id)
            else:
                results.not_received(spec.request_id, spec.block_ids)

    def _cut_late_bytes(self, expecting: _Expecting) -> None:
        """Push, before a failed transfer's blocks go back to vLLM when a WRITE into them
        may not have ended (given up unfinished, its prefill gone or silent): cut the NIXL
        connections from that prefill's host. Over TCP the bytes the writer's kernel still
        holds would otherwise land whenever the link lets them, in blocks another request
        owns by then (`dataplane/sockets.py`). Other transfers on those connections fail;
        prefill connects again for the next one."""
        spec = expecting.spec
        ips = {spec.prefill_host}
        for rank in expecting.registered:
            peer = self.peers.peers.get((spec.prefill_host, spec.prefill_port + rank))
            if peer is not None and peer.client.peer_ip:
                ips.add(peer.client.peer_ip)
        try:
            self.ctx.transport.cut_connections_from(ips)
        except OSError as exc:
            log.warning(
                "request %s: could not cut the NIXL connections from prefill %s (%s); bytes "
                "of a WRITE given up may still land over TCP",
                spec.request_id,
                spec.prefill_host,
                exc,
            )

    def _failed(self, expecting: _Expecting, failed: ArrivalFailed) -> None:
        """The KV will not arrive: stop every producer that may still write (`Released`
        follows when none can)."""
        spec, results = expecting.spec, self.results
        if not expecting.aborted:
            log.warning("request %s: KV did not arrive: %s", spec.request_id, failed.reason)
            results.count("failures", failed.kind)
            results.count("failures", "receive_failed")
        if self.pull:
            self._stop_reading(expecting, failed)
            return
        cancel = Cancel(
            spec.transfer_id,
            spec.generation,
            failed.reason[:MAX_TEXT_LEN],
            self.ctx.config.host,
            self.ctx.port,
        )
        for rank in failed.unsettled:
            peer = self.peers.peers.get((spec.prefill_host, spec.prefill_port + rank))
            if rank not in expecting.registered:
                # never asked to write, so it cannot; but it may hold KV for us: free it
                self._outcomes(self.arrivals.settle(spec.transfer_id, spec.generation, rank))
                release = Cancel(spec.transfer_id, _ALL_GENERATIONS, failed.reason[:MAX_TEXT_LEN])
                self.peers.notify(spec.prefill_host, spec.prefill_port + rank, release)
            elif peer is not None and peer.hello is not None:
                self.peers.submit(self._send, expecting, rank, cancel, peer)

    def _abort(self, item: AbortSpec, now: float) -> None:
        """The request ended while waiting for its KV. vLLM frees its blocks once we report
        it received, so that waits until no transfer can land in them any more."""
        self._unhold(item.transfer_id)
        expecting = self.expecting.get(item.transfer_id)
        if expecting is None:
            if item.prefill_host:
                self._abort_unallocated(item)
            return
        if expecting.aborted:
            return
        expecting.aborted = True
        why = "decode request ended (client gone or request aborted)"
        self._outcomes(self.arrivals.fail(item.transfer_id, why, "aborted", now))

    def _abort_unallocated(self, item: AbortSpec) -> None:
        """The request ended before it got blocks: nothing can land here, but prefill may
        hold KV for it - tell each producer rank to free it now."""
        ident = self.ctx.identity
        why = "decode request ended before it got blocks"
        for rank in self._holders(item.prefill_tp, item.prefill_pp):
            host, port = item.prefill_host, item.prefill_port + rank
            if self.pull:  # prefill answers a ReadDone; the answer changes nothing here
                done = ReadDone(item.transfer_id, 0, ident.tp_rank, ident.tp_size, False, why)
                self.peers.submit(_request, self._client(host, port), done)
            else:
                self.peers.notify(host, port, Cancel(item.transfer_id, _ALL_GENERATIONS, why))

    def _hold(self, spec: HoldSpec, now: float) -> None:
        """The request waits for blocks: renew prefill's KV for it every half lease."""
        if spec.transfer_id in self.expecting:
            return  # it has blocks already
        self._unhold(spec.transfer_id)
        config = self.ctx.config
        holding = _Holding(spec, now + config.prefill_timeout_s, now + config.lease_s / 2)
        self.holding[spec.transfer_id] = holding
        self.hold_renewals.add(holding)

    def _unhold(self, transfer_id: str, holding: _Holding | None = None) -> None:
        """Stop renewing for `transfer_id` (only if it is still `holding`, when given)."""
        current = self.holding.get(transfer_id)
        if current is not None and (holding is None or current is holding):
            current.alive = False
            del self.holding[transfer_id]

    def _renew_hold(self, holding: _Holding, now: float) -> None:
        spec, config = holding.spec, self.ctx.config
        if now >= holding.until:
            self._unhold(spec.transfer_id, holding)
            log.warning(
                "request %s has waited %g s for decode's KV blocks (prefill_timeout_s): prefill "
                "is no longer asked to keep its KV; decode's KV cache is too small for its load",
                spec.request_id,
                config.prefill_timeout_s,
            )
            return
        renew = LeaseRenew(spec.transfer_id, 0)  # the generation its first blocks will have
        for rank in self._holders(spec.prefill_tp, spec.prefill_pp):
            client = self._client(spec.prefill_host, spec.prefill_port + rank)
            self.peers.submit(self._ask_hold, holding, client, renew)
        holding.deadline = now + config.lease_s / 2
        self.hold_renewals.add(holding)

    def _ask_hold(self, holding: _Holding, client: ControlClient, renew: LeaseRenew) -> None:
        """Pool thread: renew prefill's KV for a request without blocks; a prefill that no
        longer holds it ends the renewals (the request fails once it has blocks)."""
        try:
            reply = client.request(renew)
        except (ConnectionError, TimeoutError, OSError, ProtocolError) as exc:
            log.warning("no answer from %s to a lease renewal: %s", client.address, exc)
            return
        if isinstance(reply, Cancel):
            log.warning(
                "request %s waits for decode's blocks, but prefill %s no longer holds its KV: %s",
                holding.spec.request_id,
                client.address,
                reply.reason,
            )
            self.inbox.put((_HoldLost(holding), time.monotonic()))

    def _watch(self, now: float) -> None:
        """Fail transfers whose prefill rank closed the connection that carried them (a
        connection replaced since was lost too: the prefill that got them may be gone)."""
        closed: dict[tuple[str, int, int], bool] = {}
        for expecting in list(self.expecting.values()):
            spec = expecting.spec
            if not self.arrivals.is_waiting(spec.transfer_id, spec.generation):
                continue
            for rank, connection in list(expecting.connections.items()):
                key = (spec.prefill_host, spec.prefill_port + rank, connection)
                if key not in closed:
                    peer = self.peers.peers.get(key[:2])
                    closed[key] = peer is not None and not peer.client.alive(connection)
                if closed[key]:
                    why = (
                        f"prefill rank {rank} at {key[0]}:{key[1]} closed its control "
                        "connection: it exited or restarted, and its KV for this request is gone"
                    )
                    self._outcomes(self.arrivals.fail(spec.transfer_id, why, "peer_gone", now))
                    break

    def _send(
        self, expecting: _Expecting, rank: int, msg: Message, peer: RemoteRank[_ForRank]
    ) -> None:
        """Pool thread: send a Registration or Cancel to producer rank `rank`, on the
        connection our handshake with it went over (prefill binds them to that Hello)."""
        spec = expecting.spec
        try:
            try:
                peer.client.send(msg, connection=peer.connection)
            except ConnectionError:
                if not isinstance(msg, Cancel):
                    raise
                # The handshake's connection is gone: prefill voided what came on it, but a
                # WRITE in flight may still land. Sent on a new connection the cancel is
                # applied unacknowledged (the fence waits); refused, nothing runs there.
                peer.client.send(msg)
        except (ConnectionError, OSError) as exc:
            gone = isinstance(exc, Unreachable)
            why = f"cannot send {type(msg).__name__} to prefill rank {rank}: {exc}"
            if not gone:
                log.warning("%s", why)
            self.inbox.put((_NotSent(spec, rank, why, gone), time.monotonic()))
            return
        if isinstance(msg, Registration):
            expecting.connections[rank] = peer.connection

    def _client(self, host: str, port: int) -> ControlClient:
        return self.peers.get(host, port).client

    # Push

    def _register(self, job: _ForRank, peer: RemoteRank[_ForRank]) -> None:
        spec = job.spec
        expecting = self.expecting.get(spec.transfer_id)
        if expecting is None or not self._current(spec):
            return  # ended (aborted, failed, timed out) while the handshake ran
        hello = peer.hello
        if spec.remote_engine_id and hello and hello.engine_id != spec.remote_engine_id:
            # prefill's leg names the engine it was sent to, which frees its KV when it is
            # not the one that ran it; registering with another would pair with nothing
            why = (
                f"kv_transfer_params name prefill engine {spec.remote_engine_id}, but {peer} "
                f"is {hello.engine_id}: the proxy's engine=, kv= or dp= for this prefill "
                "do not match the server; nothing was registered"
            )
            if not peer.error:  # else the handshake's failure is the request's
                self._read_failed(job, why, "wrong_engine")
            return
        misplaced = _misplaced(spec, job.rank, hello, "give the proxy the prefill's tp= and pp=")
        if misplaced:
            if not peer.error:
                self._read_failed(job, f"{peer}: {misplaced}; nothing was registered",
                                  "wrong_engine")  # fmt: skip
            return
        ctx = self.ctx
        ident = ctx.identity
        reg = Registration(
            transfer_id=spec.transfer_id,
            request_id=spec.request_id,
            engine_id=ident.engine_id,
            host=ctx.config.host,
            port=ctx.port,
            tp_rank=ident.tp_rank,
            tp_size=ident.tp_size,
            block_ids=spec.block_ids,
            num_tokens=spec.num_tokens,
            generation=spec.generation,
            deadline_ms=int(ctx.config.prefill_timeout_s * 1000),
            first_token=spec.first_token,
            agent_name=ctx.hello.agent_name,
        )
        expecting.registered.add(job.rank)
        # at once where the handshake's connection is open and has room: one wake of the
        # message pool fewer on decode's cores, and prefill has it sooner
        if peer.client.send_now(reg, connection=peer.connection):
            expecting.connections[job.rank] = peer.connection
        else:
            self.peers.submit(self._send, expecting, job.rank, reg, peer)

    # Pull

    def _current(self, spec: RecvSpec) -> bool:
        return self.arrivals.is_waiting(spec.transfer_id, spec.generation)

    def _post_read(self, read: _ForRank, peer: RemoteRank[_ForRank]) -> None:
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
        secret = self.ctx.config.secret
        if secret and not grant_ok(
            secret,
            spec.remote_grant,
            spec.remote_engine_id,
            spec.transfer_id,
            spec.remote_block_ids,
            spec.remote_num_tokens,
            spec.prefill_tp,
            spec.prefill_pp,
        ):
            why = (
                "kv_transfer_params carry no valid grant from prefill: forged or altered on "
                "the way (or prefill has another secret); nothing was read"
            )
            self.expecting[spec.transfer_id].forged = True
            self._read_failed(read, why, "bad_grant")
            return
        assert peer.hello is not None
        outlived = self._outlived_read_from(spec.prefill_host, spec.prefill_port + read.rank)
        if outlived is not None:
            # its link was down past a fence and may still be: a new READ would be kept too,
            # with its blocks, so fail fast until the old one ended (the link is back)
            why = (
                f"prefill {peer} has not answered the READ of request {outlived} since its "
                "fence ran out (the link down?); nothing is read from it until it has"
            )
            self._read_failed(read, why, "peer_unreachable")
            return
        if spec.remote_engine_id and peer.hello.engine_id != spec.remote_engine_id:
            why = (
                f"kv_transfer_params name prefill {spec.remote_engine_id}, but "
                f"{peer} is {peer.hello.engine_id}: coordinates altered on the way; "
                "nothing was read"
            )
            self.expecting[spec.transfer_id].forged = True
            self._read_failed(read, why, "bad_grant")
            return
        misplaced = _misplaced(spec, read.rank, peer.hello, "coordinates altered on the way")
        if misplaced:
            self._read_failed(read, f"{peer}: {misplaced}; nothing was read", "wrong_engine")
            return
        expecting = self.expecting[spec.transfer_id]
        expecting.connections[read.rank] = peer.client.connection
        try:
            self.post(
                read,
                spec.transfer_id,
                "READ",
                peer,
                spec.block_ids,
                planning.blocks_from(peer.hello.layout, spec.remote_block_ids, spec.first_token),
                spec.num_tokens,
                spec.remote_num_tokens,
                spec.first_token,
            )
        except (PlanError, TransferError) as exc:
            self._read_failed(read, f"cannot read KV from prefill {peer}: {exc}")

    def _read_ended(self, moving: Moving[_ForRank], error: str, now: float) -> None:
        read = moving.job
        if moving.given_up:  # timed out, kept in flight: its rank settles when it ends
            if self._current(read.spec):
                why = f"READ from prefill {moving.peer} failed: {error}"
                tid = read.spec.transfer_id
                self._outcomes(self.arrivals.fail(tid, why, "transfer_timeout", now))
            return
        if error:
            self._read_failed(read, f"READ from prefill {moving.peer} failed: {error}")
            return
        self.results.observe(read_s=now - moving.posted, bytes=float(moving.nbytes))
        done = self._read_done(read.spec, True, "")
        self.peers.submit(self._ask, read.spec, read.rank, moving.peer.client, done)

    def _read_failed(self, read: _ForRank, why: str, kind: str = "read_failed") -> None:
        self._producer_done(read.spec, read.rank, False, why, kind)

    def _producer_done(
        self, spec: RecvSpec, rank: int, ok: bool, why: str, kind: str = "read_failed"
    ) -> None:
        self._outcomes(
            self.arrivals.on_producer_done(
                spec.transfer_id, spec.generation, rank, ok, why, time.monotonic(), kind
            )
        )

    def _given_up_read_ended(
        self, moving: Moving[_ForRank], failure: TransferError | None, now: float
    ) -> None:
        """A READ given up unfinished has ended: nothing more of it can land, and its rank
        no longer holds the blocks back."""
        read = moving.job
        log.warning(
            "request %s: %s, given up %.1f s before, ended (%s); its blocks can go back",
            read.spec.request_id,
            moving.transfer.what,
            now - moving.given_up,
            f"failed: {failure}" if failure else "complete",
        )
        self._let_prefill_free(read, "the READ decode gave up has ended")
        spec = read.spec
        self._outcomes(self.arrivals.settle(spec.transfer_id, spec.generation, read.rank))
        expecting = self.outlived.get(spec)
        if expecting is not None and not self._reads_kept(spec):
            # it outlived the fence; now nothing more of it can land
            del self.outlived[spec]
            expecting.alive = False
            if expecting.aborted:
                self.results.received(spec.request_id)
            else:
                self.results.not_received(spec.request_id, spec.block_ids)

    def _reads_kept(self, spec: RecvSpec) -> bool:
        """Whether a READ of `spec` that decode gave up may still land (kept until it ends)."""
        return any(moving.job.spec is spec for moving in self.inflight.given_up)

    def _outlived_read_from(self, host: str, port: int) -> str | None:
        """The request of a READ from the prefill rank at `host:port` that outlived its
        fence and has not ended (None: there is none)."""
        for moving in self.inflight.given_up:
            spec = moving.job.spec
            if (
                spec in self.outlived
                and spec.prefill_host == host
                and spec.prefill_port + moving.job.rank == port
            ):
                return spec.request_id
        return None

    def _outlive(self, expecting: _Expecting) -> None:
        """Pull: the fence ran out while a READ decode gave up has not ended: over TCP its
        answer lands whenever the link lets it, whole, released or not (NIXL cannot recall
        it). The blocks stay out of vLLM's hands until it ends (`_given_up_read_ended`),
        however long that is: a request that waits is better than another request's KV
        overwritten. Its prefill rank is renewed meanwhile, so that it keeps the KV the
        READ reads and answers it once the link is back; no new READ goes to that rank
        until then (`_post_read`), so an outage holds only the blocks of the READs under
        way when it began."""
        spec = expecting.spec
        self.outlived[spec] = expecting
        self.results.count("failures", "read_outlived_fence")
        ports = sorted(
            spec.prefill_port + m.job.rank for m in self.inflight.given_up if m.job.spec is spec
        )
        log.warning(
            "request %s: a READ decode gave up has not ended %g s past the transfer's "
            "deadline (fence_s; the link to prefill %s, port %s, down?); its blocks stay "
            "unused until it ends, as its answer may still land in them",
            spec.request_id,
            self.ctx.config.fence_s,
            spec.prefill_host,
            ", ".join(map(str, ports)),
        )

    def _let_prefill_free(self, read: _ForRank, why: str) -> None:
        """Tell the prefill rank of a READ decode gave up and kept that it may free the KV:
        until then it held its lease and served the READ (over TCP that takes its
        progress, which stops with its last lease)."""
        self._tell_read_done(read.spec, read.rank, self._read_done(read.spec, False, why))

    def _tell_read_done(self, spec: RecvSpec, rank: int, done: ReadDone) -> None:
        peer = self.peers.peers.get((spec.prefill_host, spec.prefill_port + rank))
        if peer is not None and peer.hello is not None:  # never bother a refused peer
            self.peers.submit(self._ask, spec, rank, peer.client, done)

    def _stop_reading(self, expecting: _Expecting, failed: ArrivalFailed) -> None:
        """Give up the transfer's READs still in flight and let prefill free its blocks. A
        READ's answer lands even once released (over TCP whenever the link lets it): one
        that may still move bytes is kept, and its rank holds the blocks until it ended or
        the fence ran out; its prefill rank keeps the KV, and serves the READ, until then."""
        spec = expecting.spec
        stuck = {read.rank for read in self.inflight.cancel(lambda read: read.spec is spec)}
        reason = f"decode gave up: {failed.reason}"
        done = self._read_done(spec, False, reason)
        # forged coordinates may name another request's transfer: leave its lease alone
        for rank in () if expecting.forged else expecting.producers:
            if rank not in stuck:  # else told when its READ ends (`_let_prefill_free`)
                self._tell_read_done(spec, rank, done)
        for rank in failed.unsettled:
            if rank not in stuck:  # a READ kept in flight is fenced until it ends
                self._outcomes(self.arrivals.settle(spec.transfer_id, spec.generation, rank))

    def _read_done(self, spec: RecvSpec, ok: bool, error: str) -> ReadDone:
        ident = self.ctx.identity
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
        ranks: Collection[int] = expecting.producers
        if not self._current(spec):
            # failed: prefill was told to free its KV (`_stop_reading`), but for the ranks
            # whose READ decode keeps: they serve it until it ends
            ranks = {m.job.rank for m in self.inflight.given_up if m.job.spec is spec}
            if not ranks:
                return
        renew = LeaseRenew(spec.transfer_id, spec.generation)
        for rank in ranks:
            client = self._client(spec.prefill_host, spec.prefill_port + rank)
            self.peers.submit(self._ask, spec, rank, client, renew)
        expecting.deadline = now + self.ctx.config.lease_s / 2
        self.renewals.add(expecting)

    def _ask(self, spec: RecvSpec, rank: int, client: ControlClient, msg: Message) -> None:
        """Pool thread: send a ReadDone or LeaseRenew and hand prefill's answer back."""
        wait = False
        try:
            reply = client.request(msg)
        except (ConnectionError, TimeoutError, OSError, ProtocolError) as exc:
            problem = f"no answer from {client.address} to {type(msg).__name__}: {exc}"
        else:
            if isinstance(reply, Cancel):
                problem = reply.reason
            elif isinstance(reply, Wait):
                problem, wait = "", True
            elif type(reply) is type(msg):
                problem = ""
            else:
                problem = f"unexpected answer {type(reply).__name__} from {client.address}"
        if isinstance(msg, ReadDone) and not msg.ok:
            return  # decode already gave up; the answer only matters to prefill
        self.inbox.put((_Answered(spec, rank, msg, problem, wait), time.monotonic()))


def _request(client: ControlClient, msg: Message) -> None:
    """Pool thread: send `msg` and read its answer, which the caller does not need."""
    try:
        client.request(msg)
    except (ConnectionError, TimeoutError, OSError, ProtocolError) as exc:
        log.warning("no answer from %s to %s: %s", client.address, type(msg).__name__, exc)
