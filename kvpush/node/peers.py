"""What push and pull share on the worker side: peers, posting KV transfers, polling them.

- `Peers`: remote TP ranks by control address. The first transfer to a rank starts a
  handshake (`Hello` both ways: compatibility check, NIXL agent metadata, per-peer prepared
  block lists) on a small pool, so a slow or broken peer never delays transfers to known
  ones; jobs wait on the peer and come back to the owning thread when it is ready.
- `post_kv`: one WRITE (push, prefill initiates) or READ (pull, decode initiates) of a
  request's blocks, by prepared block index when both sides share a shape, else by the
  descriptors `planning.plan_transfer` computes on each side's own layout.
- `InFlight`: transfers posted and not yet complete, polled with backoff only while there
  are any (NIXL's progress thread is off, see `dataplane/transport.py`); one that takes
  longer than the transfer timeout is cancelled and fails.
- `PeerLoop`: the worker thread that owns both, posts through them and forgets a peer
  that went away (it handshakes again on the next transfer, e.g. after a restart).

A restarted peer keeps its address but has a new NIXL agent; transfers to the old agent
would fail or, worse, address a dead process. Its control connection tells: the one the
handshake went over closed when the process exited, so a peer whose handshake connection
is gone is forgotten before the next transfer and handshaken again. A forgotten peer's
NIXL agent is unloaded (`Transport.remove_peer`: at once, or when its last transfer in
flight is released), so agents do not pile up across restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import numpy as np

from kvpush.core import planning
from kvpush.core.planning import KVLayout
from kvpush.core.protocol import Hello, Message, check_compatible
from kvpush.dataplane import threads
from kvpush.dataplane.control import ControlClient, Unreachable
from kvpush.dataplane.transport import TransferError
from kvpush.node.context import Context, Transfer
from kvpush.node.layout import block_pieces, piece_indices
from kvpush.node.loop import Loop

log = logging.getLogger("kvpush.worker")

J = TypeVar("J")
Op = Literal["WRITE", "READ"]
_FIRST_POLL_S = 20e-6
_MAX_POLL_S = 1e-3
# Only transfers given up left (kept until they end, maybe for as long as a link is down):
# polled less often, which is also how often the owner's NIXL agent progresses for them.
_GIVEN_UP_POLL_S = 0.05
HELLO_TIMEOUT_S = 10.0  # one try at a handshake (see Peers._ask_hello for the retries)


@dataclass(slots=True)
class RemoteRank(Generic[J]):
    """One remote TP rank: its control connection and, once handshaken, its NIXL agent."""

    host: str
    port: int
    client: ControlClient
    # push prefill: the Hello the peer sent on its own connection to us, taken as its
    # handshake (we never dial an address a message names to learn a peer)
    offered: Hello | None = None
    # its Hello once handshaken, the layout cut to the layers both sides hold
    # (`planning.align`: a pipeline stage holds some), and our own layout cut alike
    hello: Hello | None = None
    layout: KVLayout | None = None
    connection: int = 0  # the client's connection the handshake went over
    agent: str = ""
    error: str = ""
    error_kind: str = ""
    same_shape: bool = False
    waiting: list[J] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class PeerReady:
    """Inbox item: a handshake ended (see `Peer.error`)."""

    peer: RemoteRank[Any]


class Peers(Generic[J]):
    """The peers of one worker thread; handshakes run on a pool and report to `inbox`.

    Messages that may block on a peer (notifications, lease questions) run on a second
    pool, so a handshake stuck on an unresponsive peer never holds them up.
    """

    def __init__(
        self,
        ctx: Context,
        inbox: queue.SimpleQueue[tuple[object, float]],
        peer_role: str,
        load_agents: bool = True,
        max_peers: int = 1024,
    ) -> None:
        self.ctx = ctx
        # more remote ranks than this and the oldest is forgotten (handshaken again if
        # it comes back): no stream of peer addresses grows a worker without bound
        self.max_peers = max_peers
        self.inbox = inbox
        self.peer_role = peer_role
        # whether handshakes load the peer's NIXL agent (not where we never move KV)
        self.load_agents = load_agents
        self.peers: dict[tuple[str, int], RemoteRank[J]] = {}
        self.handshakes = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvpush-handshake", initializer=threads.background
        )
        self.messages = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="kvpush-message", initializer=threads.background
        )

    def get(self, host: str, port: int) -> RemoteRank[J]:
        """The peer at host:port; a fresh one (handshake pending) if it restarted."""
        key = (host, port)
        peer = self.peers.get(key)
        if peer is not None and peer.offered is not None:
            return peer  # it handshook with us; a restart brings a new Hello (`adopt`)
        if peer is not None and peer.hello is not None and not peer.client.alive(peer.connection):
            log.warning(
                "%s %s: the control connection of our handshake is gone (it exited or "
                "restarted); the next transfer handshakes again",
                self.peer_role,
                peer,
            )
            peer.client.close()
            self._unload(peer)
            peer = None
        if peer is None:
            self._make_room()
            peer = self.peers[key] = RemoteRank(host, port, self.ctx.control_client(host, port))
        return peer

    def _make_room(self) -> None:
        if len(self.peers) >= self.max_peers:
            key = next(iter(self.peers))
            log.info("%s %s: forgotten, %d peers known", self.peer_role, self.peers[key],
                     len(self.peers))  # fmt: skip
            forgotten = self.peers.pop(key)
            forgotten.client.close()
            self._unload(forgotten)

    def adopt(self, hello: Hello) -> RemoteRank[J]:
        """The peer that sent `hello` on its own connection to us, with that Hello as its
        handshake; a new incarnation (another agent name) replaces the old one."""
        key = (hello.host, hello.port)
        peer = self.peers.get(key)
        known = peer.offered if peer is not None else None
        if peer is not None and (known is None or known.agent_name != hello.agent_name):
            log.info("%s %s: a new incarnation (%s)", self.peer_role, peer, hello.agent_name)
            peer.client.close()
            self._unload(peer)
            peer = None
        if peer is None:
            self._make_room()
            client = self.ctx.control_client(hello.host, hello.port)
            peer = self.peers[key] = RemoteRank(hello.host, hello.port, client, hello)
        return peer

    def when_ready(self, peer: RemoteRank[J], job: J) -> bool:
        """True if `job` can go now; else it waits for the handshake (started on first need)."""
        if peer.hello is not None:
            return True
        peer.waiting.append(job)
        if len(peer.waiting) == 1:
            self.handshakes.submit(self._handshake, peer)
        return False

    def ready(self, peer: RemoteRank[J]) -> list[J]:
        """On the owning thread, for a `PeerReady`: the jobs that waited on `peer`.

        A failed peer is forgotten, so a later job handshakes again (it may have restarted).
        """
        waiting, peer.waiting = peer.waiting, []
        if peer.error:
            self.peers.pop((peer.host, peer.port), None)
        return waiting

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn` on the message pool: a message exchange that may block on a peer."""
        self.messages.submit(fn, *args)

    def lost(self, peer: RemoteRank[J], error: TransferError) -> None:
        """After `error` on a transfer with `peer`: a peer that went away is forgotten, so
        the next transfer handshakes again (it may have restarted, with a new NIXL agent)."""
        key = (peer.host, peer.port)
        if error.kind == "remote_disconnect" and self.peers.get(key) is peer:
            log.warning("%s %s went away; the next transfer handshakes again", self.peer_role, peer)
            del self.peers[key]
            self._unload(peer)

    def _unload(self, peer: RemoteRank[J]) -> None:
        """Unload a forgotten peer's NIXL agent (deferred by the transport while transfers
        to it are in flight)."""
        if peer.agent:
            self.ctx.transport.remove_peer(peer.agent)
            peer.agent = ""

    def notify(self, host: str, port: int, msg: Message) -> None:
        """Send `msg` from the message pool; a peer that cannot be reached is only logged."""
        self.tell(self.get(host, port).client, msg)

    def tell(self, client: ControlClient, msg: Message) -> None:
        """`notify` on a client already at hand."""
        self.messages.submit(self._send, client, msg)

    def close(self) -> None:
        for pool in (self.handshakes, self.messages):
            pool.shutdown(wait=False, cancel_futures=True)
        for peer in self.peers.values():
            peer.client.close()

    @staticmethod
    def _send(client: ControlClient, msg: Message) -> None:
        try:
            client.send(msg)
        except (ConnectionError, OSError) as exc:
            log.warning("could not send %s to %s: %s", type(msg).__name__, client.address, exc)

    def _ask_hello(self, peer: RemoteRank[J]) -> Message:
        """The peer's Hello. A peer that is slow to answer (its control thread starved of
        CPU, a busy host) is asked again until the transfer timeout has passed since the
        first try: the transfers waiting on it have that long anyway. A peer that refuses
        the connection, or answers wrong, fails at once."""
        started = time.monotonic()
        budget = self.ctx.config.transfer_timeout_s
        while True:
            try:
                return peer.client.request(self.ctx.hello, timeout=HELLO_TIMEOUT_S)
            except (TimeoutError, ConnectionError) as exc:
                slow = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
                left = budget - (time.monotonic() - started)
                if isinstance(exc, Unreachable) or not slow or left < 1.0:
                    raise
                log.warning(
                    "%s %s is slow to answer the handshake (%s); asking again for up to %.0f s",
                    self.peer_role,
                    peer,
                    exc,
                    left,
                )

    def _handshake(self, peer: RemoteRank[J]) -> None:
        """Pool thread: learn the peer's layout and NIXL agent, then hand back."""
        ctx = self.ctx
        loaded = ""
        try:
            remote = peer.offered or self._ask_hello(peer)
            peer.connection = peer.client.connection
            if not isinstance(remote, Hello):
                raise ConnectionError(f"expected a Hello, got {type(remote).__name__}")
            problem = check_compatible(ctx.hello, remote)
            if problem:
                peer.error_kind = "incompatible_peer"
                raise ConnectionError(f"incompatible peer {remote.engine_id}: {problem}")
            mine, theirs = planning.align(ctx.layout, remote.layout, "local", str(peer))
            if self.load_agents:
                agent = ctx.transport.add_peer(remote.agent_metadata, name=remote.agent_name)
                loaded = agent
                same = same_shape(mine, theirs) and remote.tp_size == ctx.identity.tp_size
                if same:
                    ctx.transport.prepare_peer_blocks(
                        agent, block_pieces(mine), block_pieces(theirs)
                    )
                peer.agent, peer.same_shape = agent, same
            peer.layout = mine
            peer.hello = dataclasses.replace(remote, layout=theirs)
        except Exception as exc:  # any failure here fails this peer's transfers, clearly
            if loaded:
                ctx.transport.remove_peer(loaded)
            peer.error_kind = peer.error_kind or "handshake_failed"
            peer.error = f"handshake with {self.peer_role} {peer} failed: {exc}"
            log.error("%s", peer.error)
        self.inbox.put((PeerReady(peer), time.monotonic()))


@dataclass(frozen=True, slots=True)
class Posted:
    transfer: Transfer
    descriptors: int
    nbytes: int


def post_kv(
    ctx: Context,
    op: Op,
    peer: RemoteRank[Any],
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    num_tokens: int,
    prefill_tokens: int,
    first_token: int = 0,
) -> Posted:
    """Move tokens [first_token, num_tokens) between our blocks and the peer's.

    WRITE copies ours into theirs (push), READ theirs into ours (pull); each block list
    begins with the block holding `first_token` on its side, and `prefill_tokens` is how
    many tokens prefill computed. Raises `PlanError` or `TransferError` with what went
    wrong.
    """
    transport = ctx.transport
    assert peer.hello is not None and peer.layout is not None
    if prefill_tokens < num_tokens:
        raise planning.PlanError(
            f"prefill computed {prefill_tokens} tokens but decode needs {num_tokens}"
        )
    local, remote = peer.layout, peer.hello.layout
    ours = (local, local_blocks, ctx.identity.tp_rank, ctx.identity.tp_size)
    theirs = (remote, remote_blocks, peer.hello.tp_rank, peer.hello.tp_size)
    (src, src_blocks, src_rank, src_tp), (dst, dst_blocks, dst_rank, dst_tp) = (
        (ours, theirs) if op == "WRITE" else (theirs, ours)
    )
    # One copy per KV cache group, each from where its destination keeps real blocks.
    groups = planning.group_ranges(src, src_blocks, dst, dst_blocks, first_token, num_tokens)
    if peer.same_shape:
        # Whole blocks, prepared once per peer: the tail of the last block is this
        # request's own block on both sides, so copying all of it is harmless.
        used: dict[str, list[int]] = {"src": [], "dst": []}
        for start, s, d in groups:
            n = planning.blocks_needed(local, start, num_tokens)
            for key, side, blocks in (("src", _side(op, "src"), s), ("dst", _side(op, "dst"), d)):
                if n > len(blocks):
                    raise planning.PlanError(
                        f"tokens [{start}, {num_tokens}) need {n} blocks; the {side} side "
                        f"has {len(blocks)}"
                    )
                used[key].extend(blocks[:n])
        for key, layout in (("src", src), ("dst", dst)):
            planning.check_block_ids(f"the {_side(op, key)} side's", layout, used[key])
        local_ids, remote_ids = (
            (used["src"], used["dst"]) if op == "WRITE" else (used["dst"], used["src"])
        )
        local_idx = piece_indices(local, local_ids)
        remote_idx = piece_indices(remote, remote_ids)
        chunks = len(local.block_chunks()) * local.sub_blocks
        descriptors = len(planning.merge_runs(local_ids)) * local.num_regions * chunks
        nbytes = len(local_ids) * local.num_regions * local.sub_blocks * local.block_bytes
        post = transport.write_blocks if op == "WRITE" else transport.read_blocks
        return Posted(post(peer.agent, local_idx, remote_idx), descriptors, nbytes)
    plans = [
        planning.plan_transfer(
            src,
            s,
            dst,
            d,
            num_tokens,
            first_token=start,
            src_rank=src_rank,
            src_tp=src_tp,
            dst_rank=dst_rank,
            dst_tp=dst_tp,
            group=group,
        )
        for group, (start, s, d) in enumerate(groups)
    ]
    rows = plans[0].descriptors() if len(plans) == 1 else planning.coalesce(
        np.concatenate([plan.descriptors() for plan in plans])
    )  # fmt: skip
    pieces = rows.astype(np.uint64)
    src_pieces, dst_pieces = pieces[:, [0, 2]], pieces[:, [1, 2]]
    if op == "WRITE":
        transfer = transport.write(peer.agent, src_pieces, dst_pieces)
    else:
        transfer = transport.read(peer.agent, src_pieces, dst_pieces)
    return Posted(transfer, len(pieces), sum(plan.total_bytes for plan in plans))


def _side(op: Op, role: str) -> str:
    """Which side of `op` the source ("src") or destination ("dst") is, as errors name it."""
    ours = (role == "src") == (op == "WRITE")
    return "this" if ours else _other(op)


def _other(op: Op) -> str:
    return "decode" if op == "WRITE" else "prefill"


def same_shape(a: KVLayout, b: KVLayout) -> bool:
    """Both sides cut blocks into the same pieces: prepared block lists pair up by index
    (and every block id names its cells in every region: no region of a pipeline stage
    holds fewer KV cache groups' layers than another)."""
    return (
        a.num_regions == b.num_regions
        and not planning.partial(a)
        and not planning.partial(b)
        and a.block_size == b.block_size
        and a.sub_blocks == b.sub_blocks
        and a.whole_blocks == b.whole_blocks
        and a.num_heads == b.num_heads
        and a.total_heads == b.total_heads
        and a.unit_bytes == b.unit_bytes
        and (a.num_heads == 1 or a.block_size == 1 or a.head_major == b.head_major)
        and [n for _, n in a.block_chunks()] == [n for _, n in b.block_chunks()]
        and states_in_pieces(a)
        and states_in_pieces(b)
    )


def states_in_pieces(layout: KVLayout) -> bool:
    """A state (from a block's first byte) lies inside the pieces a block moves as on the
    prepared path, in every region: true without state groups."""
    if not layout.state_groups:
        return True
    covered = 0
    for start, length in sorted(
        (k * layout.block_stride + offset, length)
        for k in range(layout.sub_blocks)
        for offset, length in layout.block_chunks()
    ):
        if start > covered:
            break
        covered = max(covered, start + length)
    return covered >= layout.state_bytes


@dataclass(slots=True)
class Moving(Generic[J]):
    """A posted transfer and the job it serves."""

    job: J
    transfer: Transfer
    peer: RemoteRank[Any]
    posted: float
    nbytes: int
    hold_until: float = 0.0  # test hook delay_write: seen as in flight until then
    injected: TransferError | None = None  # test hook nixl_error: how it ends
    told: bool = False  # push: decode was told this WRITE is in flight (`Writing`)
    given_up: float = 0.0  # when its owner gave it up unfinished, if it keeps it (`InFlight`)


class PostLater:
    """Test hook delay_post: a transfer that counts as in flight from now but is posted only
    once `due` passed, so none of its bytes can move before then (a link cut meanwhile
    catches it with everything still to send). Its bytes and descriptors go uncounted."""

    __slots__ = ("what", "_due", "_post", "_posted")

    def __init__(self, what: str, due: float, post: Callable[[], Posted]) -> None:
        self.what = what
        self._due = due
        self._post = post
        self._posted: Transfer | None = None

    @classmethod
    def posted(cls, what: str, due: float, post: Callable[[], Posted]) -> Posted:
        return Posted(cls(what, due, post), 0, 0)

    def poll(self) -> bool:
        if self._posted is None:
            if time.monotonic() < self._due:
                return False
            try:
                self._posted = self._post().transfer
            except planning.PlanError as exc:
                raise TransferError("failed", f"{self.what}: {exc}") from exc
        return self._posted.poll()

    @property
    def started(self) -> bool:
        return self._posted is not None

    def release(self) -> bool:
        return self._posted.release() if self._posted is not None else True


def _unstarted(moving: Moving[Any]) -> bool:
    """Not posted yet (test hook delay_post): none of its bytes can move."""
    return isinstance(moving.transfer, PostLater) and not moving.transfer.started


def _poll(moving: Moving[Any], now: float) -> tuple[bool, TransferError | None]:
    """Whether the transfer ended, and how it failed if it did (held by `delay_write`
    until `hold_until`)."""
    try:
        return now >= moving.hold_until and moving.transfer.poll(), None
    except TransferError as exc:
        return True, exc


class InFlight(Generic[J]):
    """Posted transfers, polled from their owner thread with backoff (20 us -> 1 ms).

    With `keep_given_up` (decode's READs), a transfer given up unfinished (timed out or
    cancelled) is not released: releasing does not stop a READ's answer, which over TCP
    lands whenever the link lets it. It stays here, polled, until it ends
    (`ended_given_up`) or its owner lets it go (`let_go`), and its job's blocks stay fenced
    meanwhile."""

    def __init__(self, keep_given_up: bool = False) -> None:
        self.moving: list[Moving[J]] = []
        self.given_up: list[Moving[J]] = []
        self._keep = keep_given_up
        self._sleep = 0.0

    def __len__(self) -> int:
        return len(self.moving) + len(self.given_up)

    def add(
        self,
        job: J,
        posted: Posted,
        peer: RemoteRank[Any],
        now: float,
        hold_s: float = 0.0,
        injected: TransferError | None = None,
    ) -> None:
        moving = Moving(job, posted.transfer, peer, now, posted.nbytes, now + hold_s, injected)
        self.moving.append(moving)
        self._sleep = 0.0

    def wait_time(self) -> float | None:
        """How long the owner may sleep: a little longer each idle round, None when idle."""
        if not self.moving and not self.given_up:
            return None
        most = _MAX_POLL_S if self.moving else _GIVEN_UP_POLL_S
        self._sleep = min(max(self._sleep * 2, _FIRST_POLL_S), most)
        return self._sleep

    def poll(
        self, now: float, timeout: float = math.inf
    ) -> list[tuple[Moving[J], TransferError | None]]:
        """Transfers that ended since the last poll, released, with their error if any.

        One still in flight `timeout` seconds after it was posted is cancelled and ends
        with a "timeout" error; with `keep_given_up` it is kept (`Moving.given_up` set).
        """
        ended: list[tuple[Moving[J], TransferError | None]] = []
        still: list[Moving[J]] = []
        for moving in self.moving:
            done, error = _poll(moving, now)
            timed_out = not done and now - moving.posted > timeout
            if timed_out:
                done, error = (
                    True,
                    TransferError(
                        "timeout",
                        f"{moving.transfer.what} did not complete within {timeout:g} s "
                        "(transfer_timeout_s); "
                        + ("given up, kept until it ends" if self._keep else "cancelled"),
                    ),
                )
            if not done:
                still.append(moving)
                continue
            if timed_out and self._keep_it(moving, now):
                ended.append((moving, error))
                continue
            if not moving.transfer.release():
                log.warning("%s could not be cancelled", moving.transfer.what)
            ended.append((moving, error or moving.injected))
        if ended:
            self._sleep = 0.0
        self.moving = still
        return ended

    def _keep_it(self, moving: Moving[J], now: float) -> bool:
        """Keep a transfer given up unfinished, where this owner does (`keep_given_up`)."""
        if not self._keep or _unstarted(moving):
            return False
        moving.given_up = now
        self.given_up.append(moving)
        return True

    def cancel(self, which: Callable[[J], bool]) -> list[J]:
        """Give up the transfers of jobs `which` selects: release (cancel) them, or, with
        `keep_given_up`, keep those that may still move bytes. Returns the jobs whose
        transfer may still complete: kept, given up before, or that NIXL could not cancel."""
        stuck = [m.job for m in self.given_up if which(m.job)]
        dropped = [m for m in self.moving if which(m.job)]
        if dropped:
            self.moving = [m for m in self.moving if not which(m.job)]
            for moving in dropped:
                if self._keep_it(moving, time.monotonic()):
                    stuck.append(moving.job)
                elif not moving.transfer.release():
                    log.warning("%s could not be cancelled", moving.transfer.what)
                    stuck.append(moving.job)
        return stuck

    def ended_given_up(self, now: float) -> list[tuple[Moving[J], TransferError | None]]:
        """Transfers given up earlier that have ended since (completed or failed), released."""
        ended: list[tuple[Moving[J], TransferError | None]] = []
        still: list[Moving[J]] = []
        for moving in self.given_up:
            done, error = _poll(moving, now)
            if not done:
                still.append(moving)
                continue
            moving.transfer.release()
            ended.append((moving, error))
        self.given_up = still
        return ended

    def let_go(self, which: Callable[[J], bool]) -> list[Moving[J]]:
        """Release the given-up transfers of jobs `which` selects without waiting for their
        end any longer; returns them. Over TCP, a READ's answer may still land after this."""
        gone = [m for m in self.given_up if which(m.job)]
        if gone:
            self.given_up = [m for m in self.given_up if not which(m.job)]
            for moving in gone:
                moving.transfer.release()
        return gone


class PeerLoop(Loop, Generic[J]):
    """A worker thread that talks to peers of `peer_role` and drives the transfers it posts."""

    def __init__(
        self,
        ctx: Context,
        name: str,
        peer_role: str,
        load_agents: bool = True,
        keep_given_up: bool = False,
    ) -> None:
        super().__init__(ctx.results, name)
        self.ctx = ctx
        self.peers: Peers[J] = Peers(ctx, self.inbox, peer_role, load_agents)
        self.inflight: InFlight[J] = InFlight(keep_given_up)

    def stop(self) -> None:
        super().stop()
        self.peers.close()

    def wait_time(self) -> float | None:
        poll = self.inflight.wait_time()
        return poll if poll is not None else super().wait_time()

    def post(
        self,
        job: J,
        transfer_id: str,
        op: Op,
        peer: RemoteRank[J],
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        num_tokens: int,
        prefill_tokens: int,
        first_token: int = 0,
    ) -> None:
        """`post_kv`, then track the transfer for `job` until `ended` reports it."""
        args = (self.ctx, op, peer, local_blocks, remote_blocks, num_tokens, prefill_tokens)
        faults = self.ctx.config.faults
        late = faults.seconds("delay_post", transfer_id) if faults else 0.0
        if late:
            what, now = f"{op} {transfer_id} (test hook delay_post)", time.monotonic()
            later = PostLater.posted(what, now + late, lambda: post_kv(*args, first_token))
            self.inflight.add(job, later, peer, now)
            return
        try:
            posted = post_kv(*args, first_token)
        except TransferError as exc:
            self.peers.lost(peer, exc)
            raise
        self.results.observe(descriptors=float(posted.descriptors))
        injected = None
        if faults.fires("nixl_error", transfer_id):
            what = posted.transfer.what
            injected = TransferError(
                "failed", f"{what}: NIXL reported state ERR (test hook KVPUSH_FAULTS nixl_error)"
            )
        hold = faults.seconds("delay_write", transfer_id) if faults else 0.0
        self.inflight.add(job, posted, peer, time.monotonic(), hold, injected)

    def ended(self) -> list[tuple[Moving[J], str]]:
        """Transfers that ended since the last call, with what failed ("" if nothing)."""
        out: list[tuple[Moving[J], str]] = []
        timeout = self.ctx.config.transfer_timeout_s
        for moving, error in self.inflight.poll(time.monotonic(), timeout):
            if error is not None:
                self.peers.lost(moving.peer, error)
            out.append((moving, f"{error.kind}: {error}" if error else ""))
        return out
