"""The push writer, the lease keeper and the receiver against a fake transport.

Two nodes (`kvpush.node.worker.WorkerSide`) in one process, with their real threads and
control channel on loopback, but an in-process `FakeTransport` instead of NIXL: a WRITE or
READ copies the bytes with memmove when it is polled, and a test can hold it in flight or
make it fail. Fast and deterministic where the NIXL tests (tests/integration) are real;
no vLLM, no NIXL.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvpush.dataplane.transport import TransferError
from kvpush.node.config import KvpushConfig
from kvpush.node.context import Identity
from kvpush.node.specs import RecvSpec, SendSpec
from kvpush.node.worker import WorkerSide
from tests.node_kv import KVMemory, free_port

Piece = tuple[int, int]


@dataclass
class FakeTransfer:
    """Copies its pieces when first polled after `release_at`; or fails with `error`."""

    what: str
    copies: list[tuple[int, int, int]]  # (src, dst, length)
    error: TransferError | None = None
    hold: Callable[[], bool] = lambda: False
    moved: bool = False

    def poll(self) -> bool:
        if self.hold():
            return False
        if self.error is not None:
            raise self.error
        if not self.moved:
            for src, dst, length in self.copies:
                ctypes.memmove(dst, src, length)
            self.moved = True
        return True

    def release(self) -> bool:
        return True


@dataclass
class FakeTransport:
    """The part of `NixlTransport` a node uses, copying in-process."""

    fail: TransferError | None = None
    hold: bool = False
    posted: list[FakeTransfer] = field(default_factory=list)
    prepared: dict[str, tuple[list[Piece], list[Piece]]] = field(default_factory=dict)

    def add_peer(self, metadata: bytes, name: str | None = None) -> str:
        return name or "peer"

    def remove_peer(self, name: str) -> None:
        self.prepared.pop(name, None)

    def prepare_peer_blocks(
        self,
        peer: str,
        local_blocks: list[Piece],
        remote_blocks: list[Piece],
        remote_mem: str | None = None,
    ) -> None:
        self.prepared[peer] = (local_blocks, remote_blocks)

    def _post(self, what: str, pairs: list[tuple[Piece, Piece]]) -> FakeTransfer:
        copies = []
        for (src, src_len), (dst, dst_len) in pairs:
            assert src_len == dst_len, "pieces pair up with equal lengths"
            copies.append((src, dst, src_len))
        transfer = FakeTransfer(what, copies, self.fail, lambda: self.hold)
        self.posted.append(transfer)
        return transfer

    def write_blocks(
        self, peer: str, local_idx: list[int], remote_idx: list[int], notif: bytes = b""
    ) -> FakeTransfer:
        local, remote = self.prepared[peer]
        pairs = [(local[i], remote[j]) for i, j in zip(local_idx, remote_idx, strict=True)]
        return self._post(f"WRITE to {peer}", pairs)

    def read_blocks(
        self, peer: str, local_idx: list[int], remote_idx: list[int], notif: bytes = b""
    ) -> FakeTransfer:
        local, remote = self.prepared[peer]
        pairs = [(remote[j], local[i]) for i, j in zip(local_idx, remote_idx, strict=True)]
        return self._post(f"READ from {peer}", pairs)

    def write(
        self,
        peer: str,
        src: list[Piece],
        dst: list[Piece],
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> FakeTransfer:
        return self._post(f"WRITE to {peer}", list(zip(src, dst, strict=True)))

    def read(
        self,
        peer: str,
        src_remote: list[Piece],
        dst_local: list[Piece],
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> FakeTransfer:
        return self._post(f"READ from {peer}", list(zip(src_remote, dst_local, strict=True)))


LAYERS, HEADS, UNIT, BLOCKS = 2, 2, 64, 16
PREFILL_BLOCKS = (5, 6, 7)
NUM_TOKENS = 10


@dataclass
class Node:
    worker: WorkerSide
    kv: KVMemory
    transport: FakeTransport
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)

    def step(
        self, recv: tuple[RecvSpec, ...] = (), send: tuple[SendSpec, ...] = ()
    ) -> None:
        self.worker.start_load_kv(recv, send, ())
        sending, recving = self.worker.get_finished()
        self.sending |= sending
        self.recving |= recving
        self.load_errors |= self.worker.get_block_ids_with_load_errors()


def node(role: str, mode: str, block_size: int, seed: int | None, **config: float) -> Node:
    worker = WorkerSide(
        KvpushConfig(mode=mode, port=free_port(), **config),  # type: ignore[arg-type]
        Identity(f"{role}-0", role, "tiny", 0, 1),
    )
    kv = KVMemory.make(LAYERS, BLOCKS, HEADS, block_size, UNIT, HEADS, seed)
    transport = FakeTransport()
    worker.start(kv.layout, kv.memory, "bfloat16", transport=transport)
    return Node(worker, kv, transport)


@pytest.fixture
def nodes() -> Iterator[Callable[..., tuple[Node, Node]]]:
    made: list[Node] = []

    def make(
        mode: str, decode_block_size: int = 4, prefill: dict[str, float] | None = None,
        **config: float,
    ) -> tuple[Node, Node]:  # fmt: skip
        pair = (
            node("prefill", mode, 4, 1, **(config | (prefill or {}))),
            node("decode", mode, decode_block_size, None, **config),
        )
        made.extend(pair)
        return pair

    yield make
    for n in made:
        n.worker.shutdown()


def recv_spec(prefill: Node, blocks: tuple[int, ...], first_token: int = 0) -> RecvSpec:
    return RecvSpec(
        transfer_id="t1",
        request_id="d1",
        block_ids=blocks,
        num_tokens=NUM_TOKENS,
        first_token=first_token,
        prefill_host="127.0.0.1",
        prefill_port=prefill.worker.port,
        prefill_tp=1,
        generation=0,
        remote_block_ids=PREFILL_BLOCKS,
        remote_num_tokens=NUM_TOKENS,
    )


def run_until(pair: tuple[Node, Node], done: Callable[[], bool], timeout: float = 5.0) -> float:
    started = time.monotonic()
    while not done():
        assert time.monotonic() - started < timeout, "timed out"
        for n in pair:
            n.step()
        time.sleep(0.001)
    return time.monotonic() - started


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("decode_block_size", "first_token"), [(4, 0), (8, 0), (4, 4), (8, 8)])
def test_the_request_arrives_exactly_and_both_sides_report_it(
    nodes: Callable[..., tuple[Node, Node]], mode: str, decode_block_size: int, first_token: int
) -> None:
    prefill, decode = nodes(mode, decode_block_size)
    blocks = (1, 9, 3) if decode_block_size == 4 else (1, 9)
    tail = blocks[first_token // decode_block_size :]
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, tail, first_token),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert decode.recving == {"d1"} and prefill.sending == {"p1"} and not decode.load_errors
    got = decode.kv.tokens(blocks, NUM_TOKENS)[:, first_token:]
    want = prefill.kv.tokens(PREFILL_BLOCKS, NUM_TOKENS)[:, first_token:]
    assert np.array_equal(got, want)
    cached = decode.kv.tokens(blocks, NUM_TOKENS)[:, :first_token]
    assert not cached.any(), "nothing written before first_token"
    initiator = prefill if mode == "push" else decode
    assert len(initiator.transport.posted) == 1


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_failed_transfer_fails_the_request_and_frees_prefill(
    nodes: Callable[..., tuple[Node, Node]], mode: str
) -> None:
    prefill, decode = nodes(mode)
    initiator = prefill if mode == "push" else decode
    initiator.transport.fail = TransferError("failed", "NIXL reported state ERR")
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert decode.load_errors == {1, 9, 3}, "vLLM fails the request through its blocks"
    failures = decode.worker.stats_data()["failures"]
    assert failures.get("receive_failed") == 1, failures


def test_push_decode_keeps_its_blocks_until_the_write_in_flight_ended(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """The fence: decode gives up at its deadline, but reports the request (and so lets
    vLLM reuse the blocks) only once prefill says no WRITE can land any more."""
    # prefill cancels a WRITE only after its own, longer timeout
    prefill, decode = nodes("push", transfer_timeout_s=0.5, fence_s=5.0,
                            prefill={"transfer_timeout_s": 2.5})  # fmt: skip
    prefill.transport.hold = True
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    time.sleep(1.0)  # past decode's deadline, the WRITE still in flight
    for n in (prefill, decode):
        n.step()
    assert not decode.recving, "blocks fenced while a WRITE may land"
    took = run_until((prefill, decode), lambda: bool(decode.recving))
    assert decode.load_errors == {1, 9, 3}
    assert 0.5 < took < 3.0, f"released {took:.2f} s later: when prefill cancelled its WRITE"
