"""Pull-mode leases: every lease is released exactly once, time is passed in."""

from __future__ import annotations

from collections import Counter

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpush.core.lease import Leases
from kvpush.core.rendezvous import LocalBlocks, ReleaseBlocks


def local(transfer_id: str = "t1") -> LocalBlocks:
    return LocalBlocks(transfer_id, f"req-{transfer_id}", (3, 4, 5), 40)


def released(actions: list[ReleaseBlocks]) -> list[str]:
    return [a.local.transfer_id for a in actions]


def test_a_finished_read_releases_the_blocks_and_confirms_they_were_held() -> None:
    leases = Leases(lease_s=10)
    assert leases.hold(local(), now=0.0) == []
    assert (leases.active, leases.held_blocks, leases.next_deadline()) == (1, 3, 10.0)
    verdict, _, actions = leases.read_done("t1", 0, 0, 1, True, "", now=4.0)
    assert verdict == "held" and released(actions) == ["t1"]
    assert actions[0].reason == "read by decode"
    assert (leases.active, leases.held_blocks) == (0, 0)
    assert leases.expire(100.0) == []


def test_an_unread_lease_expires_once_and_a_late_read_is_told_it_is_invalid() -> None:
    leases = Leases(lease_s=10, tombstone_s=60)
    leases.hold(local(), now=0.0)
    assert leases.expire(9.99) == []
    [expired] = leases.expire(10.0)
    assert expired.local.transfer_id == "t1" and "within the 10 s lease" in expired.reason
    assert leases.expire(11.0) == []
    verdict, problem, actions = leases.read_done("t1", 0, 0, 1, True, "", now=12.0)
    assert (verdict, actions) == ("gone", [])
    assert "no longer holds KV for transfer t1" in problem and "10 s lease" in problem
    assert leases.renew("t1", 0, now=12.0)[0] == "gone"


def test_renewals_push_the_deadline_out() -> None:
    leases = Leases(lease_s=10)
    leases.hold(local(), now=0.0)
    assert leases.renew("t1", 0, now=6.0) == ("held", "")
    assert leases.next_deadline() == 16.0
    assert leases.expire(12.0) == [], "the first deadline no longer counts"
    assert leases.renew("t1", 0, now=14.0) == ("held", "")
    assert released(leases.expire(24.0)) == ["t1"]
    assert leases.stats.renewed == 2 and leases.stats.expired == 1


def test_a_failed_read_also_releases_and_names_the_error() -> None:
    leases = Leases(lease_s=10)
    leases.hold(local(), now=0.0)
    verdict, _, [release] = leases.read_done("t1", 0, 0, 1, False, "remote_disconnect", now=1.0)
    assert verdict == "held" and "remote_disconnect" in release.reason
    assert leases.stats.read_failed == 1


def test_messages_of_an_older_generation_change_nothing() -> None:
    leases = Leases(lease_s=10)
    leases.hold(local(), now=0.0)
    assert leases.renew("t1", 2, now=1.0) == ("held", "")
    verdict, stale = leases.renew("t1", 1, now=2.0)
    assert verdict == "gone" and "stale" in stale
    verdict, problem, actions = leases.read_done("t1", 1, 0, 1, False, "gave up", now=3.0)
    assert (verdict, actions) == ("gone", []) and "stale" in problem
    assert leases.active == 1 and leases.next_deadline() == 11.0
    verdict, _, actions = leases.read_done("t1", 2, 0, 1, True, "", now=4.0)
    assert verdict == "held" and released(actions) == ["t1"]


def test_before_the_hold_decode_is_told_not_yet_and_nothing_is_confirmed() -> None:
    """vLLM's scheduler holds the blocks from the moment it hands out their coordinates,
    but the worker learns of it a step later: decode's READ can finish first. Prefill
    confirms only what it leased, so decode hears "not yet" and asks again."""
    leases = Leases(lease_s=10)
    assert leases.renew("t1", 0, now=0.0)[0] == "not_yet"
    assert leases.read_done("t1", 0, 0, 1, True, "", now=0.5)[::2] == ("not_yet", [])
    assert leases.hold(local(), now=1.0) == [] and leases.active == 1
    verdict, _, [release] = leases.read_done("t1", 0, 0, 1, True, "", now=1.5)
    assert verdict == "held" and release.reason == "read by decode"
    assert leases.stats.not_yet == 2
    # a transfer this prefill never leased (forged, or granted by an earlier incarnation)
    # is never confirmed either
    assert leases.read_done("never", 0, 0, 1, True, "", now=2.0)[0] == "not_yet"


def test_an_early_failure_releases_at_hold() -> None:
    leases = Leases(lease_s=10)
    assert leases.read_done("t1", 0, 0, 1, False, "timeout", now=0.0)[0] == "not_yet"
    [release] = leases.hold(local(), now=1.0)
    assert "decode gave up reading: timeout" in release.reason


def test_early_failures_that_never_get_a_hold_are_dropped_and_capped() -> None:
    leases = Leases(lease_s=10, max_early=2)
    leases.read_done("nope", 0, 0, 1, False, "gave up", now=0.0)
    assert leases.next_deadline() == 10.0
    assert leases.expire(10.0) == [] and leases.next_deadline() is None
    assert leases.hold(local("nope"), now=11.0) == [] and leases.active == 1
    for i in range(3):
        leases.read_done(f"e{i}", 0, 0, 1, False, "gave up", now=12.0)
    assert leases.stats.capped == 1, "the oldest early record made room"
    assert leases.hold(local("e0"), now=13.0) == [], "forgotten: held normally"
    assert leases.hold(local("e2"), now=13.0) != []


def test_a_refusal_releases_a_held_lease_at_once() -> None:
    leases = Leases(lease_s=10)
    leases.hold(local(), now=0.0)
    [release] = leases.refuse("t1", "decode runs push mode", now=1.0)
    assert release.reason == "decode runs push mode"
    assert leases.expire(100.0) == []


def test_a_refusal_before_the_prefill_finished_releases_it_when_it_does() -> None:
    leases = Leases(lease_s=10, tombstone_s=60)
    assert leases.refuse("t1", "decode runs push mode", now=0.0) == []
    [release] = leases.hold(local(), now=1.0)
    assert release.reason == "decode runs push mode"
    assert leases.active == 0 and leases.expire(1000.0) == []


def test_tombstones_are_forgotten_capped_and_an_id_can_be_leased_again() -> None:
    leases = Leases(lease_s=10, tombstone_s=5, max_tombstones=2)
    leases.hold(local(), now=0.0)
    leases.read_done("t1", 0, 0, 1, True, "", now=1.0)
    verdict, problem, _ = leases.read_done("t1", 0, 0, 1, True, "", now=5.5)
    assert verdict == "gone" and "no longer holds" in problem
    assert leases.expire(6.0) == []
    # Past its tombstone an id is unknown again (hence tombstone_s >> lease_s by default).
    assert leases.hold(local(), now=8.0) == [] and leases.active == 1
    for i in range(3):
        leases.refuse(f"r{i}", "no", now=9.0)
    assert leases.stats.capped == 1


def test_a_lease_read_by_several_decode_ranks_ends_when_all_are_done() -> None:
    leases = Leases(lease_s=10)
    leases.hold(local(), now=0.0)
    assert leases.read_done("t1", 0, 1, 2, True, "", now=1.0) == ("held", "", [])
    assert leases.read_done("t1", 0, 1, 2, True, "", now=1.5) == ("held", "", []), "repeated"
    verdict, _, actions = leases.read_done("t1", 0, 0, 2, True, "", now=2.0)
    assert verdict == "held" and released(actions) == ["t1"]


def test_one_decode_rank_giving_up_ends_the_lease_for_all() -> None:
    leases = Leases(lease_s=10)
    leases.hold(local(), now=0.0)
    leases.read_done("t1", 0, 0, 2, True, "", now=1.0)
    verdict, _, actions = leases.read_done("t1", 0, 1, 2, False, "timeout", now=2.0)
    assert verdict == "held" and released(actions) == ["t1"]
    verdict, problem, _ = leases.read_done("t1", 0, 0, 2, True, "", now=3.0)
    assert verdict == "gone" and "decode gave up reading: timeout" in problem


def test_holding_a_transfer_twice_is_a_bug() -> None:
    leases = Leases()
    leases.hold(local(), now=0.0)
    try:
        leases.hold(local(), now=1.0)
    except ValueError as exc:
        assert "already leased" in str(exc)
    else:
        raise AssertionError("a second hold of t1 was accepted")


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["hold", "renew", "read_ok", "read_fail", "refuse", "expire"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 2),
        st.floats(0.0, 5.0),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
# a hold refused at the moment the refusal's tombstone was due, then a renewal
@example([("refuse", "a", 0, 0.0), ("hold", "a", 0, 4.0), ("expire", "a", 0, 0.0),
          ("renew", "a", 0, 0.0)])  # fmt: skip
def test_every_held_lease_is_released_exactly_once(ops: list[tuple[str, str, int, float]]) -> None:
    leases = Leases(lease_s=3.0, tombstone_s=4.0)
    now = 0.0
    holds: Counter[str] = Counter()
    releases: Counter[str] = Counter()
    held: set[str] = set()
    ended_at: dict[str, float] = {}

    def record(actions: list[ReleaseBlocks]) -> None:
        for action in actions:
            transfer_id = action.local.transfer_id
            releases[transfer_id] += 1
            held.discard(transfer_id)
            ended_at[transfer_id] = now
            assert releases[transfer_id] <= holds[transfer_id], "released more than held"

    for op, transfer_id, generation, step in ops:
        now += step
        if op == "hold":
            if transfer_id in held:
                continue
            holds[transfer_id] += 1
            held.add(transfer_id)
            record(leases.hold(local(transfer_id), now))
        elif op == "renew":
            verdict, _ = leases.renew(transfer_id, generation, now)
            # Only a held lease is ever "valid", and one that ended within its tombstone
            # is never even "not yet" again.
            assert verdict != "held" or transfer_id in held
            recent = transfer_id in ended_at and now - ended_at[transfer_id] < 4.0
            assert verdict == "held" or not recent or verdict == "gone"
        elif op in ("read_ok", "read_fail"):
            ok, reader = op == "read_ok", int(step * 10) % 2  # two decode ranks read
            verdict, _, actions = leases.read_done(transfer_id, generation, reader, 2, ok, "x", now)
            assert verdict == "held" or not actions
            assert verdict != "held" or transfer_id in held
            record(actions)
        elif op == "refuse":
            record(leases.refuse(transfer_id, "mode mismatch", now))
        else:
            record(leases.expire(now))
        assert leases.active == len(held)
    record(leases.expire(float("inf")))
    assert held == set() and leases.active == 0 and leases.held_blocks == 0
    assert releases == holds
