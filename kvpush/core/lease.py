"""Pull-mode leases (prefill side): finished prefills' blocks, held for decode to READ.

A pure state machine like `Rendezvous`: time comes in as `now`, and what to free comes out
as `ReleaseBlocks` actions, each lease released exactly once. The rules it keeps:

- `hold` starts a lease of `lease_s`; `renew` (decode still needs the blocks) extends it to
  `now + lease_s`; `read_done` ends it once every decode rank reading it is done (or at
  the first that gave up), and `expire` when decode stays silent;
- decode fences its own retries with a generation: messages of a generation older than the
  newest one seen for the lease are stale and change nothing;
- `read_done` answers whether the blocks were held without a break up to that moment; only
  then is what decode read valid, because a released block may already hold another
  request's KV. Decode sends `ReadDone` after its READ completed, so an answer of None
  proves the READ saw the right bytes;
- `refuse` ends a transfer decode cannot read (e.g. it runs in the other mode): the lease
  is released now, or at once when its prefill finishes later;
- an ended lease leaves a tombstone for `tombstone_s`, so late messages get a clear answer
  and a refusal that arrived before its prefill finished is still honoured;
- a `read_done` or `renew` may arrive *before* `hold`: vLLM's scheduler keeps a finished
  prefill's blocks from the moment it returns their coordinates, but tells its worker (and
  so this machine) only in the next engine step, while the coordinates race ahead to
  decode. Such a transfer is neither leased nor ended, and the answer is "not yet": decode
  asks again. Only what this machine leased is ever confirmed, so neither a forged id nor a
  grant of an earlier incarnation of this prefill passes for valid. A decode that gives up
  before `hold` is remembered (`_Early`, until `lease_s`, at most `max_early`) so that
  `hold` then releases at once.

Each answer is a `Verdict`: "held" (the blocks were held up to now), "not_yet" (no lease
yet: ask again) or "gone" (the lease ended or never was; the text says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpush.core.deadlines import Deadlines
from kvpush.core.rendezvous import LocalBlocks, ReleaseBlocks

Verdict = Literal["held", "not_yet", "gone"]


@dataclass(eq=False, slots=True)
class _Lease:
    local: LocalBlocks
    deadline: float
    generation: int = -1  # the newest decode generation seen
    done: set[int] = field(default_factory=set)  # decode ranks whose READ finished
    alive: bool = True


@dataclass(eq=False, slots=True)
class _Ended:
    """A tombstone; `refused` leases are released as soon as they are held."""

    transfer_id: str
    reason: str
    refused: bool
    deadline: float
    alive: bool = True


@dataclass(eq=False, slots=True)
class _Early:
    """A decode that gave up on a transfer whose `hold` has not arrived yet."""

    transfer_id: str
    deadline: float
    generation: int
    failed: str
    alive: bool = True


@dataclass(slots=True)
class LeaseStats:
    held: int = 0
    renewed: int = 0
    read: int = 0
    read_failed: int = 0
    expired: int = 0
    refused: int = 0
    stale: int = 0
    not_yet: int = 0
    capped: int = 0  # early give-ups or tombstones dropped at their cap


class Leases:
    """Prefill-side leases of one TP rank, by transfer id.

    `max_early` and `max_tombstones` cap the records of transfers that are not leased:
    past them the oldest are dropped (counted in `stats.capped`), so no message stream can
    grow this machine without bound; leases themselves are bounded by vLLM's blocks.
    """

    def __init__(
        self,
        lease_s: float = 30.0,
        tombstone_s: float = 600.0,
        max_early: int = 4096,
        max_tombstones: int = 65536,
    ) -> None:
        if lease_s <= 0 or tombstone_s < 0 or max_early < 1 or max_tombstones < 1:
            raise ValueError(
                "lease_s must be positive, tombstone_s non-negative, the caps at least 1"
            )
        self.lease_s = lease_s
        self.tombstone_s = tombstone_s
        self.max_early = max_early
        self.max_tombstones = max_tombstones
        self.stats = LeaseStats()
        self._leases: dict[str, _Lease] = {}
        self._held_blocks = 0
        self._ended: dict[str, _Ended] = {}  # oldest first
        self._early: dict[str, _Early] = {}  # oldest first
        self._deadlines: Deadlines[_Lease | _Ended | _Early] = Deadlines()

    @property
    def active(self) -> int:
        return len(self._leases)

    @property
    def held_blocks(self) -> int:
        return self._held_blocks

    def next_deadline(self) -> float | None:
        """When `expire` next has something to do, for the caller's sleep."""
        return self._deadlines.next()

    def hold(self, local: LocalBlocks, now: float) -> list[ReleaseBlocks]:
        """Lease `local` until `now + lease_s`; released at once if decode refused it or
        gave up already."""
        transfer_id = local.transfer_id
        if transfer_id in self._leases:
            raise ValueError(f"transfer {transfer_id} is already leased")
        ended = self._ended.get(transfer_id)
        if ended is not None and ended.refused:
            # the transfer ends now: its tombstone must last tombstone_s from here, or a
            # late renewal would find no record and be told "not yet" instead of "gone"
            self._forget(transfer_id)
            self._bury(transfer_id, ended.reason, refused=True, now=now)
            return [ReleaseBlocks(local, ended.reason)]
        if ended is not None:
            self._forget(transfer_id)
        self.stats.held += 1
        lease = _Lease(local, now + self.lease_s)
        self._leases[transfer_id] = lease
        self._held_blocks += len(local.block_ids)
        self._deadlines.add(lease)
        early = self._early.pop(transfer_id, None)
        if early is None:
            return []
        early.alive = False
        lease.generation = early.generation
        return [self._end(lease, f"decode gave up reading: {early.failed}", now)]

    def renew(self, transfer_id: str, generation: int, now: float) -> tuple[Verdict, str]:
        """Extend the lease to `now + lease_s`; the verdict, and why when not "held"."""
        lease, verdict, problem = self._current(transfer_id, generation)
        if lease is None:
            return verdict, problem
        self.stats.renewed += 1
        lease.generation = generation
        if now + self.lease_s != lease.deadline:  # one heap entry per deadline
            lease.deadline = now + self.lease_s
            self._deadlines.add(lease)
        return "held", ""

    def read_done(
        self,
        transfer_id: str,
        generation: int,
        reader: int,
        readers: int,
        ok: bool,
        error: str,
        now: float,
    ) -> tuple[Verdict, str, list[ReleaseBlocks]]:
        """Decode rank `reader`, one of `readers` reading this lease, finished (`ok`) or
        gave up; the lease ends when all have finished, or at once when one gave up.

        The verdict is "held" when the blocks were held up to now, i.e. what decode read
        is valid; "not_yet" when no lease exists yet (ask again); else "gone" and why.
        """
        lease, verdict, problem = self._current(transfer_id, generation)
        if lease is None:
            if verdict == "not_yet" and not ok:
                self._remember_give_up(transfer_id, generation, error, now)
            return verdict, problem, []
        if generation > lease.generation:  # decode re-allocated: its ranks read again
            lease.generation = generation
            lease.done.clear()
        if ok:
            lease.done.add(reader)
            if len(lease.done) < readers:
                return "held", "", []
            self.stats.read += 1
            why = "read by decode"
        else:
            self.stats.read_failed += 1
            why = f"decode gave up reading: {error}"
        return "held", "", [self._end(lease, why, now)]

    def refuse(self, transfer_id: str, reason: str, now: float) -> list[ReleaseBlocks]:
        """Decode cannot read this transfer: release it now, or when it is held."""
        self.stats.refused += 1
        lease = self._leases.get(transfer_id)
        if lease is not None:
            return [self._end(lease, reason, now)]
        if transfer_id in self._ended:
            self._forget(transfer_id)
        self._bury(transfer_id, reason, refused=True, now=now)
        return []

    def expire(self, now: float) -> list[ReleaseBlocks]:
        """Release every lease whose deadline is at or before `now`; drop old tombstones."""
        actions: list[ReleaseBlocks] = []
        for record in self._deadlines.pop_due(now):
            if isinstance(record, _Early):
                del self._early[record.transfer_id]
            elif isinstance(record, _Lease):
                self.stats.expired += 1
                local = record.local
                why = (
                    f"no READ of transfer {local.transfer_id} finished within the "
                    f"{self.lease_s:g} s lease; check that the router sent prefill's answer to "
                    "a decode instance and that decode can reach this prefill instance"
                )
                actions.append(self._end(record, why, now))
            else:
                del self._ended[record.transfer_id]
        return actions

    def _remember_give_up(self, transfer_id: str, generation: int, error: str, now: float) -> None:
        early = self._early.get(transfer_id)
        if early is None:
            if len(self._early) >= self.max_early:
                self.stats.capped += 1
                oldest = next(iter(self._early))
                self._early.pop(oldest).alive = False
            early = _Early(transfer_id, now + self.lease_s, generation, error)
            self._early[transfer_id] = early
            self._deadlines.add(early)
        elif generation >= early.generation:
            early.generation, early.failed = generation, error

    def _current(
        self, transfer_id: str, generation: int
    ) -> tuple[_Lease | None, Verdict, str]:
        lease = self._leases.get(transfer_id)
        if lease is None:
            ended = self._ended.get(transfer_id)
            if ended is not None:
                why = f"prefill no longer holds KV for transfer {transfer_id}: {ended.reason}"
                return None, "gone", why
            self.stats.not_yet += 1
            why = f"prefill holds no lease for transfer {transfer_id} yet"
            return None, "not_yet", why
        if generation < lease.generation:
            self.stats.stale += 1
            return None, "gone", (
                f"generation {generation} of transfer {transfer_id} is stale: decode already "
                f"uses generation {lease.generation}"
            )
        return lease, "held", ""

    def _end(self, lease: _Lease, reason: str, now: float) -> ReleaseBlocks:
        lease.alive = False
        del self._leases[lease.local.transfer_id]
        self._held_blocks -= len(lease.local.block_ids)
        self._bury(lease.local.transfer_id, reason, refused=False, now=now)
        return ReleaseBlocks(lease.local, reason)

    def _bury(self, transfer_id: str, reason: str, refused: bool, now: float) -> None:
        if len(self._ended) >= self.max_tombstones:
            self.stats.capped += 1
            self._forget(next(iter(self._ended)))
        ended = _Ended(transfer_id, reason, refused, now + self.tombstone_s)
        self._ended[transfer_id] = ended
        self._deadlines.add(ended)

    def _forget(self, transfer_id: str) -> None:
        self._ended.pop(transfer_id).alive = False
