"""`core.fanout` and the rendezvous calls it relies on: one prefill, several decode legs."""

from __future__ import annotations

import pytest

from kvpush.core.fanout import Fanout, leg_id, split_leg
from kvpush.core.protocol import Registration
from kvpush.core.rendezvous import LocalBlocks, ReleaseBlocks, Rendezvous, StartWrite

LOCAL = LocalBlocks("t1", "p1", (5, 6, 7), 10)


def reg(transfer_id: str, rank: int, request_id: str = "d1") -> Registration:
    return Registration(
        transfer_id=transfer_id,
        request_id=request_id,
        engine_id="decode-0",
        host="127.0.0.1",
        port=5700 + rank,
        tp_rank=rank,
        tp_size=2,
        block_ids=(1, 2, 3),
        num_tokens=10,
        generation=0,
        deadline_ms=5000,
    )


def test_leg_ids_round_trip_and_plain_ids_stay_plain() -> None:
    assert split_leg(leg_id("chat-42", 3)) == ("chat-42", 3)
    assert split_leg("chat-42") == ("chat-42", None)
    assert split_leg("a\x1fb") == ("a\x1fb", None), "only a rank number makes a leg"


def test_the_blocks_are_released_once_after_the_last_leg() -> None:
    fanout = Fanout()
    fanout.open("t1", (1, 0))
    assert fanout.legs("t1") == [leg_id("t1", 0), leg_id("t1", 1)]
    legs = fanout.feed(LOCAL)
    assert [leg.transfer_id for leg in legs] == fanout.legs("t1")
    assert all(leg.block_ids == LOCAL.block_ids for leg in legs)
    assert fanout.released(legs[1].transfer_id) is None
    assert fanout.released(legs[0].transfer_id) is LOCAL
    assert len(fanout) == 0 and fanout.legs("t1") == ["t1"]
    with pytest.raises(ValueError, match="no leg holding"):
        fanout.released(legs[0].transfer_id)


def test_fanout_refuses_what_would_double_count() -> None:
    fanout = Fanout()
    with pytest.raises(ValueError, match="at least two"):
        fanout.open("t1", (0,))
    fanout.open("t1", (0, 1))
    with pytest.raises(ValueError, match="fans out already"):
        fanout.open("t1", (0, 1))
    with pytest.raises(ValueError, match="no leg holding"):
        fanout.released(leg_id("t1", 0))  # not fed yet
    fanout.feed(LOCAL)
    with pytest.raises(ValueError, match="twice"):
        fanout.feed(LOCAL)
    fanout.close_unfed("t1")
    assert len(fanout) == 1, "a fed fan ends by its releases only"


def test_legs_pair_only_by_their_own_id() -> None:
    """Legs share one request id: a fallback match by request id would hand one leg's
    prefill to another leg's registration."""
    rendezvous = Rendezvous()
    leg0, leg1 = leg_id("t1", 0), leg_id("t1", 1)
    assert rendezvous.register(reg(leg0, 0), 0.0, exact=True) == []
    assert rendezvous.prefill_done(leg1, "p1", (5, 6), 10, 0.0, exact=True) == []
    assert rendezvous.waiting_registrations == 1 and rendezvous.waiting_prefills == 1
    (start,) = rendezvous.prefill_done(leg0, "p1", (5, 6), 10, 0.0, exact=True)
    assert isinstance(start, StartWrite) and start.registration.tp_rank == 0
    assert rendezvous.held_blocks == 2, "legs share their blocks: counted once"


def test_take_finished_hands_back_unreleased_blocks() -> None:
    rendezvous = Rendezvous()
    assert rendezvous.take_finished("t1") is None
    rendezvous.prefill_done("t1", "p1", (5, 6), 10, 0.0)
    local = rendezvous.take_finished("t1")
    assert local is not None and local.block_ids == (5, 6)
    assert rendezvous.waiting_prefills == 0
    assert rendezvous.expire(1e9) == [], "taken blocks are the caller's: no lease ends"


def test_is_gone_sees_only_exact_tombstones() -> None:
    rendezvous = Rendezvous()
    rendezvous.prefill_done("t1", "p1", (5,), 1, 0.0)
    (release,) = rendezvous.cancel("t1", 0, "decode gave up", 0.0)
    assert isinstance(release, ReleaseBlocks)
    assert rendezvous.is_gone("t1") and not rendezvous.is_gone("t2")
