"""Push-mode rendezvous (prefill side): a registration meets a finished prefill.

A pure state machine: inputs are method calls with the current monotonic time `now`
(seconds), outputs are lists of actions for the caller to carry out. No thread, socket or
clock lives here, so every timeout is testable without sleeping. Decode's side is
`kvpush.core.arrivals`.

`Rendezvous` pairs a decode registration with the prefill result of the same transfer,
whichever comes second, and then owns the prefill blocks until they are released exactly
once. The rules it keeps:

- a registration with a newer generation replaces an older one; a generation is written
  at most once and never after a newer one was seen; a newer registration arriving during
  a write waits for it and is written next, from the same blocks;
- every registration that prefill stops serving (deadline, write failure, local abort,
  blocks already gone) produces a `NotifyFailure`, so decode fails fast instead of
  waiting for its own timeout;
- a `cancel` from decode is acknowledged (a `NotifyFailure` to the address it names) once
  no write of that transfer can land in decode's blocks any more: at once when none is in
  flight, else when the one in flight ended. Decode reuses its blocks only after that;
- `StartWrite.deadline` is when the registration stops being valid: the caller must not
  post the write after it (decode stops waiting around then);
- after a transfer ends, a tombstone remembers its exact transfer ids for a while: late
  registrations are refused at once (or ignored if older), and blocks of a prefill that
  decode already gave up on are released as soon as it finishes. Tombstones are never
  matched by base request id: clients reuse request ids, and a stale tombstone must not
  fail a new request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvpush.core.deadlines import Deadlines
from kvpush.core.protocol import MAX_TEXT_LEN, NO_TOKEN, Registration, WriteDone

_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")


def base_request_id(request_id: str) -> str:
    """`request_id` without the random suffix one engine added to the client's id.

    vLLM makes request ids unique per engine by appending "-" and 8 random lowercase hex
    digits (the start of a UUID) to the client's X-Request-Id, so prefill and decode see
    different ids for one client request: "chat-42-1f0c9ab3" and "chat-42-77d0e2c1" are
    both "chat-42". Exactly one such suffix is stripped; an id without one is returned
    unchanged, and so is an id that would become empty.
    """
    match = _ENGINE_SUFFIX.search(request_id)
    if match is None or match.start() == 0:
        return request_id
    return request_id[: match.start()]


@dataclass(frozen=True, slots=True)
class LocalBlocks:
    """A finished prefill's KV, held in these local blocks until released."""

    transfer_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    sampled: int = NO_TOKEN  # the first output token prefill sampled (goes with WriteDone)


@dataclass(frozen=True, slots=True)
class StartWrite:
    """Write `local` into the registration's blocks, unless `deadline` has passed.
    `again`: the writer posts it a second time (its peer's connection had been cut)."""

    registration: Registration
    local: LocalBlocks
    deadline: float = math.inf
    again: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseBlocks:
    local: LocalBlocks
    reason: str


@dataclass(frozen=True, slots=True)
class DropRegistration:
    registration: Registration
    reason: str


@dataclass(frozen=True, slots=True)
class NotifyFailure:
    """Send `message` (a WriteDone with ok=False) to the decode at `host`:`port`: its
    registration will not be written, or (an acknowledgement) it cancelled it."""

    host: str
    port: int
    message: WriteDone


Action = StartWrite | ReleaseBlocks | DropRegistration | NotifyFailure


@dataclass(eq=False, slots=True)
class _Waiting:
    """A registration waiting for its prefill, or (with `behind`) for a write to finish."""

    reg: Registration
    deadline: float
    behind: _Writing | None = None
    alive: bool = True


@dataclass(eq=False, slots=True)
class _Finished:
    """A finished prefill's blocks waiting for a registration, until the lease ends."""

    local: LocalBlocks
    deadline: float
    alive: bool = True
    # renewals (decode's request still waits for blocks) end here: `max_wait_s` after
    # the prefill finished, a lease later
    until: float = math.inf


@dataclass(eq=False, slots=True)
class _Writing:
    """A write in flight; the blocks stay held until `write_finished`."""

    local: LocalBlocks
    reg: Registration
    newest: int  # registrations up to this generation were handled and are now stale
    deadline: float = math.inf  # of the registration being written
    queued: _Waiting | None = None
    acks: list[tuple[str, int, int]] = field(default_factory=list)  # host, port, generation
    aborted: bool = False


@dataclass(eq=False, slots=True)
class _Gone:
    """A tombstone. Registrations up to `generation` are stale; newer ones are refused
    when `kv_released`, else (decode gave up before prefill finished) served normally."""

    generation: int
    kv_released: bool
    reason: str
    deadline: float
    alive: bool = True


R = TypeVar("R", _Waiting, _Finished, _Gone)


class _Index(Generic[R]):
    """Records by exact transfer id and by base request id (see `base_request_id`)."""

    def __init__(self) -> None:
        self._by_id: dict[str, R] = {}
        self._by_base: dict[str, list[R]] = {}
        self._keys: dict[R, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[R]:
        return iter(self._keys)

    def add(self, record: R, ids: Iterable[str], request_ids: Iterable[str]) -> None:
        keys = (tuple(ids), tuple({base_request_id(r) for r in request_ids}))
        self._keys[record] = keys
        for key in keys[0]:
            self._by_id[key] = record
        for base in keys[1]:
            self._by_base.setdefault(base, []).append(record)

    def remove(self, record: R) -> None:
        record.alive = False
        ids, bases = self._keys.pop(record)
        for key in ids:
            if self._by_id.get(key) is record:
                del self._by_id[key]
        for base in bases:
            others = [r for r in self._by_base[base] if r is not record]
            if others:
                self._by_base[base] = others
            else:
                del self._by_base[base]

    def ids_of(self, record: R) -> tuple[str, ...]:
        return self._keys[record][0]

    def exact(self, transfer_id: str) -> R | None:
        return self._by_id.get(transfer_id)

    def candidates(self, request_id: str) -> list[R]:
        return self._by_base.get(base_request_id(request_id), [])


@dataclass(slots=True)
class RendezvousStats:
    """Counters since start (gauges are properties of `Rendezvous`)."""

    registrations: int = 0
    stale_registrations: int = 0
    refused_registrations: int = 0
    expired_registrations: int = 0
    fallback_matches: int = 0
    ambiguous_matches: int = 0
    writes_started: int = 0
    writes_failed: int = 0
    expired_leases: int = 0
    renewed_leases: int = 0
    cancels: int = 0
    capped_registrations: int = 0  # refused: `max_waiting` registrations waited already
    dropped_tombstones: int = 0  # forgotten early: `max_tombstones` were remembered


class Rendezvous:
    """Prefill-side pairing of registrations with finished prefills (one per TP rank).

    Matching uses the exact transfer id first; failing that, the base request id, and only
    when exactly one candidate waits (an ambiguous base id is never guessed; it waits for
    an exact match or its deadline). `lease_s` bounds how long finished blocks wait for a
    registration; `tombstone_s` how long an ended transfer is remembered.

    Nothing a peer sends grows it without bound: a registration's deadline is capped at
    `max_wait_s` (prefill's own `prefill_timeout_s`), at most `max_waiting` registrations
    wait for their prefill (more are refused, saying so), and past `max_tombstones` the
    oldest tombstone is forgotten; both are counted in `stats`.
    """

    def __init__(
        self,
        tp_rank: int = 0,
        tp_size: int = 1,
        lease_s: float = 30.0,
        tombstone_s: float = 60.0,
        max_wait_s: float = math.inf,
        max_waiting: int = 4096,
        max_tombstones: int = 65536,
        pp_rank: int = 0,
    ) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        if max_wait_s <= 0 or max_waiting < 1 or max_tombstones < 1:
            raise ValueError("max_wait_s must be positive and the caps at least 1")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.pp_rank = pp_rank
        self.lease_s = lease_s
        self.tombstone_s = tombstone_s
        self.max_wait_s = max_wait_s
        self.max_waiting = max_waiting
        self.max_tombstones = max_tombstones
        self.stats = RendezvousStats()
        self._waiting: _Index[_Waiting] = _Index()
        self._finished: _Index[_Finished] = _Index()
        self._gone: _Index[_Gone] = _Index()
        self._writing: dict[str, _Writing] = {}  # by the registration's transfer id
        self._writing_local: dict[str, _Writing] = {}  # by the prefill's transfer id
        self._deadlines: Deadlines[_Waiting | _Finished | _Gone] = Deadlines()

    @property
    def waiting_registrations(self) -> int:
        """Registrations whose prefill has not finished yet."""
        return len(self._waiting)

    @property
    def queued_registrations(self) -> int:
        """Newer registrations waiting for an older generation's write to finish."""
        return sum(1 for w in self._writing.values() if w.queued is not None)

    @property
    def waiting_prefills(self) -> int:
        """Finished prefills whose blocks wait for a registration."""
        return len(self._finished)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing)

    @property
    def held_blocks(self) -> int:
        """Local blocks held for transfers (waiting or being written); the legs of a
        fan-out share theirs, counted once."""
        held = {(f.local.request_id, f.local.block_ids) for f in self._finished}
        held.update((w.local.request_id, w.local.block_ids) for w in self._writing.values())
        return sum(len(block_ids) for _, block_ids in held)

    @property
    def tombstones(self) -> int:
        return len(self._gone)

    def next_deadline(self) -> float | None:
        """When `expire` next has something to do, for the caller's sleep."""
        return self._deadlines.next()

    def register(self, reg: Registration, now: float, exact: bool = False) -> list[Action]:
        """A decode registration arrived; `exact`: pair it only by its transfer id (a
        fan-out leg, whose request id other legs share)."""
        self.stats.registrations += 1
        writing = self._writing.get(reg.transfer_id)
        if writing is not None:
            return self._queue_behind(writing, reg, now)
        waiting = self._waiting.exact(reg.transfer_id)
        if waiting is not None:
            if reg.generation <= waiting.reg.generation:
                return self._stale()
            self._waiting.remove(waiting)
            superseded = DropRegistration(waiting.reg, f"superseded by generation {reg.generation}")
            return [superseded, *self._register_new(reg, now)]
        gone = self._gone.exact(reg.transfer_id)
        if gone is not None:
            return self._register_after(gone, reg, now, exact)
        return self._register_new(reg, now, exact)

    def prefill_done(
        self,
        transfer_id: str,
        request_id: str,
        block_ids: tuple[int, ...],
        num_tokens: int,
        now: float,
        exact: bool = False,
        sampled: int = NO_TOKEN,
    ) -> list[Action]:
        """The prefill finished and its KV sits in `block_ids` until released; `exact`:
        pair it only by its transfer id (a fan-out leg); `sampled`: its first output token."""
        if transfer_id in self._writing_local or self._finished.exact(transfer_id):
            raise ValueError(f"prefill of transfer {transfer_id} was reported done twice")
        local = LocalBlocks(transfer_id, request_id, block_ids, num_tokens, sampled)
        waiting = self._waiting.exact(transfer_id)
        gone = None if waiting else self._gone.exact(transfer_id)
        if waiting is None and gone is None and not exact:
            waiting = self._match(self._waiting, request_id)
        if waiting is not None:
            self._waiting.remove(waiting)
            return self._start(local, waiting.reg, waiting.deadline)
        if gone is not None:
            gone.kv_released = True
            return [ReleaseBlocks(local, gone.reason)]
        finished = _Finished(local, now + self.lease_s, until=now + self.max_wait_s + self.lease_s)
        self._finished.add(finished, [transfer_id], [request_id])
        self._deadlines.add(finished)
        return []

    def take_finished(self, transfer_id: str) -> LocalBlocks | None:
        """Hand back a finished prefill that waits for its registration, unreleased (the
        caller fans it out), or None when none waits under exactly this id."""
        finished = self._finished.exact(transfer_id)
        if finished is None:
            return None
        self._finished.remove(finished)
        return finished.local

    def renew(self, transfer_id: str, now: float) -> bool:
        """Decode still wants this transfer's KV but has no blocks for it yet (its request
        waits for room): a finished prefill waiting under exactly this id keeps its blocks
        until `now + lease_s`, at most `max_wait_s` and a lease after it finished. False
        when none waits (not finished yet, or gone)."""
        finished = self._finished.exact(transfer_id)
        if finished is None:
            return False
        self.stats.renewed_leases += 1
        deadline = min(now + self.lease_s, finished.until)
        if deadline > finished.deadline:  # one heap entry per deadline
            finished.deadline = deadline
            self._deadlines.add(finished)
        return True

    def is_gone(self, transfer_id: str) -> bool:
        """Whether a tombstone remembers exactly this transfer id."""
        return self._gone.exact(transfer_id) is not None

    def cancel(
        self,
        transfer_id: str,
        generation: int,
        reason: str,
        now: float,
        ack_to: tuple[str, int] | None = None,
    ) -> list[Action]:
        """Decode abandons generations up to `generation` (a `Cancel` message); with
        `ack_to`, it is told there when no write of them can land any more."""
        self.stats.cancels += 1
        why = f"cancelled by decode: {reason}"
        actions: list[Action] = []
        writing = self._writing.get(transfer_id)
        if writing is not None:
            writing.newest = max(writing.newest, generation)
            if ack_to is not None:
                writing.acks.append((*ack_to, generation))
            queued = writing.queued
            if queued is not None and queued.reg.generation <= generation:
                self._unqueue(writing)
                actions.append(DropRegistration(queued.reg, why))
            return actions
        waiting = self._waiting.exact(transfer_id)
        finished = self._finished.exact(transfer_id)
        gone = self._gone.exact(transfer_id)
        if waiting is not None and waiting.reg.generation <= generation:
            self._waiting.remove(waiting)
            self._bury([transfer_id], generation, False, why, now)
            actions.append(DropRegistration(waiting.reg, why))
        elif finished is not None:
            self._finished.remove(finished)
            self._bury([transfer_id], generation, True, why, now)
            actions.append(ReleaseBlocks(finished.local, why))
        elif gone is not None:
            gone.generation = max(gone.generation, generation)
        elif waiting is None:
            self._bury([transfer_id], generation, False, why, now)
        if ack_to is not None:
            actions.append(self._ack(ack_to, transfer_id, generation))
        return actions

    def abort_local(
        self, transfer_id: str, request_id: str, reason: str, now: float
    ) -> list[Action]:
        """The prefill request ended without (or gave up) its KV; decode must not wait."""
        why = f"prefill request {request_id} ended without KV: {reason}"
        writing = self._writing_local.get(transfer_id)
        if writing is not None:
            writing.aborted = True
            queued = writing.queued
            if queued is None:
                return []
            self._unqueue(writing)
            return self._refuse(queued.reg, why)
        finished = self._finished.exact(transfer_id)
        if finished is not None:
            self._finished.remove(finished)
            self._bury([transfer_id], -1, True, why, now)
            return [ReleaseBlocks(finished.local, why)]
        waiting = self._waiting.exact(transfer_id) or self._match(self._waiting, request_id)
        if waiting is not None:
            self._waiting.remove(waiting)
            reg = waiting.reg
            self._bury({transfer_id, reg.transfer_id}, reg.generation, True, why, now)
            return self._refuse(reg, why)
        self._bury([transfer_id], -1, True, why, now)
        return []

    def write_finished(
        self, transfer_id: str, generation: int, ok: bool, error: str, now: float
    ) -> list[Action]:
        """The write started by `StartWrite` for (transfer_id, generation) completed."""
        writing = self._writing.get(transfer_id)
        if writing is None or writing.reg.generation != generation:
            raise ValueError(f"no write in flight for transfer {transfer_id} gen {generation}")
        if not ok:
            self.stats.writes_failed += 1
        reg, local = writing.reg, writing.local
        why = "written" if ok else f"KV write to {reg.engine_id} failed: {error}"
        # a failed write still tells decode the first token (it may compute the prompt
        # itself: vLLM's kv_load_failure_policy "recompute", and must continue from it)
        actions: list[Action] = [] if ok else [self._notify(reg, why, local.sampled)]
        actions += [
            self._ack((host, port), reg.transfer_id, gen) for host, port, gen in writing.acks
        ]
        writing.acks = []
        queued = writing.queued
        if queued is not None:
            self._unqueue(writing)
            writing.reg, writing.deadline = queued.reg, queued.deadline
            self.stats.writes_started += 1
            return [*actions, StartWrite(queued.reg, writing.local, queued.deadline)]
        del self._writing[reg.transfer_id], self._writing_local[local.transfer_id]
        # newer generations refused during the write are stale from now on, too
        newest = max(generation, writing.newest)
        self._bury({reg.transfer_id, local.transfer_id}, newest, True, why, now)
        return [ReleaseBlocks(local, why), *actions]

    def expire(self, now: float) -> list[Action]:
        """End everything whose deadline is at or before `now`."""
        actions: list[Action] = []
        # ending a record can leave a tombstone that is already due (tombstone_s=0, now=inf)
        while due := self._deadlines.pop_due(now):
            actions += self._expire_records(due, now)
        return actions

    def _expire_records(self, due: list[_Waiting | _Finished | _Gone], now: float) -> list[Action]:
        actions: list[Action] = []
        for record in due:
            if isinstance(record, _Waiting):
                actions += self._expire_registration(record, now)
            elif isinstance(record, _Finished):
                self.stats.expired_leases += 1
                self._finished.remove(record)
                local = record.local
                why = (
                    f"no registration for transfer {local.transfer_id} within the "
                    f"{self.lease_s:g} s lease; check that the router sent the request to "
                    "decode too and that decode can reach this prefill instance"
                )
                self._bury([local.transfer_id], -1, True, why, now)
                actions.append(ReleaseBlocks(local, why))
            else:
                self._gone.remove(record)
        return actions

    def _register_new(self, reg: Registration, now: float, exact: bool = False) -> list[Action]:
        finished = self._finished.exact(reg.transfer_id)
        if finished is None and not exact:
            finished = self._match(self._finished, reg.request_id)
        if finished is not None:
            self._finished.remove(finished)
            return self._start(finished.local, reg, now + self._wait_s(reg))
        if len(self._waiting) >= self.max_waiting:
            self.stats.capped_registrations += 1
            why = (
                f"prefill has {len(self._waiting)} registrations waiting for their prefill, "
                f"its cap: this one is refused; the router sends more than prefill serves"
            )
            return self._refuse(reg, why)
        waiting = _Waiting(reg, now + self._wait_s(reg))
        self._waiting.add(waiting, [reg.transfer_id], [reg.request_id])
        self._deadlines.add(waiting)
        return []

    def _register_after(
        self, gone: _Gone, reg: Registration, now: float, exact: bool = False
    ) -> list[Action]:
        if reg.generation <= gone.generation:
            return self._stale()
        if gone.kv_released:
            self.stats.refused_registrations += 1
            gone.generation = reg.generation
            why = (
                f"prefill no longer holds KV for transfer {reg.transfer_id} ({gone.reason}); "
                "the request must be prefilled again"
            )
            return self._refuse(reg, why)
        self._gone.remove(gone)
        return self._register_new(reg, now, exact)

    def _queue_behind(self, writing: _Writing, reg: Registration, now: float) -> list[Action]:
        if reg.generation <= writing.newest:
            return self._stale()
        writing.newest = reg.generation
        if writing.aborted:
            self.stats.refused_registrations += 1
            why = f"prefill of transfer {reg.transfer_id} was aborted"
            return self._refuse(reg, why)
        actions: list[Action] = []
        queued = writing.queued
        if queued is not None:
            self._unqueue(writing)
            actions.append(
                DropRegistration(queued.reg, f"superseded by generation {reg.generation}")
            )
        writing.queued = _Waiting(reg, now + self._wait_s(reg), behind=writing)
        self._deadlines.add(writing.queued)
        return actions

    def _expire_registration(self, waiting: _Waiting, now: float) -> list[Action]:
        self.stats.expired_registrations += 1
        reg = waiting.reg
        if waiting.behind is not None:
            self._unqueue(waiting.behind)
            why = (
                f"generation {reg.generation} of transfer {reg.transfer_id} waited "
                f"{self._wait_s(reg):g} s for the write of an older generation to finish"
            )
        else:
            self._waiting.remove(waiting)
            why = (
                f"no prefill result for transfer {reg.transfer_id} within {self._wait_s(reg):g} "
                "s of registration; check that the router sent the request to this prefill "
                "instance and that it is not overloaded"
            )
            self._bury([reg.transfer_id], reg.generation, False, why, now)
        return self._refuse(reg, why)

    def _start(self, local: LocalBlocks, reg: Registration, deadline: float) -> list[Action]:
        writing = _Writing(local, reg, reg.generation, deadline)
        self._writing[reg.transfer_id] = writing
        self._writing_local[local.transfer_id] = writing
        self.stats.writes_started += 1
        return [StartWrite(reg, local, deadline)]

    def _unqueue(self, writing: _Writing) -> None:
        if writing.queued is not None:
            writing.queued.alive = False
            writing.queued = None

    def _match(self, index: _Index[R], request_id: str) -> R | None:
        candidates = index.candidates(request_id)
        if len(candidates) == 1:
            self.stats.fallback_matches += 1
            return candidates[0]
        if candidates:
            self.stats.ambiguous_matches += 1
        return None

    def _bury(
        self, ids: Iterable[str], generation: int, kv_released: bool, reason: str, now: float
    ) -> None:
        keys = set(ids)
        for key in list(keys):
            old = self._gone.exact(key)
            if old is not None:
                # one tombstone per transfer: it takes over the old one's ids and fences
                keys.update(self._gone.ids_of(old))
                generation = max(generation, old.generation)
                kv_released = kv_released or old.kv_released
                self._gone.remove(old)
        if len(self._gone) >= self.max_tombstones:
            self.stats.dropped_tombstones += 1
            self._gone.remove(next(iter(self._gone)))  # the oldest
        gone = _Gone(generation, kv_released, reason, now + self.tombstone_s)
        self._gone.add(gone, sorted(keys), [])
        self._deadlines.add(gone)

    def _wait_s(self, reg: Registration) -> float:
        """How long `reg` stays valid here: what decode asked, at most `max_wait_s`."""
        return min(reg.deadline_ms / 1000, self.max_wait_s)

    def _stale(self) -> list[Action]:
        self.stats.stale_registrations += 1
        return []

    def _refuse(self, reg: Registration, why: str) -> list[Action]:
        return [DropRegistration(reg, why), self._notify(reg, why)]

    def _notify(self, reg: Registration, why: str, sampled: int = NO_TOKEN) -> NotifyFailure:
        message = WriteDone(
            reg.transfer_id,
            reg.generation,
            self.tp_rank,
            self.tp_size,
            False,
            why[:MAX_TEXT_LEN],
            sampled,
            self.pp_rank,
        )
        return NotifyFailure(reg.host, reg.port, message)

    def _ack(self, to: tuple[str, int], transfer_id: str, generation: int) -> NotifyFailure:
        why = "cancel acknowledged: no write of this transfer can land any more"
        message = WriteDone(
            transfer_id, generation, self.tp_rank, self.tp_size, False, why, pp_rank=self.pp_rank
        )
        return NotifyFailure(to[0], to[1], message)


