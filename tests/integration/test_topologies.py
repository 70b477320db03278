"""Heterogeneous topologies, in-process: every rank of a prefill and of a decode instance
with other TP sizes, block sizes or KV-head counts, real threads, control channel and NIXL
transfers (UCX over loopback), no vLLM (`tests/node_kv.py`).

The oracle is the model's KV per global head, sharded the way vLLM shards it (a rank holds
`heads / tp` consecutive heads, or with more ranks than heads one head that `tp / heads`
consecutive ranks replicate). Each prefill rank's memory holds its shard; afterwards each
decode rank must hold exactly its shard, whichever prefill rank sent which head, and every
prefill rank must have freed the request's blocks - promptly, also a rank whose heads no
decode rank reads (a replica), not at the end of its lease.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl)")

from kvpush.core.protocol import grant  # noqa: E402
from kvpush.node.config import KvpushConfig  # noqa: E402
from kvpush.node.context import Identity  # noqa: E402
from kvpush.node.specs import RecvSpec, SendSpec  # noqa: E402
from kvpush.node.worker import WorkerSide  # noqa: E402
from tests.node_kv import KVMemory, free_port  # noqa: E402

LAYERS, BLOCKS, UNIT = 2, 16, 128
NUM_TOKENS = 13
LEASE_S = 30.0  # a rank that waited out its lease would fail the "promptly" bound
SECRET = b"topologies-secret"  # as every deployment runs: proofs, MACs, bound registrations


def shard(rank: int, tp: int, total_heads: int) -> list[int]:
    """The global heads rank `rank` of `tp` holds, as vLLM shards them."""
    if total_heads >= tp:
        per = total_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total_heads)]


@dataclass
class Rank:
    worker: WorkerSide
    kv: KVMemory
    heads: list[int]
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)

    def step(self, recv: tuple[RecvSpec, ...] = (), send: tuple[SendSpec, ...] = ()) -> None:
        self.worker.hand_off(recv, send, ())
        sending, recving = self.worker.get_finished()
        self.sending |= sending
        self.recving |= recving
        self.load_errors |= self.worker.get_block_ids_with_load_errors()


def fill(kv: KVMemory, blocks: tuple[int, ...], values: np.ndarray) -> None:
    """Write `values` [layer, token, head, unit] as the tokens held in `blocks`."""
    size = kv.layout.block_size
    for token in range(values.shape[1]):
        block, offset = blocks[token // size], token % size
        kv.array[:, block, :, offset] = values[:, token]


@pytest.fixture
def instance() -> Iterator[object]:
    made: list[Rank] = []

    def start(
        role: str,
        mode: str,
        tp: int,
        total_heads: int,
        block_size: int,
        port: int,
        only: tuple[int, ...] = (),
        **config: float,
    ) -> list[Rank]:
        """The instance's ranks (`only` these, if given)."""
        settings = {"lease_s": LEASE_S, "transfer_timeout_s": 10.0, "prefill_timeout_s": 10.0}
        settings |= config
        ranks = []
        for rank in only or range(tp):
            heads = shard(rank, tp, total_heads)
            worker = WorkerSide(
                KvpushConfig(mode=mode, port=port, secret=SECRET, **settings),  # type: ignore[arg-type]
                Identity(f"{role}-0", role, "tiny", rank, tp),
            )
            kv = KVMemory.make(LAYERS, BLOCKS, len(heads), block_size, UNIT, total_heads, None)
            worker.start(kv.layout, kv.memory, "bfloat16")
            made.append(Rank(worker, kv, heads))
            ranks.append(made[-1])
        return ranks

    yield start
    for rank in made:
        rank.worker.shutdown()


def recv_spec(prefill: Rank, prefill_tp: int, blocks: tuple[int, ...]) -> RecvSpec:
    return RecvSpec(
        transfer_id="t1",
        request_id="d1",
        block_ids=blocks,
        num_tokens=NUM_TOKENS,
        prefill_host="127.0.0.1",
        prefill_port=prefill.worker.port,
        prefill_tp=prefill_tp,
        generation=0,
        remote_block_ids=PREFILL_BLOCKS,
        remote_num_tokens=NUM_TOKENS,
        remote_engine_id="prefill-0",
        remote_grant=grant(SECRET, "prefill-0", "t1", PREFILL_BLOCKS, NUM_TOKENS, prefill_tp),
    )


def run_until(ranks: list[Rank], done: object, limit: float = LEASE_S / 3) -> None:
    assert callable(done)
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < limit, "timed out"
        for rank in ranks:
            rank.step()
        time.sleep(0.002)


PREFILL_BLOCKS = (3, 4, 5, 6)

CASES = {
    # name: (prefill TP, decode TP, KV heads, prefill block size, decode block size)
    "tp1-to-tp2": (1, 2, 4, 4, 4),  # one prefill rank writes two decode ranks
    "tp2-to-tp1": (2, 1, 4, 4, 4),  # a decode rank gathers from two prefill ranks
    "tp2-to-tp4-2heads": (2, 4, 2, 4, 4),  # decode replicates heads
    "mqa-tp2-to-tp1": (2, 1, 1, 4, 4),  # prefill rank 1's head is a replica nobody reads
    "mqa-tp1-to-tp2": (1, 2, 1, 4, 4),  # both decode ranks want prefill's one head
    "blocks-4-to-8": (1, 1, 4, 4, 8),
    "blocks-8-to-4-tp2-to-tp1": (2, 1, 4, 8, 4),
    "blocks-4-to-8-tp1-to-tp2": (1, 2, 4, 4, 8),
}


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-first", "decode-first"])
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_decode_rank_gets_its_heads_and_every_prefill_rank_frees_its_blocks(
    instance: object, case: str, mode: str, prefill_first: bool
) -> None:
    assert callable(instance)
    prefill_tp, decode_tp, total, prefill_bs, decode_bs = CASES[case]
    prefills: list[Rank] = instance("prefill", mode, prefill_tp, total, prefill_bs, free_port(8))
    decodes: list[Rank] = instance("decode", mode, decode_tp, total, decode_bs, free_port(8))
    model = np.random.default_rng(7).integers(
        0, 256, (LAYERS, NUM_TOKENS, total, UNIT), dtype=np.uint8
    )
    prefill_blocks = tuple(range(3, 3 + -(-NUM_TOKENS // prefill_bs)))
    decode_blocks = tuple(range(9, 9 + -(-NUM_TOKENS // decode_bs)))[::-1]  # out of order
    for rank in prefills:
        fill(rank.kv, prefill_blocks, model[:, :, rank.heads])
    send = SendSpec("t1", "p1", prefill_blocks, NUM_TOKENS)
    recv = RecvSpec(
        transfer_id="t1",
        request_id="d1",
        block_ids=decode_blocks,
        num_tokens=NUM_TOKENS,
        prefill_host="127.0.0.1",
        prefill_port=prefills[0].worker.port,
        prefill_tp=prefill_tp,
        generation=0,
        remote_block_ids=prefill_blocks,
        remote_num_tokens=NUM_TOKENS,
        remote_engine_id="prefill-0",
        remote_grant=grant(SECRET, "prefill-0", "t1", prefill_blocks, NUM_TOKENS, prefill_tp),
    )
    first, second = (prefills, decodes) if prefill_first else (decodes, prefills)
    for rank in first:
        rank.step(send=(send,)) if rank in prefills else rank.step(recv=(recv,))
    time.sleep(0.05)
    for rank in second:
        rank.step(send=(send,)) if rank in prefills else rank.step(recv=(recv,))
    everyone = [*prefills, *decodes]
    started = time.monotonic()
    while not all(r.recving for r in decodes) or not all(r.sending for r in prefills):
        waited = time.monotonic() - started
        assert waited < LEASE_S / 3, (
            f"after {waited:.0f} s: decode ranks done {[bool(r.recving) for r in decodes]}, "
            f"prefill ranks freed {[bool(r.sending) for r in prefills]}"
        )
        for rank in everyone:
            rank.step()
        time.sleep(0.002)
    for index, rank in enumerate(decodes):
        assert rank.load_errors == set(), f"decode rank {index} failed its request"
        got = rank.kv.tokens(decode_blocks, NUM_TOKENS)
        assert np.array_equal(got, model[:, :, rank.heads]), f"decode rank {index} heads"
    for rank in everyone:
        stats = rank.worker.stats_data()
        assert stats["failures"] == {}, stats["failures"]
        gauges = stats["gauges"]
        assert gauges.get("prefill_held_blocks", 0) == 0 and gauges.get("prefill_leases", 0) == 0
        assert gauges.get("prefill_fanned_transfers", 0) == 0


def test_a_decode_rank_that_gives_up_stops_only_its_own_write_of_a_fanned_out_transfer(
    instance: object,
) -> None:
    """Prefill TP 1 writes decode ranks 0 and 1. Rank 1 gives up before the prefill ends:
    its cancel ends its leg alone; rank 0 still gets its heads, and prefill frees the
    blocks once, after both legs ended."""
    assert callable(instance)
    port = free_port(8)
    (prefill,) = instance("prefill", "push", 1, 4, 4, free_port(8))
    (patient,) = instance("decode", "push", 2, 4, 4, port, only=(0,))
    (hasty,) = instance(
        "decode", "push", 2, 4, 4, port, only=(1,), prefill_timeout_s=0.3, fence_s=5.0
    )
    model = np.random.default_rng(3).integers(0, 256, (LAYERS, NUM_TOKENS, 4, UNIT), np.uint8)
    fill(prefill.kv, PREFILL_BLOCKS, model)
    spec = recv_spec(prefill, 1, (9, 10, 11, 12))
    patient.step(recv=(spec,))
    hasty.step(recv=(spec,))
    run_until([patient, hasty], lambda: hasty.recving)  # its ack came: nothing can land
    assert hasty.load_errors == {9, 10, 11, 12}
    assert not patient.recving
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    run_until([prefill, patient, hasty], lambda: patient.recving and prefill.sending)
    assert patient.load_errors == set()
    assert np.array_equal(patient.kv.tokens((9, 10, 11, 12), NUM_TOKENS), model[:, :, :2])
    assert not hasty.kv.array.any(), "nothing written into the rank that gave up"
    assert prefill.worker.stats_data()["gauges"]["prefill_fanned_transfers"] == 0
