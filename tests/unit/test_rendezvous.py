from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.arrivals import ArrivalFailed, Arrivals, Arrived, Released
from kvpush.core.protocol import Cancel, Registration, WriteDone
from kvpush.core.rendezvous import (
    Action,
    DropRegistration,
    LocalBlocks,
    NotifyFailure,
    ReleaseBlocks,
    Rendezvous,
    StartWrite,
    base_request_id,
)

BLOCKS = (3, 4, 5)


def reg(
    transfer_id: str = "t1",
    generation: int = 0,
    deadline_ms: int = 10_000,
    request_id: str | None = None,
) -> Registration:
    return Registration(
        transfer_id=transfer_id,
        request_id=request_id or transfer_id,
        engine_id="decode-0",
        host="127.0.0.1",
        port=5600,
        tp_rank=0,
        tp_size=1,
        block_ids=(10, 11, 12),
        num_tokens=40,
        generation=generation,
        deadline_ms=deadline_ms,
    )


def local(transfer_id: str = "t1", request_id: str | None = None) -> LocalBlocks:
    return LocalBlocks(transfer_id, request_id or transfer_id, BLOCKS, 40)


def done(rdv: Rendezvous, transfer_id: str = "t1", now: float = 0.0) -> list[Action]:
    return rdv.prefill_done(transfer_id, transfer_id, BLOCKS, 40, now)


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def assert_idle(rdv: Rendezvous) -> None:
    assert rdv.waiting_registrations == rdv.waiting_prefills == rdv.writes_in_flight == 0
    assert rdv.queued_registrations == rdv.held_blocks == 0


def test_base_request_id() -> None:
    assert base_request_id("chat-42-1f0c9ab3") == "chat-42"
    assert base_request_id("chat-42") == "chat-42"
    assert base_request_id("chat-42-1F0C9AB3") == "chat-42-1F0C9AB3"
    assert base_request_id("chat-42-1f0c9ab") == "chat-42-1f0c9ab"
    assert base_request_id("-1f0c9ab3") == "-1f0c9ab3"
    assert base_request_id("a-00000000-1f0c9ab3") == "a-00000000"


def test_registration_first_then_prefill_starts_the_write() -> None:
    rdv = Rendezvous()
    assert rdv.register(reg(), 0.0) == []
    assert rdv.waiting_registrations == 1
    assert done(rdv, now=1.0) == [StartWrite(reg(), local(), deadline=10.0)]
    assert rdv.writes_in_flight == 1 and rdv.held_blocks == 3
    assert rdv.write_finished("t1", 0, True, "", 2.0) == [ReleaseBlocks(local(), "written")]
    assert_idle(rdv)


def test_prefill_first_then_registration_starts_the_write() -> None:
    rdv = Rendezvous()
    assert done(rdv) == []
    assert rdv.waiting_prefills == 1
    assert rdv.register(reg(), 1.0) == [StartWrite(reg(), local(), deadline=11.0)]


def test_failed_write_releases_and_tells_decode() -> None:
    rdv = Rendezvous(tp_rank=1, tp_size=2)
    rdv.register(reg(), 0.0)
    done(rdv)
    actions = rdv.write_finished("t1", 0, False, "NIXL_ERR_REMOTE_DISCONNECT", 1.0)
    assert kinds(actions) == ["ReleaseBlocks", "NotifyFailure"]
    notify = actions[1]
    assert isinstance(notify, NotifyFailure)
    assert notify.message == WriteDone(
        "t1", 0, 1, 2, False, "KV write to decode-0 failed: NIXL_ERR_REMOTE_DISCONNECT"
    )
    assert rdv.stats.writes_failed == 1


def test_a_failed_write_still_tells_decode_prefills_first_token() -> None:
    """Decode may compute the prompt itself after a failed transfer (vLLM's
    kv_load_failure_policy "recompute"); its first token must still be prefill's."""
    rdv = Rendezvous()
    rdv.register(reg(), 0.0)
    rdv.prefill_done("t1", "t1", BLOCKS, 40, 0.0, sampled=7)
    notify = rdv.write_finished("t1", 0, False, "NIXL_ERR_BACKEND", 1.0)[1]
    assert isinstance(notify, NotifyFailure) and notify.message.sampled == 7


def test_fallback_matches_on_base_request_id() -> None:
    rdv = Rendezvous()
    rdv.prefill_done("p-chat-7", "chat-7-aaaaaaaa", BLOCKS, 40, 0.0)
    decode_reg = reg("d-chat-7", request_id="chat-7-bbbbbbbb")
    [start] = rdv.register(decode_reg, 0.0)
    assert isinstance(start, StartWrite) and start.local.transfer_id == "p-chat-7"
    assert rdv.stats.fallback_matches == 1
    # the pair is bound: decode's id finishes the write, both ids are remembered
    assert kinds(rdv.write_finished("d-chat-7", 0, True, "", 1.0)) == ["ReleaseBlocks"]
    assert rdv.register(reg("d-chat-7", request_id="chat-7-bbbbbbbb"), 2.0) == []


def test_ambiguous_base_request_id_is_never_guessed() -> None:
    rdv = Rendezvous(lease_s=5.0)
    rdv.prefill_done("p1", "chat-7-aaaaaaaa", BLOCKS, 40, 0.0)
    rdv.prefill_done("p2", "chat-7-cccccccc", (9,), 40, 0.0)
    assert rdv.register(reg("d1", request_id="chat-7-bbbbbbbb", deadline_ms=1000), 0.0) == []
    assert rdv.stats.ambiguous_matches == 1
    assert kinds(rdv.expire(1.0)) == ["DropRegistration", "NotifyFailure"]
    assert kinds(rdv.expire(5.0)) == ["ReleaseBlocks", "ReleaseBlocks"]


def test_newer_generation_replaces_waiting_registration() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    [drop] = rdv.register(reg(generation=1), 0.5)
    assert drop == DropRegistration(reg(generation=0), "superseded by generation 1")
    assert rdv.register(reg(generation=0), 0.6) == []
    assert rdv.stats.stale_registrations == 1
    assert done(rdv) == [StartWrite(reg(generation=1), local(), deadline=10.5)]


def test_newer_generation_during_a_write_is_written_next() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    done(rdv)
    assert rdv.register(reg(generation=0), 0.1) == []  # duplicate
    assert rdv.register(reg(generation=1), 0.2) == []
    assert rdv.queued_registrations == 1
    notice, start = rdv.write_finished("t1", 0, False, "preempted", 1.0)
    assert isinstance(notice, NotifyFailure) and notice.message.generation == 0
    assert start == StartWrite(reg(generation=1), local(), deadline=10.2)
    assert kinds(rdv.write_finished("t1", 1, True, "", 2.0)) == ["ReleaseBlocks"]
    assert_idle(rdv)
    assert rdv.stats.writes_started == 2


def test_registration_after_blocks_are_gone_is_refused_at_once() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    done(rdv)
    rdv.write_finished("t1", 0, True, "", 1.0)
    assert rdv.register(reg(generation=0), 1.5) == []
    actions = rdv.register(reg(generation=1), 2.0)
    assert kinds(actions) == ["DropRegistration", "NotifyFailure"]
    assert "prefilled again" in actions[1].message.error  # type: ignore[union-attr]
    assert rdv.register(reg(generation=1), 2.1) == []


def test_registration_deadline_fails_fast_and_frees_a_late_prefill() -> None:
    rdv = Rendezvous()
    rdv.register(reg(deadline_ms=2000), 0.0)
    assert rdv.next_deadline() == 2.0
    assert rdv.expire(1.9) == []
    actions = rdv.expire(2.0)
    assert kinds(actions) == ["DropRegistration", "NotifyFailure"]
    assert "no prefill result" in actions[0].reason  # type: ignore[union-attr]
    assert rdv.stats.expired_registrations == 1
    [release] = done(rdv, now=3.0)
    assert isinstance(release, ReleaseBlocks)
    assert_idle(rdv)


def test_lease_expiry_releases_and_refuses_a_late_registration() -> None:
    rdv = Rendezvous(lease_s=5.0)
    done(rdv)
    assert rdv.expire(4.9) == []
    [release] = rdv.expire(5.0)
    assert isinstance(release, ReleaseBlocks) and "lease" in release.reason
    assert kinds(rdv.register(reg(), 6.0)) == ["DropRegistration", "NotifyFailure"]
    assert rdv.stats.refused_registrations == 1


def test_renewals_keep_a_finished_prefill_for_a_decode_waiting_for_blocks() -> None:
    """Decode's request waits for blocks longer than the lease and renews it; its
    registration, when it comes, still finds the KV."""
    rdv = Rendezvous(lease_s=5.0, max_wait_s=100.0)
    assert not rdv.renew("t1", 0.0), "nothing to renew before the prefill finished"
    done(rdv)
    for now in (2.5, 5.0, 7.5):
        assert rdv.renew("t1", now)
        assert rdv.expire(now + 2.4) == []
    assert not rdv.renew("t2", 8.0), "only the exact transfer is renewed"
    assert kinds(rdv.register(reg(), 12.0)) == ["StartWrite"]
    assert rdv.stats.renewed_leases == 3 and rdv.stats.expired_leases == 0


def test_renewals_end_max_wait_and_a_lease_after_the_prefill_finished() -> None:
    """Nothing a peer sends holds prefill's KV forever: renewed without end, a finished
    prefill is released `max_wait_s` and one lease after it finished, and a registration
    after that is refused."""
    rdv = Rendezvous(lease_s=5.0, max_wait_s=20.0)
    done(rdv, now=1.0)
    released: list[Action] = []
    now = 1.0
    while not released:
        now += 2.5
        rdv.renew("t1", now)
        released = rdv.expire(now)
    assert now == pytest.approx(26.0)
    [release] = released
    assert isinstance(release, ReleaseBlocks) and "lease" in release.reason
    assert not rdv.renew("t1", now)
    assert kinds(rdv.register(reg(), now)) == ["DropRegistration", "NotifyFailure"]


def test_cancel_of_waiting_registration_releases_a_later_prefill_at_once() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=2), 0.0)
    assert rdv.cancel("t1", 1, "stale cancel", 0.1) == []
    [drop] = rdv.cancel("t1", 2, "client went away", 0.2)
    assert isinstance(drop, DropRegistration) and "client went away" in drop.reason
    assert kinds(done(rdv, now=0.3)) == ["ReleaseBlocks"]
    # a re-registration after cancel still gets a fast answer
    assert kinds(rdv.register(reg(generation=3), 0.4)) == ["DropRegistration", "NotifyFailure"]


def test_cancel_before_registration_arrives() -> None:
    rdv = Rendezvous()
    assert rdv.cancel("t1", 0, "aborted", 0.0) == []
    assert rdv.register(reg(generation=0), 0.1) == []  # overtaken by its cancel
    assert rdv.register(reg(generation=1), 0.2) == []  # a new allocation is served
    assert kinds(done(rdv, now=0.3)) == ["StartWrite"]


def test_cancel_of_finished_prefill_releases() -> None:
    rdv = Rendezvous()
    done(rdv)
    assert kinds(rdv.cancel("t1", 0, "aborted", 0.1)) == ["ReleaseBlocks"]
    assert_idle(rdv)


def test_cancel_during_write_drops_queued_and_is_acknowledged_when_the_write_ended() -> None:
    rdv = Rendezvous(tp_rank=1, tp_size=2)
    rdv.register(reg(generation=0), 0.0)
    done(rdv)
    rdv.register(reg(generation=1), 0.1)
    actions = rdv.cancel("t1", 1, "client went away", 0.2, ack_to=("10.0.0.9", 7000))
    assert kinds(actions) == ["DropRegistration"], "no acknowledgement while a write flies"
    actions = rdv.write_finished("t1", 0, False, "cancelled", 1.0)
    assert kinds(actions) == ["ReleaseBlocks", "NotifyFailure", "NotifyFailure"]
    failure, ack = actions[1], actions[2]
    assert isinstance(failure, NotifyFailure) and failure.message.generation == 0
    assert isinstance(ack, NotifyFailure) and (ack.host, ack.port) == ("10.0.0.9", 7000)
    assert ack.message == WriteDone(
        "t1", 1, 1, 2, False, "cancel acknowledged: no write of this transfer can land any more"
    )
    assert_idle(rdv)


@pytest.mark.parametrize("state", ["unknown", "waiting", "finished", "written", "stale"])
def test_cancel_is_acknowledged_at_once_when_no_write_is_in_flight(state: str) -> None:
    rdv = Rendezvous()
    if state in ("waiting", "written", "stale"):
        rdv.register(reg(generation=2 if state == "stale" else 0), 0.0)
    if state in ("finished", "written"):
        done(rdv)
    if state == "written":
        rdv.write_finished("t1", 0, True, "", 0.5)
    actions = rdv.cancel("t1", 1, "gave up", 1.0, ack_to=("decode", 1))
    assert isinstance(actions[-1], NotifyFailure) and actions[-1].message.generation == 1
    assert (
        kinds(actions[:-1])
        == {
            "unknown": [],
            "waiting": ["DropRegistration"],
            "finished": ["ReleaseBlocks"],
            "written": [],
            "stale": [],
        }[state]
    )
    # nothing of the cancelled generations is written afterwards
    assert not [a for a in rdv.register(reg(generation=1), 1.1) if isinstance(a, StartWrite)]
    if state != "finished":
        starts = [a for a in done(rdv, now=1.2) if isinstance(a, StartWrite)]
        assert all(a.registration.generation > 1 for a in starts)


def test_a_write_carries_its_registrations_deadline() -> None:
    rdv = Rendezvous()
    rdv.register(reg(deadline_ms=2000), 1.0)
    [start] = done(rdv, now=1.5)
    assert isinstance(start, StartWrite) and start.deadline == 3.0
    rdv.register(reg(generation=1, deadline_ms=1000), 1.6)
    [queued] = rdv.write_finished("t1", 0, True, "", 1.7)
    assert isinstance(queued, StartWrite) and queued.deadline == 2.6


def test_queued_registration_expires_while_old_write_hangs() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    done(rdv)
    rdv.register(reg(generation=1, deadline_ms=1000), 0.0)
    assert kinds(rdv.expire(1.0)) == ["DropRegistration", "NotifyFailure"]
    assert kinds(rdv.write_finished("t1", 0, True, "", 2.0)) == ["ReleaseBlocks"]


def test_local_abort_tells_waiting_decode_and_refuses_later_registrations() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    actions = rdv.abort_local("t1", "t1", "client disconnected", 0.5)
    assert kinds(actions) == ["DropRegistration", "NotifyFailure"]
    assert "client disconnected" in actions[1].message.error  # type: ignore[union-attr]
    assert kinds(rdv.register(reg(generation=1), 0.6)) == ["DropRegistration", "NotifyFailure"]


def test_local_abort_before_registration() -> None:
    rdv = Rendezvous()
    assert rdv.abort_local("t1", "t1", "out of memory", 0.0) == []
    assert kinds(rdv.register(reg(), 0.1)) == ["DropRegistration", "NotifyFailure"]


def test_local_abort_during_write_waits_for_it() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    done(rdv)
    rdv.register(reg(generation=1), 0.1)
    assert kinds(rdv.abort_local("t1", "t1", "shutdown", 0.2)) == [
        "DropRegistration",
        "NotifyFailure",
    ]
    assert kinds(rdv.register(reg(generation=2), 0.3)) == ["DropRegistration", "NotifyFailure"]
    assert kinds(rdv.write_finished("t1", 0, True, "", 1.0)) == ["ReleaseBlocks"]


def test_a_registration_refused_during_an_aborted_write_is_refused_once() -> None:
    rdv = Rendezvous()
    rdv.register(reg(generation=0), 0.0)
    done(rdv)
    rdv.abort_local("t1", "t1", "shutdown", 0.1)
    assert kinds(rdv.register(reg(generation=1), 0.2)) == ["DropRegistration", "NotifyFailure"]
    rdv.write_finished("t1", 0, False, "aborted", 0.3)
    assert rdv.register(reg(generation=1), 0.4) == [], "a repeat of a refused one is stale"


def test_misuse_raises() -> None:
    rdv = Rendezvous()
    done(rdv)
    with pytest.raises(ValueError, match="twice"):
        done(rdv)
    with pytest.raises(ValueError, match="no write in flight"):
        rdv.write_finished("t1", 0, True, "", 0.0)
    with pytest.raises(ValueError, match="tp_rank"):
        Rendezvous(tp_rank=2, tp_size=2)


def test_tombstones_expire() -> None:
    rdv = Rendezvous(tombstone_s=10.0)
    rdv.cancel("t1", 0, "x", 0.0)
    assert rdv.tombstones == 1
    assert rdv.next_deadline() == 10.0
    rdv.expire(10.0)
    assert rdv.tombstones == 0 and rdv.next_deadline() is None


# -- property test: random interleavings ---------------------------------------------------

N = 3
transfers = st.integers(0, N - 1)
rendezvous_ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), transfers, st.integers(0, 3), st.integers(0, 6000)),
        st.tuples(st.just("prefill"), transfers),
        st.tuples(st.just("cancel"), transfers, st.integers(0, 3), st.booleans()),
        st.tuples(st.just("abort"), transfers),
        st.tuples(st.just("finish"), st.integers(0, N - 1), st.booleans()),
        st.tuples(st.just("tick"), st.floats(0, 3)),
    ),
    max_size=40,
)


class RendezvousModel:
    """Drives a Rendezvous and checks every action against the invariants."""

    def __init__(self, shared_ids: list[bool]) -> None:
        self.rdv = Rendezvous(lease_s=4.0, tombstone_s=1e6)
        self.now = 0.0
        # with shared ids both sides use one transfer id; otherwise only the base matches
        self.decode_ids = [f"req{i}-0000000{i}" for i in range(N)]
        self.prefill_ids = [
            self.decode_ids[i] if shared else f"req{i}-aaaaaaa{i}"
            for i, shared in enumerate(shared_ids)
        ]
        self.newest_sent: dict[int, int] = {}
        self.prefilled: set[int] = set()
        self.in_flight: dict[int, int] = {}
        self.outcomes: Counter[tuple[int, int]] = Counter()
        self.notified: Counter[tuple[int, int]] = Counter()
        self.released: Counter[int] = Counter()
        self.register_calls = 0
        self.acked: dict[int, int] = {}
        self.acks_sent = 0
        self.cancels_acked = 0

    def index(self, transfer_id: str) -> int:
        return int(transfer_id[3])

    def run(self, op: tuple[object, ...]) -> None:
        name = op[0]
        if name == "register":
            _, i, gen, deadline_ms = op
            assert isinstance(i, int) and isinstance(gen, int) and isinstance(deadline_ms, int)
            self.newest_sent[i] = max(gen, self.newest_sent.get(i, -1))
            self.register_calls += 1
            r = reg(self.decode_ids[i], gen, deadline_ms)
            self.check(self.rdv.register(r, self.now))
        elif name == "prefill":
            i = op[1]
            assert isinstance(i, int)
            if i not in self.prefilled:
                self.prefilled.add(i)
                tid = self.prefill_ids[i]
                self.check(self.rdv.prefill_done(tid, tid, (i,), 40, self.now))
        elif name == "cancel":
            _, i, gen, ack = op
            assert isinstance(i, int) and isinstance(gen, int)
            self.cancels_acked += bool(ack)
            ack_to = ("ack", 1) if ack else None
            self.check(self.rdv.cancel(self.decode_ids[i], gen, "test", self.now, ack_to))
        elif name == "abort":
            i = op[1]
            assert isinstance(i, int)
            tid = self.prefill_ids[i]
            self.check(self.rdv.abort_local(tid, tid, "test", self.now))
        elif name == "finish":
            _, pick, ok = op
            assert isinstance(pick, int) and isinstance(ok, bool)
            if self.in_flight:
                self.finish(sorted(self.in_flight)[pick % len(self.in_flight)], ok)
        else:
            dt = op[1]
            assert isinstance(dt, float)
            self.now += dt
            self.check(self.rdv.expire(self.now))

    def finish(self, i: int, ok: bool) -> None:
        gen = self.in_flight.pop(i)
        self.check(self.rdv.write_finished(self.decode_ids[i], gen, ok, "test", self.now))

    def check(self, actions: list[Action]) -> None:
        # decode hears of every registration prefill stops serving, except the ones decode
        # itself replaced or cancelled
        silent = ("superseded", "cancelled by decode")
        must_notify = {
            (a.registration.transfer_id, a.registration.generation)
            for a in actions
            if isinstance(a, DropRegistration) and not a.reason.startswith(silent)
        }
        notified = {
            (a.message.transfer_id, a.message.generation)
            for a in actions
            if isinstance(a, NotifyFailure)
        }
        assert must_notify <= notified
        for action in actions:
            if isinstance(action, StartWrite):
                i, gen = self.index(action.registration.transfer_id), action.registration.generation
                assert action.local.transfer_id == self.prefill_ids[i]
                assert i in self.prefilled and i not in self.in_flight
                assert self.released[i] == 0
                assert gen == self.newest_sent[i], "only the newest generation is written"
                self.outcomes[i, gen] += 1
                assert self.outcomes[i, gen] == 1, "at most one outcome per generation"
                assert gen > self.acked.get(i, -1), "nothing is written after an acknowledgement"
                assert self.now <= action.deadline
                self.in_flight[i] = gen
            elif isinstance(action, DropRegistration):
                key = self.index(action.registration.transfer_id), action.registration.generation
                self.outcomes[key] += 1
                assert self.outcomes[key] == 1, "at most one outcome per generation"
            elif isinstance(action, NotifyFailure) and action.host == "ack":
                msg = action.message
                i = self.index(msg.transfer_id)
                assert not msg.ok and msg.transfer_id == self.decode_ids[i]
                flying = self.in_flight.get(i)
                assert flying is None or flying > msg.generation, "acknowledged mid-write"
                self.acked[i] = max(self.acked.get(i, -1), msg.generation)
                self.acks_sent += 1
            elif isinstance(action, NotifyFailure):
                msg = action.message
                assert not msg.ok and (action.host, action.port) == ("127.0.0.1", 5600)
                key = self.index(msg.transfer_id), msg.generation
                self.notified[key] += 1
                assert self.notified[key] == 1
            else:
                i = self.index(action.local.transfer_id)
                assert i in self.prefilled and i not in self.in_flight
                self.released[i] += 1
                assert self.released[i] == 1, "blocks are released exactly once"

    def drain(self) -> None:
        while self.in_flight:
            self.finish(next(iter(self.in_flight)), True)
        self.now = math.inf
        self.check(self.rdv.expire(self.now))


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.booleans(), min_size=N, max_size=N), rendezvous_ops)
def test_random_interleavings_keep_the_invariants(
    shared_ids: list[bool], ops: list[tuple[object, ...]]
) -> None:
    model = RendezvousModel(shared_ids)
    for op in ops:
        model.run(op)
    model.drain()
    assert all(model.released[i] == 1 for i in model.prefilled)
    assert_idle(model.rdv)
    assert model.rdv.tombstones == 0 and model.rdv.next_deadline() is None
    stats = model.rdv.stats
    assert stats.registrations == model.register_calls
    # every registration ends exactly once: ignored as stale, written, or dropped
    assert stats.registrations - stats.stale_registrations == sum(model.outcomes.values())
    assert model.acks_sent == model.cancels_acked, "every cancel that asks is acknowledged once"


# -- decode side: Arrivals -----------------------------------------------------------------


def wd(transfer_id: str = "t1", generation: int = 0, rank: int = 0, ok: bool = True) -> WriteDone:
    return WriteDone(transfer_id, generation, rank, 4, ok, "" if ok else "boom")


def test_arrival_needs_one_completion_per_producer() -> None:
    arrivals = Arrivals()
    arrivals.expect("t1", 0, producers=2, deadline=10.0)
    assert arrivals.on_write_done(wd(rank=1), 1.0) == []
    assert arrivals.on_write_done(wd(rank=1), 1.1) == []
    assert arrivals.stats.duplicates == 1
    assert arrivals.on_write_done(wd(rank=3), 1.1) == [], "not a producer of this transfer"
    assert arrivals.on_write_done(wd(rank=0), 1.2) == [Arrived("t1", 0)]
    assert arrivals.pending == 0
    assert arrivals.on_write_done(wd(rank=2), 1.3) == []
    assert arrivals.stats.unexpected == 2


def test_producers_may_be_any_ranks() -> None:
    arrivals = Arrivals()
    arrivals.expect("t1", 0, producers=(2, 3), deadline=10.0)
    assert arrivals.on_write_done(wd(rank=0), 1.0) == []
    assert arrivals.on_write_done(wd(rank=2), 1.0) == []
    assert arrivals.on_write_done(wd(rank=3), 1.0) == [Arrived("t1", 0)]


def test_a_failure_releases_the_blocks_only_when_every_producer_settled() -> None:
    arrivals = Arrivals(fence_s=2.0)
    arrivals.expect("t1", 0, producers=3, deadline=10.0)
    arrivals.on_write_done(wd(rank=0), 1.0)
    [failed] = arrivals.on_write_done(wd(rank=1, ok=False), 1.5)
    assert isinstance(failed, ArrivalFailed) and "boom" in failed.reason
    assert failed.kind == "prefill_failed" and failed.unsettled == (2,)
    assert arrivals.pending == 1 and arrivals.fenced == 1
    assert not arrivals.is_waiting("t1", 0)
    assert arrivals.on_write_done(wd(rank=1, ok=False), 1.6) == [], "already settled"
    reason = failed.reason
    released = [Released("t1", 0, reason, False, unsure=True)]
    assert arrivals.on_write_done(wd(rank=2, ok=False), 1.7) == released
    assert arrivals.pending == 0 and arrivals.next_deadline() is None


def test_a_failure_with_every_producer_settled_is_released_at_once() -> None:
    arrivals = Arrivals()
    arrivals.expect("t1", 0, producers=1, deadline=10.0)
    failed, released = arrivals.on_write_done(wd(ok=False), 1.0)
    assert isinstance(failed, ArrivalFailed) and failed.unsettled == ()
    assert released == Released("t1", 0, failed.reason, False, unsure=True)


def test_a_silent_producer_is_fenced_until_after_the_transfer_deadline() -> None:
    arrivals = Arrivals(fence_s=2.0)
    arrivals.expect("t1", 0, producers=2, deadline=5.0)
    [failed] = arrivals.fail("t1", "decode request ended", "aborted", 1.0)
    assert isinstance(failed, ArrivalFailed) and failed.unsettled == (0, 1)
    assert arrivals.fail("t1", "again", "aborted", 1.1) == []
    assert arrivals.settle("t1", 0, 0) == []
    assert arrivals.next_deadline() == 7.0, "prefill may post until about the deadline"
    assert arrivals.expire(6.9) == []
    assert arrivals.expire(7.0) == [Released("t1", 0, "decode request ended", True, True)]
    assert arrivals.stats.released_by_time == 1


def test_a_timeout_asks_the_unsettled_producers_and_is_fenced_from_then() -> None:
    arrivals = Arrivals(fence_s=1.0)
    arrivals.expect("t1", 0, producers=3, deadline=5.0)
    arrivals.on_write_done(wd(rank=0), 2.0)
    [late] = arrivals.expire(5.0)
    assert isinstance(late, ArrivalFailed) and late.kind == "transfer_timeout"
    assert "1 of 3 producer ranks" in late.reason and late.unsettled == (1, 2)
    assert arrivals.settle("t1", 0, 1) == []
    assert arrivals.on_write_done(wd(rank=2), 5.5) == [Released("t1", 0, late.reason, False)]


def test_released_says_whether_a_producer_may_have_left_a_write_under_way() -> None:
    """`unsure` unless every producer rank ended with its KV written or was never asked to
    write: a WRITE that failed, a rank that is gone or silent may have bytes still on the
    way, which decode stops before it reuses the blocks."""
    arrivals = Arrivals(fence_s=1.0)
    arrivals.expect("t1", 0, producers=2, deadline=5.0)
    arrivals.fail("t1", "decode request ended", "aborted", 1.0)
    assert arrivals.settle("t1", 0, 0) == []  # never asked to write
    [done] = arrivals.on_write_done(wd(rank=1), 1.2)  # its WRITE completed after all
    assert isinstance(done, Released) and not done.unsure
    arrivals.expect("t2", 0, producers=2, deadline=5.0)
    assert arrivals.settle("t2", 0, 0, sure=False) == []  # gone before the failure
    arrivals.fail("t2", "decode request ended", "aborted", 1.0)
    [gone] = arrivals.on_write_done(wd("t2", rank=1), 1.2)
    assert isinstance(gone, Released) and gone.unsure
    arrivals.expect("t3", 0, producers=1, deadline=5.0)
    arrivals.fail("t3", "decode request ended", "aborted", 1.0)
    [given_up] = arrivals.on_write_done(wd("t3", ok=False), 1.2)  # released unfinished
    assert isinstance(given_up, Released) and given_up.unsure


def test_settled_producers_before_the_failure_count() -> None:
    arrivals = Arrivals()
    arrivals.expect("t1", 0, producers=2, deadline=5.0)
    assert arrivals.settle("t1", 0, 1) == []
    [failed] = arrivals.fail("t1", "gone", "peer_gone", 1.0)
    assert isinstance(failed, ArrivalFailed) and failed.unsettled == (0,)


def test_a_cancel_from_prefill_fails_without_settling() -> None:
    arrivals = Arrivals()
    arrivals.expect("b", 0, 1, 10.0)
    [cancelled] = arrivals.on_cancel(Cancel("b", 0, "prefill aborted"), 1.0)
    assert isinstance(cancelled, ArrivalFailed) and "prefill aborted" in cancelled.reason
    assert cancelled.unsettled == (0,)


def test_arrival_generations() -> None:
    arrivals = Arrivals()
    arrivals.expect("t1", 0, 1, 10.0)
    arrivals.expect("t1", 1, 1, 10.0)
    assert arrivals.on_write_done(wd(generation=0), 1.0) == []
    assert arrivals.stats.stale == 1
    assert arrivals.on_cancel(Cancel("t1", 0, "old"), 1.0) == []
    with pytest.raises(ValueError, match="bump the generation"):
        arrivals.expect("t1", 1, 1, 10.0)
    assert arrivals.is_waiting("t1", 1) and not arrivals.is_waiting("t1", 0)
    assert arrivals.on_write_done(wd(generation=1), 1.0) == [Arrived("t1", 1)]
    assert arrivals.expire(math.inf) == []


def test_arrival_after_deadline_fails_even_before_expire_runs() -> None:
    arrivals = Arrivals(fence_s=0.0)
    arrivals.expect("t1", 0, 1, 1.0)
    late, released = arrivals.on_write_done(wd(), 1.5)
    assert isinstance(late, ArrivalFailed) and late.kind == "transfer_timeout"
    assert isinstance(released, Released), "the late write did complete: nothing in flight"
    assert arrivals.forget("t1") is False


arrival_ops = st.lists(
    st.one_of(
        st.tuples(st.just("expect"), transfers, st.integers(1, 3), st.floats(0, 5)),
        st.tuples(st.just("done"), transfers, st.integers(-1, 0), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("cancel"), transfers, st.integers(-1, 1)),
        st.tuples(st.just("fail"), transfers),
        st.tuples(st.just("settle"), transfers, st.integers(0, 3)),
        st.tuples(st.just("forget"), transfers),
        st.tuples(st.just("tick"), st.floats(0, 2)),
    ),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(arrival_ops, st.sampled_from([0.0, 0.5, 3.0]))
def test_arrivals_report_each_transfer_once_and_fence_failures(
    ops: list[tuple[object, ...]], fence_s: float
) -> None:
    """Each transfer ends once: Arrived, or ArrivalFailed then Released. A Released that
    time did not force comes only after every producer rank said it will not write."""
    arrivals = Arrivals(fence_s=fence_s)
    now = 0.0
    generation: dict[int, int] = {}
    producers: dict[int, int] = {}
    deadline: dict[int, float] = {}
    ok_ranks: dict[tuple[int, int], set[int]] = {}
    spoke: dict[tuple[int, int], set[int]] = {}  # ranks that reported or were settled
    failed_at: dict[tuple[int, int], float] = {}
    open_: set[tuple[int, int]] = set()
    ended: Counter[tuple[int, int]] = Counter()

    def record(results: list[Arrived | ArrivalFailed | Released]) -> None:
        for result in results:
            key = int(result.transfer_id[1]), result.generation
            assert key in open_, "outcome for a transfer not pending"
            if isinstance(result, ArrivalFailed):
                assert key not in failed_at, "one failure per transfer"
                failed_at[key] = now
                assert set(result.unsettled) == set(range(producers[key[0]])) - spoke[key]
                continue
            open_.discard(key)
            ended[key] += 1
            assert ended[key] == 1
            if isinstance(result, Arrived):
                assert key not in failed_at
                assert len(ok_ranks[key]) >= producers[key[0]]
            elif result.by_time:
                assert now >= max(failed_at[key], deadline[key[0]]) + fence_s
            else:
                assert spoke[key] >= set(range(producers[key[0]])), "released mid-write"

    for op in ops:
        name, *args = op
        if name == "expect":
            i, count, ttl = args
            assert isinstance(i, int) and isinstance(count, int) and isinstance(ttl, float)
            gen = generation.get(i, -1) + 1
            open_.discard((i, gen - 1))
            generation[i], producers[i] = gen, count
            ok_ranks[i, gen], spoke[i, gen] = set(), set()
            open_.add((i, gen))
            deadline[i] = now + ttl
            arrivals.expect(f"t{i}", gen, count, now + ttl)
        elif name == "done" and args[0] in generation:
            i, offset, rank, ok = args
            assert isinstance(i, int) and isinstance(offset, int) and isinstance(rank, int)
            gen = max(generation[i] + offset, 0)
            if (i, gen) in open_ and rank < producers[i]:
                spoke[i, gen].add(rank)
                if ok and now <= deadline[i] and (i, gen) not in failed_at:
                    ok_ranks[i, gen].add(rank)
            record(arrivals.on_write_done(wd(f"t{i}", gen, rank, bool(ok)), now))
        elif name == "cancel" and args[0] in generation:
            i, offset = args
            assert isinstance(i, int) and isinstance(offset, int)
            gen = max(generation[i] + offset, 0)
            record(arrivals.on_cancel(Cancel(f"t{i}", gen, "test"), now))
        elif name == "fail" and args[0] in generation:
            i = args[0]
            assert isinstance(i, int)
            record(arrivals.fail(f"t{i}", "test", "aborted", now))
        elif name == "settle" and args[0] in generation:
            i, rank = args
            assert isinstance(i, int) and isinstance(rank, int)
            if (i, generation[i]) in open_ and rank < producers[i]:
                spoke[i, generation[i]].add(rank)
            record(arrivals.settle(f"t{i}", generation[i], rank))
        elif name == "forget":
            i = args[0]
            assert isinstance(i, int)
            if arrivals.forget(f"t{i}"):
                open_.discard((i, generation[i]))
        elif name == "tick":
            assert isinstance(args[0], float)
            now += args[0]
            record(arrivals.expire(now))
    now = math.inf
    record(arrivals.expire(now))
    assert not open_ and arrivals.pending == 0


def test_a_registration_waits_no_longer_than_prefill_allows() -> None:
    """A peer cannot park a registration for days: its deadline is capped at prefill's
    own transfer timeout."""
    rdv = Rendezvous(max_wait_s=2.0)
    assert rdv.register(reg(deadline_ms=4_000_000_000), now=0.0) == []
    assert rdv.next_deadline() == 2.0
    drop, notify = rdv.expire(2.0)
    assert isinstance(notify, NotifyFailure) and "within 2 s" in notify.message.error
    assert kinds([drop]) == ["DropRegistration"]


def test_registrations_past_the_cap_are_refused_saying_so() -> None:
    rdv = Rendezvous(max_waiting=2)
    assert rdv.register(reg("a"), now=0.0) == rdv.register(reg("b"), now=0.0) == []
    drop, notify = rdv.register(reg("c"), now=0.0)
    assert isinstance(notify, NotifyFailure) and "cap" in notify.message.error
    assert rdv.waiting_registrations == 2 and rdv.stats.capped_registrations == 1
    # a registration for a finished prefill never waits, so the cap does not apply
    done(rdv, "d")
    assert kinds(rdv.register(reg("d"), now=0.0)) == ["StartWrite"]


def test_tombstones_past_the_cap_forget_the_oldest() -> None:
    rdv = Rendezvous(max_tombstones=2)
    for transfer_id in ("a", "b", "c"):
        rdv.cancel(transfer_id, 0, "gone", now=0.0)
    assert rdv.tombstones == 2 and rdv.stats.dropped_tombstones == 1
    # "a" was forgotten: its late registration is served; "c" is still refused
    assert rdv.register(reg("a"), now=1.0) == []
    assert rdv.register(reg("c"), now=1.0) == [], "stale: generation 0 was cancelled"
    assert rdv.stats.stale_registrations == 1
