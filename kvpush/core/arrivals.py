"""Decode-side arrival tracking (both modes): one completion per producer rank, fenced.

A pure state machine: inputs are method calls with the current monotonic time `now`
(seconds), outputs are outcomes for the caller to carry out; no thread, socket or clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpush.core.deadlines import Deadlines
from kvpush.core.protocol import Cancel, WriteDone


@dataclass(frozen=True, slots=True)
class Arrived:
    """Every producer rank's KV is in place: the request may run."""

    transfer_id: str
    generation: int


@dataclass(frozen=True, slots=True)
class ArrivalFailed:
    """The KV will not (all) arrive; `kind` names the cause for metrics.

    Producer ranks in `unsettled` may still write into the blocks: the caller asks them to
    stop (a `Cancel`) and reports every rank that answers or is gone with `settle`. The
    blocks may be reused only at the `Released` that follows (maybe in the same list).
    """

    transfer_id: str
    generation: int
    reason: str
    kind: str
    unsettled: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Released:
    """After `ArrivalFailed`: no producer rank can write into the blocks any more (each
    answered or is gone), or, `by_time`, the fence deadline passed without an answer.

    `unsure`: a rank did not end with its KV written (its WRITE failed or was given up, it
    is gone, or it stayed silent). Where a WRITE of it was under way, bytes its kernel
    still held may land later over TCP: the caller cuts those connections first
    (`kvpush.dataplane.sockets`)."""

    transfer_id: str
    generation: int
    reason: str
    by_time: bool
    unsure: bool = False


Outcome = Arrived | ArrivalFailed | Released


@dataclass(eq=False, slots=True)
class _Expected:
    transfer_id: str
    generation: int
    producers: tuple[int, ...]  # the producer ranks that write into these blocks
    deadline: float  # of the transfer; once failed, of the fence
    arrived: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)  # ranks that will not write any more
    unsure: set[int] = field(default_factory=set)  # settled without their KV written
    failed: ArrivalFailed | None = None
    alive: bool = True


@dataclass(slots=True)
class ArrivalStats:
    """Ignored notifications: repeated ranks, older generations, and ones for no transfer
    in progress (e.g. after it completed); and releases that only time allowed."""

    duplicates: int = 0
    stale: int = 0
    unexpected: int = 0
    released_by_time: int = 0


class Arrivals:
    """Decode-side tracking of KV arriving in local blocks, one per pending transfer.

    A transfer arrives when every producer rank's KV is in place for its current
    generation (push: one ok `WriteDone` per rank; pull: one finished READ from each), and
    fails on the first failure, on `fail`, or at its deadline. A failed transfer's blocks
    stay fenced until every producer rank is settled - it reported its write (ok or not),
    acknowledged a cancel, or is gone - because a write still in flight would land in
    blocks vLLM has already given to another request. If a rank stays silent (frozen,
    partitioned), the fence ends `fence_s` after the later of the failure and the
    transfer's deadline: prefill posts no write after its registration's deadline.

    Each expected (transfer, generation) gets exactly one `Arrived` or one `ArrivalFailed`
    followed by one `Released`, unless `forget` or a newer `expect` ends it first.
    """

    def __init__(self, fence_s: float = 5.0) -> None:
        if fence_s < 0:
            raise ValueError(f"fence_s must not be negative, got {fence_s}")
        self.fence_s = fence_s
        self.stats = ArrivalStats()
        self._expected: dict[str, _Expected] = {}
        self._deadlines: Deadlines[_Expected] = Deadlines()

    @property
    def pending(self) -> int:
        """Transfers not released yet (waiting for KV, or fenced after a failure)."""
        return len(self._expected)

    @property
    def fenced(self) -> int:
        """Failed transfers whose blocks wait for their producers to settle."""
        return sum(1 for e in self._expected.values() if e.failed is not None)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def is_waiting(self, transfer_id: str, generation: int) -> bool:
        """True while this generation's KV may still arrive (not failed, not ended)."""
        expected = self._expected.get(transfer_id)
        return (
            expected is not None and expected.generation == generation and expected.failed is None
        )

    def expect(
        self, transfer_id: str, generation: int, producers: int | Iterable[int], deadline: float
    ) -> None:
        """Wait for the producer ranks `producers` (a count n: ranks 0..n-1) to write
        generation `generation` by `deadline`.

        A newer generation replaces the pending one (decode re-allocated its blocks).
        """
        ranks = tuple(range(producers)) if isinstance(producers, int) else tuple(producers)
        if not ranks:
            raise ValueError(f"a transfer needs at least one producer, got {producers}")
        old = self._expected.get(transfer_id)
        if old is not None:
            if generation <= old.generation:
                raise ValueError(
                    f"transfer {transfer_id} already expects generation {old.generation}; "
                    "bump the generation when re-allocating"
                )
            old.alive = False
        expected = _Expected(transfer_id, generation, ranks, deadline)
        self._expected[transfer_id] = expected
        self._deadlines.add(expected)

    def forget(self, transfer_id: str) -> bool:
        """Stop tracking without an outcome."""
        expected = self._expected.pop(transfer_id, None)
        if expected is None:
            return False
        expected.alive = False
        return True

    def on_write_done(self, msg: WriteDone, now: float) -> list[Outcome]:
        """Push: a producer rank's WRITE notification (or its answer to a cancel)."""
        stage = f" of pipeline stage {msg.pp_rank}" if msg.pp_rank else ""
        why = f"prefill rank {msg.tp_rank}/{msg.tp_size}{stage} failed to write KV: {msg.error}"
        return self.on_producer_done(
            msg.transfer_id,
            msg.generation,
            msg.producer_rank,
            msg.ok,
            "" if msg.ok else why,
            now,
            "prefill_failed",
        )

    def on_producer_done(
        self,
        transfer_id: str,
        generation: int,
        rank: int,
        ok: bool,
        why: str,
        now: float,
        kind: str = "prefill_failed",
    ) -> list[Outcome]:
        """Producer rank `rank`'s KV is in place (push: its WRITE; pull: our READ from it),
        or, with ok=False, will not be (`why`). Either way that rank is settled."""
        expected = self._current(transfer_id, generation, exact=True)
        if expected is None or not self._known(expected, rank):
            return []
        if expected.failed is not None:
            return self._settle(expected, rank, sure=ok)
        if rank in expected.arrived:
            self.stats.duplicates += 1
            return []
        expected.settled.add(rank)
        if not ok:
            expected.unsure.add(rank)
        if now > expected.deadline:
            return self._fail(expected, self._late(expected), "transfer_timeout", now)
        if not ok:
            return self._fail(expected, why, kind, now)
        expected.arrived.add(rank)
        if len(expected.arrived) < len(expected.producers):
            return []
        self._end(expected)
        return [Arrived(expected.transfer_id, expected.generation)]

    def on_cancel(self, msg: Cancel, now: float) -> list[Outcome]:
        """Prefill gave up the transfer (which of its ranks is not said: none settles)."""
        expected = self._current(msg.transfer_id, msg.generation, exact=False)
        if expected is None or expected.failed is not None:
            return []
        why = f"prefill cancelled the transfer: {msg.reason}"
        return self._fail(expected, why, "prefill_failed", now)

    def fail(self, transfer_id: str, reason: str, kind: str, now: float) -> list[Outcome]:
        """Decode gives up the transfer (its request ended, its prefill went away)."""
        expected = self._expected.get(transfer_id)
        if expected is None or expected.failed is not None:
            return []
        return self._fail(expected, reason, kind, now)

    def settle(
        self, transfer_id: str, generation: int, rank: int, sure: bool = True
    ) -> list[Outcome]:
        """Producer rank `rank` cannot write this transfer any more: it was never asked to
        (`sure`), or it is gone (not `sure`: a WRITE it posted may still be on its way)."""
        expected = self._current(transfer_id, generation, exact=False)
        if expected is None or not self._known(expected, rank):
            return []
        if expected.failed is None:
            expected.settled.add(rank)
            if not sure:
                expected.unsure.add(rank)
            return []
        return self._settle(expected, rank, sure)

    def expire(self, now: float) -> list[Outcome]:
        outcomes: list[Outcome] = []
        # a transfer that fails here is fenced; with fence_s=0 (or now=inf) that is due too
        while due := self._deadlines.pop_due(now):
            outcomes += self._expire_records(due, now)
        return outcomes

    def _expire_records(self, due: list[_Expected], now: float) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for expected in due:
            if expected.failed is None:
                outcomes += self._fail(expected, self._late(expected), "transfer_timeout", now)
            else:
                self.stats.released_by_time += 1
                self._end(expected)
                failed = expected.failed
                outcomes.append(
                    Released(failed.transfer_id, failed.generation, failed.reason, True, True)
                )
        return outcomes

    def _current(self, transfer_id: str, generation: int, exact: bool) -> _Expected | None:
        expected = self._expected.get(transfer_id)
        if expected is None:
            self.stats.unexpected += 1
            return None
        if generation < expected.generation or (exact and generation != expected.generation):
            self.stats.stale += 1
            return None
        return expected

    def _known(self, expected: _Expected, rank: int) -> bool:
        if rank in expected.producers:
            return True
        self.stats.unexpected += 1
        return False

    def _late(self, expected: _Expected) -> str:
        return (
            f"KV for transfer {expected.transfer_id} did not arrive in time: "
            f"{len(expected.arrived)} of {len(expected.producers)} producer ranks finished; "
            "check the prefill instance's health and the network between the instances (the "
            "deadline is prefill_timeout_s in push mode, transfer_timeout_s in pull)"
        )

    def _fail(self, expected: _Expected, reason: str, kind: str, now: float) -> list[Outcome]:
        unsettled = tuple(r for r in expected.producers if r not in expected.settled)
        failed = ArrivalFailed(expected.transfer_id, expected.generation, reason, kind, unsettled)
        expected.failed = failed
        if not unsettled:
            self._end(expected)
            released = Released(
                failed.transfer_id, failed.generation, reason, False, bool(expected.unsure)
            )
            return [failed, released]
        expected.deadline = max(now, expected.deadline) + self.fence_s
        self._deadlines.add(expected)
        return [failed]

    def _settle(self, expected: _Expected, rank: int, sure: bool) -> list[Outcome]:
        expected.settled.add(rank)
        if not sure:
            expected.unsure.add(rank)
        if len(expected.settled) < len(expected.producers):
            return []
        self._end(expected)
        failed = expected.failed
        assert failed is not None
        unsure = bool(expected.unsure)
        return [Released(failed.transfer_id, failed.generation, failed.reason, False, unsure)]

    def _end(self, expected: _Expected) -> None:
        expected.alive = False
        del self._expected[expected.transfer_id]
