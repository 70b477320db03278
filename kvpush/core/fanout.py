"""Push fan-out (prefill side): one finished prefill written into several decode ranks.

When decode splits the KV heads finer than prefill (prefill TP 1 -> decode TP 2, or a head
that decode ranks replicate), one prefill rank writes the same finished prefill into
several decode ranks, and each of them registers on its own. `Rendezvous` pairs one
registration with one prefill result; `Fanout` keeps that rule by giving each destination
rank its own *leg* inside this prefill rank - a transfer id of its own,
`leg_id(transfer_id, rank)` - feeding the prefill result to every leg, and saying when the
last leg let go of the blocks, which are shared and released once.

A pure bookkeeper like `Rendezvous`: no thread, socket or clock. Which decode ranks a
prefill rank writes to is `planning.destinations`; the first registration of a transfer
says decode's TP size, and with it the legs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.core.rendezvous import LocalBlocks

SEP = "\x1f"  # no transfer id holds it: the protocol refuses control characters in ids


def leg_id(transfer_id: str, rank: int) -> str:
    """The id under which decode rank `rank`'s part of `transfer_id` is paired."""
    return f"{transfer_id}{SEP}{rank}"


def split_leg(transfer_id: str) -> tuple[str, int | None]:
    """(the transfer id decode knows, the decode rank) of a leg id; a plain transfer id
    comes back unchanged, with rank None."""
    base, sep, rank = transfer_id.rpartition(SEP)
    if not sep or not rank.isdigit():
        return transfer_id, None
    return base, int(rank)


@dataclass(slots=True)
class Fan:
    """One transfer written to several decode ranks."""

    ranks: tuple[int, ...]
    local: LocalBlocks | None = None  # the finished prefill, once it is
    holding: int = 0  # legs that hold the blocks (fed and not released yet)
    # decode rank by the control address it registered from: whose leg a Cancel stops
    senders: dict[tuple[str, int], int] = field(default_factory=dict)


class Fanout:
    """The fanned-out transfers of one prefill rank, by the transfer id decode knows."""

    def __init__(self) -> None:
        self._fans: dict[str, Fan] = {}

    def __len__(self) -> int:
        return len(self._fans)

    def get(self, transfer_id: str) -> Fan | None:
        return self._fans.get(transfer_id)

    def open(self, transfer_id: str, ranks: tuple[int, ...]) -> Fan:
        """Start fanning `transfer_id` out to decode `ranks` (at least two)."""
        if len(ranks) < 2:
            raise ValueError(f"a fan-out needs at least two decode ranks, got {ranks}")
        if transfer_id in self._fans:
            raise ValueError(f"transfer {transfer_id} fans out already")
        fan = Fan(tuple(sorted(ranks)))
        self._fans[transfer_id] = fan
        return fan

    def legs(self, transfer_id: str) -> list[str]:
        """The leg ids of `transfer_id` (just the id itself when it does not fan out)."""
        fan = self._fans.get(transfer_id)
        if fan is None:
            return [transfer_id]
        return [leg_id(transfer_id, rank) for rank in fan.ranks]

    def feed(self, local: LocalBlocks) -> list[LocalBlocks]:
        """The prefill of a fanned-out transfer finished: the same blocks, once per leg."""
        fan = self._fans[local.transfer_id]
        if fan.local is not None:
            raise ValueError(f"prefill of transfer {local.transfer_id} was reported done twice")
        fan.local, fan.holding = local, len(fan.ranks)
        return [
            LocalBlocks(leg_id(local.transfer_id, rank), local.request_id, local.block_ids,
                        local.num_tokens, local.sampled)
            for rank in fan.ranks
        ]  # fmt: skip

    def released(self, leg: str) -> LocalBlocks | None:
        """A leg let go of the blocks; the prefill's own `LocalBlocks` when it was the last
        (free them now), else None. The fan is forgotten then."""
        transfer_id, rank = split_leg(leg)
        fan = self._fans.get(transfer_id)
        if rank is None or fan is None or fan.local is None or fan.holding <= 0:
            raise ValueError(f"{leg!r} is no leg holding blocks")
        fan.holding -= 1
        if fan.holding:
            return None
        del self._fans[transfer_id]
        return fan.local

    def close_unfed(self, transfer_id: str) -> None:
        """Forget a fan whose prefill never arrived and whose legs all ended."""
        fan = self._fans.get(transfer_id)
        if fan is not None and fan.local is None:
            del self._fans[transfer_id]
