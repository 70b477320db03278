"""The push writer, the lease keeper and the receiver against a fake transport.

Two nodes (`kvpush.node.worker.WorkerSide`) in one process, with their real threads and
control channel on loopback, but an in-process `FakeTransport` instead of NIXL: a WRITE or
READ copies the bytes with memmove when it is polled, and a test can hold it in flight or
make it fail. Fast and deterministic where the NIXL tests (tests/integration) are real;
no vLLM, no NIXL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvpush.core.protocol import Cancel, Hello, LeaseRenew, ReadDone, Registration
from kvpush.core.rendezvous import Rendezvous
from kvpush.dataplane.control import ControlClient, ControlServer
from kvpush.dataplane.transport import Indices, Pieces, TransferError
from kvpush.node.config import KvpushConfig
from kvpush.node.context import Identity
from kvpush.node.pull import LeaseKeeper
from kvpush.node.push import PushWriter
from kvpush.node.receiver import Receiver
from kvpush.node.specs import RecvSpec, SendSpec
from kvpush.node.worker import WorkerSide, in_process
from kvpush.vllm.metadata import EMPTY_METADATA
from kvpush.vllm.scheduler import SchedulerSide
from tests.node_kv import KVMemory, free_port
from tests.unit.test_vllm_adapter import FakeRequest, vllm_blocks

Piece = tuple[int, int]


@dataclass
class FakeTransfer:
    """Copies its pieces when first polled after `release_at`; or fails with `error`."""

    what: str
    copies: list[tuple[int, int, int]]  # (src, dst, length)
    error: TransferError | None = None
    hold: Callable[[], bool] = lambda: False
    moved: bool = False
    released: bool = False

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
        self.released = True
        return True


def _listed(pieces: Pieces) -> list[Piece]:
    """(address, length) rows as Python ints, as memmove takes them."""
    return [(int(address), int(length)) for address, length in pieces]


@dataclass
class FakeTransport:
    """The part of `NixlTransport` a node uses, copying in-process."""

    fail: TransferError | None = None
    hold: bool = False
    posted: list[FakeTransfer] = field(default_factory=list)
    prepared: dict[str, tuple[list[Piece], list[Piece]]] = field(default_factory=dict)
    cut_from: list[set[str]] = field(default_factory=list)
    refuse_posts: int = 0  # posts refused as the peer's disconnection, as NIXL does
    drop_in_flight: int = 0  # posts that fail in flight as the peer's disconnection

    def add_peer(self, metadata: bytes, name: str | None = None) -> str:
        return name or "peer"

    def remove_peer(self, name: str) -> None:
        self.prepared.pop(name, None)

    def cut_connections_from(self, ips: Collection[str]) -> int:
        self.cut_from.append(set(ips))
        return 0

    def prepare_peer_blocks(
        self,
        peer: str,
        local_blocks: Pieces,
        remote_blocks: Pieces,
        remote_mem: str | None = None,
    ) -> None:
        self.prepared[peer] = (_listed(local_blocks), _listed(remote_blocks))

    def _post(self, what: str, pairs: list[tuple[Piece, Piece]]) -> FakeTransfer:
        if self.refuse_posts:
            self.refuse_posts -= 1
            raise TransferError("remote_disconnect", f"{what}: NIXL_ERR_REMOTE_DISCONNECT")
        copies = []
        for (src, src_len), (dst, dst_len) in pairs:
            assert src_len == dst_len, "pieces pair up with equal lengths"
            copies.append((src, dst, src_len))
        fail = self.fail
        if self.drop_in_flight:
            self.drop_in_flight -= 1
            fail = TransferError("remote_disconnect", f"{what}: NIXL_ERR_REMOTE_DISCONNECT")
        transfer = FakeTransfer(what, copies, fail, lambda: self.hold)
        self.posted.append(transfer)
        return transfer

    def write_blocks(
        self, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes = b""
    ) -> FakeTransfer:
        local, remote = self.prepared[peer]
        pairs = [(local[i], remote[j]) for i, j in zip(local_idx, remote_idx, strict=True)]
        return self._post(f"WRITE to {peer}", pairs)

    def read_blocks(
        self, peer: str, local_idx: Indices, remote_idx: Indices, notif: bytes = b""
    ) -> FakeTransfer:
        local, remote = self.prepared[peer]
        pairs = [(remote[j], local[i]) for i, j in zip(local_idx, remote_idx, strict=True)]
        return self._post(f"READ from {peer}", pairs)

    def write(
        self,
        peer: str,
        src: Pieces,
        dst: Pieces,
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> FakeTransfer:
        return self._post(f"WRITE to {peer}", list(zip(_listed(src), _listed(dst), strict=True)))

    def read(
        self,
        peer: str,
        src_remote: Pieces,
        dst_local: Pieces,
        notif: bytes = b"",
        remote_mem: str | None = None,
    ) -> FakeTransfer:
        pairs = list(zip(_listed(src_remote), _listed(dst_local), strict=True))
        return self._post(f"READ from {peer}", pairs)


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

    def step(self, recv: tuple[RecvSpec, ...] = (), send: tuple[SendSpec, ...] = ()) -> None:
        self.worker.hand_off(recv, send, ())
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


def run_until(pair: tuple[Node, ...], done: Callable[[], bool], timeout: float = 5.0) -> float:
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


def test_push_brings_prefills_first_token_to_decodes_process(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """The token prefill sampled rides on WriteDone, and decode's process has it before the
    transfer counts as arrived (kvpush's logits processor reads it at decode's first step)."""
    from kvpush.node.sampled import SAMPLED

    prefill, decode = nodes("push", 4)
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS, sampled=4242),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3), 0),))
    run_until((prefill, decode), lambda: bool(decode.recving))
    assert SAMPLED.get("t1") == 4242


def test_push_prefill_times_its_share_of_the_handoff(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """`finish_to_write_s`: from vLLM finishing the prefill (the scheduler's clock, which
    the host's processes share) to the WRITE posted; forgotten once the blocks are free.
    `finish_to_handoff_s`: the part before the spec reached kvpush's worker."""
    prefill, decode = nodes("push", 4)
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    finished = time.monotonic() - 0.25
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS, finished_at=finished),))
    run_until((prefill, decode), lambda: bool(prefill.sending and decode.recving))
    data = prefill.worker.stats_data()
    assert len(data["finish_to_write_s"]) == len(data["reg_to_write_s"]) == 1
    assert 0.25 <= data["finish_to_write_s"][0] < 5.0
    assert 0.25 <= data["finish_to_handoff_s"][0] <= data["finish_to_write_s"][0]
    assert not prefill.worker.part.finished_at  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_scheduler_in_the_nodes_process_hands_its_specs_over_at_once(
    nodes: Callable[..., tuple[Node, Node]], mode: str
) -> None:
    """vLLM's in-process executor (one rank) runs the worker in the scheduler's process: a
    finished prefill and decode's allocation reach the nodes in the hooks that decide them,
    and no step's metadata carries them."""
    from vllm.v1.request import RequestStatus

    prefill, decode = nodes(mode)
    assert in_process("prefill-0") is prefill.worker and in_process("decode-0") is decode.worker
    sides = [
        SchedulerSide(
            n.worker.config, engine, is_producer=engine == "prefill-0", local=n.worker.queue
        )
        for n, engine in ((prefill, "prefill-0"), (decode, "decode-0"))
    ]
    prompt = list(range(NUM_TOKENS))
    done = FakeRequest("p1", prompt, {"do_remote_decode": True, "transfer_id": "t1"})
    done.status, done.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, NUM_TOKENS
    delay, coordinates = sides[0].request_finished(done, list(PREFILL_BLOCKS))  # type: ignore[arg-type]
    assert delay and (coordinates is None) == (mode == "push")
    params = {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "remote_host": "127.0.0.1",
        "remote_port": prefill.worker.port,
        "tp_size": 1,
    } | (coordinates or {})
    waiting = FakeRequest("d1", prompt, params)
    assert sides[1].get_num_new_matched_tokens(waiting, 0) == (NUM_TOKENS, True)  # type: ignore[arg-type]
    sides[1].update_state_after_alloc(waiting, vllm_blocks([1, 9, 3]), NUM_TOKENS)  # type: ignore[arg-type]
    assert all(side.build_connector_meta(None) is EMPTY_METADATA for side in sides)
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert decode.recving == {"d1"} and prefill.sending == {"p1"}
    got, want = (
        decode.kv.tokens((1, 9, 3), NUM_TOKENS),
        prefill.kv.tokens(PREFILL_BLOCKS, NUM_TOKENS),
    )
    assert np.array_equal(got, want)
    decode.worker.shutdown()
    assert in_process("decode-0") is None  # a stopped node takes nothing more


def test_a_finished_prefill_reaches_a_worker_in_another_process_before_the_next_step(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """vLLM's multiprocess executor (TP above 1, its CPU backend): the scheduler sends the
    finished prefill to the worker's socket at once (`kvpush.node.direct`), the WRITE runs
    with no engine step, and the copy the next step's metadata brings is dropped."""
    from vllm.v1.request import RequestStatus

    prefill, decode = nodes("push")
    config = dataclasses.replace(prefill.worker.config)
    side = SchedulerSide(config, "prefill-0", is_producer=True)  # no `local`: another process
    assert side.direct is not None
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    done = FakeRequest("p1", list(range(NUM_TOKENS)), params)
    done.status, done.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, NUM_TOKENS
    assert side.request_finished(done, list(PREFILL_BLOCKS)) == (True, None)  # type: ignore[arg-type]
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert np.array_equal(
        decode.kv.tokens((1, 9, 3), NUM_TOKENS), prefill.kv.tokens(PREFILL_BLOCKS, NUM_TOKENS)
    )
    meta = side.build_connector_meta(None)
    assert [s.request_id for s in meta.send] == ["p1"]  # the metadata still carries it
    prefill.step(send=tuple(meta.send))  # dropped before it wakes the writer
    time.sleep(0.05)
    assert prefill.worker.stats_data()["handoffs"] == {"direct": 1}
    assert len(prefill.transport.posted) == 1, "the second copy wrote nothing"
    assert not len(prefill.worker.copies), "both copies came: nothing left to wait for"
    side.direct.close()


def test_a_direct_copy_later_than_the_steps_is_dropped_too(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    prefill, decode = nodes("push")
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    spec = SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS, finished_at=time.monotonic())
    prefill.step(send=(spec,))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert len(prefill.worker.copies) == 1
    prefill.worker._direct(dataclasses.replace(spec, direct=True), time.monotonic())
    assert not len(prefill.worker.copies)
    time.sleep(0.05)
    assert prefill.worker.stats_data()["handoffs"] == {"next_step": 1}
    assert len(prefill.transport.posted) == 1


def test_only_an_engines_single_rank_takes_specs_in_process() -> None:
    """With TP above 1 vLLM runs every rank in a process of its own: specs go by metadata."""
    worker = WorkerSide(
        KvpushConfig(port=free_port()), Identity("prefill-tp", "prefill", "tiny", 0, 2)
    )
    kv = KVMemory.make(LAYERS, BLOCKS, HEADS, 4, UNIT, HEADS, 1)
    worker.start(kv.layout, kv.memory, "bfloat16", transport=FakeTransport())
    try:
        assert in_process("prefill-tp") is None
    finally:
        worker.shutdown()


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
    assert decode.transport.cut_from == [], "no WRITE was under way: no connection to cut"


def _disconnect(transport: FakeTransport, where: str, times: int) -> None:
    """The next `times` WRITEs fail as decode's disconnection, `where` NIXL reports it."""
    if where == "at the post":
        transport.refuse_posts = times
    else:
        transport.drop_in_flight = times


@pytest.mark.parametrize("where", ["at the post", "in flight"])
def test_push_prefill_connects_again_when_decode_cut_the_connection(
    nodes: Callable[..., tuple[Node, Node]], where: str
) -> None:
    """A decode that cut its NIXL connections (a WRITE it gave up) makes prefill's next
    WRITE fail as a disconnection, having landed nothing: refused at the post, or failed in
    flight where prefill's UCX learns of the cut only then. Prefill loads decode's agent
    again and posts once more, and the request does not fail."""
    prefill, decode = nodes("push")
    _disconnect(prefill.transport, where, 1)
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert not decode.load_errors
    posts = 1 if where == "at the post" else 2
    assert len(prefill.transport.posted) == posts
    assert prefill.transport.refuse_posts == prefill.transport.drop_in_flight == 0
    assert prefill.worker.stats_data()["failures"] == {}
    got = decode.kv.tokens((1, 9, 3), NUM_TOKENS)
    assert np.array_equal(got, prefill.kv.tokens(PREFILL_BLOCKS, NUM_TOKENS))


@pytest.mark.parametrize("where", ["at the post", "in flight"])
def test_push_prefill_posts_again_only_once(
    nodes: Callable[..., tuple[Node, Node]], where: str
) -> None:
    prefill, decode = nodes("push")
    _disconnect(prefill.transport, where, 2)  # a decode that really went away
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert decode.load_errors == {1, 9, 3}
    kind = "peer_gone" if where == "at the post" else "write_failed"
    assert prefill.worker.stats_data()["failures"] == {kind: 1}


def test_push_decode_keeps_its_blocks_until_the_write_in_flight_ended(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """The fence: decode gives up at its deadline, but reports the request (and so lets
    vLLM reuse the blocks) only once prefill says no WRITE can land any more."""
    # prefill cancels a WRITE only after its own, longer timeout
    prefill, decode = nodes("push", transfer_timeout_s=0.5, prefill_timeout_s=0.5, fence_s=5.0,
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
    # given up unfinished: over TCP its bytes could still land, so decode cut first
    assert decode.transport.cut_from == [{"127.0.0.1"}]


def test_pull_decode_keeps_its_blocks_until_a_read_it_gave_up_ended(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """A READ's answer lands even once released (over TCP, whenever the link lets it).
    Decode gives up at its deadline but keeps the READ and the blocks it reads into until
    it ended; only then does vLLM get them back, and prefill (which serves the READ until
    then) hear that it may free its KV."""
    prefill, decode = nodes("pull", transfer_timeout_s=0.5, fence_s=5.0)
    decode.transport.hold = True  # the READ's answer is held up (a link down)
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.transport.posted))
    time.sleep(1.0)  # past decode's deadline
    for n in (prefill, decode):
        n.step()
    (read,) = decode.transport.posted
    assert not decode.recving, "blocks given back while the READ's answer may land"
    assert not read.released
    assert decode.worker.stats_data()["failures"].get("transfer_timeout") == 1
    time.sleep(0.2)  # time for a word to prefill, were one sent
    prefill.step()
    assert not prefill.sending, "prefill freed the KV a READ still reads"
    decode.transport.hold = False  # the link is back: the answer lands, in its own blocks
    took = run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert took < 1.0, f"given back {took:.2f} s after the READ ended"
    assert read.moved and read.released and decode.load_errors == {1, 9, 3}
    assert "fence_timeout" not in decode.worker.stats_data()["failures"]


def test_pull_decode_keeps_the_blocks_of_a_read_that_outlives_the_fence(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """A READ that has not ended `fence_s` after the deadline (a link down that long)
    still holds the blocks: its answer would land whenever the link returns. They go back
    when it ends, and the fence running out is counted and shown as fenced."""
    prefill, decode = nodes("pull", transfer_timeout_s=0.5, fence_s=0.5)
    decode.transport.hold = True
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.transport.posted))
    past_fence = time.monotonic() + 1.5
    run_until((prefill, decode), lambda: time.monotonic() > past_fence)
    (read,) = decode.transport.posted
    assert not decode.recving and not read.released, "blocks given back past the fence"
    assert decode.worker.stats_data()["failures"].get("read_outlived_fence") == 1
    receiver = decode.worker.part
    assert receiver is not None and receiver.gauges()["decode_fenced_transfers"] == 1
    # meanwhile nothing more is read from that prefill: it fails fast, holding nothing
    prefill.step(send=(SendSpec("t2", "p2", (2, 4), NUM_TOKENS),))
    t2 = dataclasses.replace(recv_spec(prefill, (5, 6, 7)), transfer_id="t2", request_id="d2")
    decode.step(recv=(t2,))
    run_until((prefill, decode), lambda: "d2" in decode.recving)
    assert len(decode.transport.posted) == 1, "a READ went to the prefill that is cut off"
    assert decode.load_errors == {5, 6, 7}
    assert decode.worker.stats_data()["failures"].get("peer_unreachable") == 1
    decode.transport.hold = False  # the link is back: the answer lands, in its own blocks
    took = run_until((prefill, decode), lambda: bool("d1" in decode.recving and prefill.sending))
    assert took < 1.0, f"given back {took:.2f} s after the READ ended"
    assert read.moved and read.released and decode.load_errors == {1, 9, 3, 5, 6, 7}
    assert receiver.gauges()["decode_fenced_transfers"] == 0
    assert "fence_timeout" not in decode.worker.stats_data()["failures"]
    prefill.step(send=(SendSpec("t3", "p3", (2, 4), NUM_TOKENS),))
    t3 = dataclasses.replace(recv_spec(prefill, (8, 10, 11)), transfer_id="t3", request_id="d3")
    decode.step(recv=(t3,))
    run_until((prefill, decode), lambda: "d3" in decode.recving)
    assert len(decode.transport.posted) == 2 and decode.load_errors == {1, 9, 3, 5, 6, 7}


# -- registrations bind to the incarnation that handshook on their connection ----------


def registration(hello: Hello, transfer_id: str = "t1", **over: object) -> Registration:
    fields: dict[str, object] = {
        "transfer_id": transfer_id,
        "request_id": "d1",
        "engine_id": hello.engine_id,
        "host": hello.host,
        "port": hello.port,
        "tp_rank": hello.tp_rank,
        "tp_size": hello.tp_size,
        "block_ids": (1, 9, 3),
        "num_tokens": NUM_TOKENS,
        "generation": 0,
        "deadline_ms": 5000,
        "agent_name": hello.agent_name,
    }
    fields.update(over)
    return Registration(**fields)  # type: ignore[arg-type]


def writer_state(prefill: Node) -> Rendezvous:
    part = prefill.worker.part
    assert isinstance(part, PushWriter)
    return part.rendezvous


@pytest.mark.parametrize(
    ("handshake", "over", "why"),
    [
        (False, {}, "no handshake"),
        (True, {"agent_name": "decode-0-tp0-00000000"}, "another incarnation"),
        (True, {"port": 1}, "another address"),
        (True, {"engine_id": "decode-9"}, "another engine"),
    ],
)
def test_a_registration_not_bound_to_its_connections_hello_is_dropped(
    nodes: Callable[..., tuple[Node, Node]], handshake: bool, over: dict[str, object], why: str
) -> None:
    prefill, decode = nodes("push")
    assert decode.worker.ctx is not None
    hello = decode.worker.ctx.hello
    with ControlClient("127.0.0.1", prefill.worker.port) as client:
        if handshake:
            assert isinstance(client.request(hello), Hello)
        client.send(registration(hello, **over))
        if handshake:
            client.send(registration(hello, "t2"))  # a bound one behind it is taken
        rejected: dict[str, int] = {}
        deadline = time.monotonic() + 5
        while not rejected.get("unbound_registration"):
            assert time.monotonic() < deadline, why
            time.sleep(0.01)
            for kind, n in prefill.worker.stats_data()["rejected"].items():
                rejected[kind] = rejected.get(kind, 0) + n
        while writer_state(prefill).waiting_registrations < int(handshake):
            assert time.monotonic() < deadline, why
            time.sleep(0.01)
        # read while the connection is open: closing it voids its registrations
        assert rejected == {"unbound_registration": 1}, why
        assert writer_state(prefill).waiting_registrations == int(handshake), why


def test_a_closed_connection_voids_its_registrations(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """A decode that exits (or restarts with the same engine id and port) leaves nothing
    prefill would write into its successor's blocks."""
    prefill, decode = nodes("push")
    assert decode.worker.ctx is not None
    hello = decode.worker.ctx.hello
    with ControlClient("127.0.0.1", prefill.worker.port) as client:
        client.request(hello)
        client.send(registration(hello, deadline_ms=60_000))
        deadline = time.monotonic() + 5
        while writer_state(prefill).waiting_registrations == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 2  # long before the registration's own deadline
    while writer_state(prefill).waiting_registrations:
        assert time.monotonic() < deadline, "still waiting after its connection closed"
        time.sleep(0.01)
    # the prefill finishing now releases its blocks at once, writes nothing
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    run_until((prefill,), lambda: bool(prefill.sending))
    assert prefill.transport.posted == []


@pytest.mark.parametrize("slow", [False, True])
def test_push_decode_progresses_nixl_only_while_told_a_write_is_in_flight(
    nodes: Callable[..., tuple[Node, Node]], slow: bool
) -> None:
    """Over UCX's TCP transport the target's own calls into NIXL move the bytes, but each
    takes the GIL from decode's engine: decode waits without them, and prefill tells it
    (`Writing`) when a WRITE is still in flight a moment after it was posted."""
    prefill, decode = nodes("push")
    receiver = decode.worker.part
    assert isinstance(receiver, Receiver)
    woken: list[set[str]] = []
    receiver.on_target = lambda: woken.append(set(receiver.writing))
    prefill.transport.hold = slow
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    if slow:
        run_until((prefill, decode), lambda: bool(woken))
        assert woken == [{"t1"}], "told once, while the WRITE is in flight"
        prefill.transport.hold = False
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert not decode.load_errors
    assert not receiver.writing, "settled: nothing left to progress for"
    if not slow:
        time.sleep(0.05)
        assert woken == [], "a WRITE done at once is not told: decode never progresses"


def test_pull_prefill_wakes_its_progress_once_it_holds_a_lease(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    prefill, decode = nodes("pull")
    events: list[str] = []
    prefill.worker.part.on_target = lambda: events.append("target")
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert events == ["target"]


def test_pull_prefill_serves_a_silent_decode_past_the_lease_end(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """A lease that expires (its decode silent: a link down, say) keeps prefill's target
    progress running until decode's deadline and fence could have passed: a READ decode
    keeps pending is then served while decode still holds its blocks, not whenever the
    next lease wakes the progress."""
    prefill, _ = nodes("pull", lease_s=0.2, transfer_timeout_s=1.0, fence_s=0.5)
    events: list[str] = []
    part = prefill.worker.part
    part.on_target = lambda: events.append("target")
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    run_until((prefill,), lambda: bool(prefill.sending))  # no READ came: the lease ended
    expired = time.monotonic()
    assert events == ["target", "target"]
    assert expired + 1.0 < part.serve_until <= expired + 1.5


def test_pull_prefill_serves_a_decode_that_renews_a_lease_no_longer_held(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """A decode renews a lease only while it waits for the KV or keeps a READ of it, maybe
    past its fence (the link was down that long): a renewal that comes after the lease
    ended is refused and restarts prefill's target progress, so that READ is served once
    the link is back, not when the next lease wakes the progress."""
    prefill, _ = nodes("pull", lease_s=0.2, transfer_timeout_s=1.0, fence_s=0.5)
    events: list[str] = []
    part = prefill.worker.part
    assert isinstance(part, LeaseKeeper)
    part.on_target = lambda: events.append("target")
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    run_until((prefill,), lambda: bool(prefill.sending))  # the lease ended
    part.serve_until = 0.0  # as long after the lease's end as decode kept its READ
    asked = time.monotonic()
    answer = part.answer(LeaseRenew("t1", 0))
    assert isinstance(answer, Cancel)
    assert events == ["target", "target", "target"]
    assert asked + 1.0 < part.serve_until <= time.monotonic() + 1.5
    part.serve_until = 0.0
    assert isinstance(part.answer(ReadDone("t1", 0, 0, 1, False, "gave up")), Cancel)
    assert part.serve_until == 0.0, "a decode that is done asks nothing more: no progress"


def test_pull_decode_is_told_to_ask_again_until_prefill_leased_the_blocks(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """The READ may finish before prefill's engine loop hands over the lease: prefill then
    answers Wait, never "valid", and confirms once it holds the lease."""
    prefill, decode = nodes("pull")
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    time.sleep(0.3)
    for _ in range(20):
        decode.step()
        time.sleep(0.01)
    assert not decode.recving, "confirmed before prefill leased anything"
    keeper = prefill.worker.part
    assert isinstance(keeper, LeaseKeeper) and keeper.leases.stats.not_yet > 0
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert not decode.load_errors
    got = decode.kv.tokens((1, 9, 3), NUM_TOKENS)
    assert np.array_equal(got, prefill.kv.tokens(PREFILL_BLOCKS, NUM_TOKENS))


def test_pull_decode_reads_nothing_from_another_engine_than_its_coordinates_name(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    prefill, decode = nodes("pull")
    spec = dataclasses.replace(recv_spec(prefill, (1, 9, 3)), remote_engine_id="prefill-7")
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(spec,))
    run_until((prefill, decode), lambda: bool(decode.recving))
    assert decode.load_errors == {1, 9, 3} and decode.transport.posted == []
    assert decode.worker.stats_data()["failures"].get("bad_grant") == 1


def test_push_never_posts_a_write_after_its_registrations_deadline(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    """Decode's fence is safe only if prefill posts no WRITE once decode stopped waiting:
    here loading decode's agent takes longer than the registration's 0.3 s."""
    prefill, decode = nodes("push", prefill_timeout_s=0.3, fence_s=0.5)
    slow_add = prefill.transport.add_peer

    def add_peer(metadata: bytes, name: str | None = None) -> str:
        time.sleep(0.6)
        return slow_add(metadata, name)

    prefill.transport.add_peer = add_peer  # type: ignore[method-assign]
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, 9, 3)),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert prefill.transport.posted == [], "a WRITE after the deadline could land anywhere"
    assert prefill.worker.stats_data()["failures"].get("registration_expired") == 1


def test_push_refuses_block_ids_beyond_decodes_cache_on_the_fast_path(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    prefill, decode = nodes("push")  # same block size: prepared blocks, the fast path
    prefill.step(send=(SendSpec("t1", "p1", PREFILL_BLOCKS, NUM_TOKENS),))
    decode.step(recv=(recv_spec(prefill, (1, BLOCKS + 5, 3)),))
    run_until((prefill, decode), lambda: bool(decode.recving and prefill.sending))
    assert prefill.transport.posted == []
    failures = prefill.worker.stats_data()["failures"]
    assert failures == {"write_failed": 1}, failures


def test_a_cancel_is_acknowledged_at_its_senders_own_address_only(
    nodes: Callable[..., tuple[Node, Node]],
) -> None:
    prefill, decode = nodes("push")
    assert decode.worker.ctx is not None
    hello = decode.worker.ctx.hello
    elsewhere: list[object] = []
    with ControlServer("127.0.0.1", 0, lambda msg, peer: elsewhere.append(msg)) as other:
        with ControlClient("127.0.0.1", prefill.worker.port) as client:
            client.request(hello)
            client.send(registration(hello))
            client.send(Cancel("t1", 0, "gave up", "127.0.0.1", other.port))
            receiver = decode.worker.part
            assert isinstance(receiver, Receiver)
            deadline = time.monotonic() + 5
            while not receiver.arrivals.stats.unexpected:  # the ack: for nothing it waits on
                assert time.monotonic() < deadline, "no acknowledgement at decode's address"
                time.sleep(0.01)
        time.sleep(0.2)
    assert elsewhere == [], "prefill sent to an address a message named"


def test_a_loop_step_that_blocks_is_logged_with_where_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A loop's deadlines fire between steps only: a step stuck in a call (into NIXL, say)
    is named in the log with its stack, once per stall."""
    from kvpush.node import loop as loop_module
    from kvpush.node.results import Results

    class Stuck(loop_module.Loop):
        def next_deadline(self) -> float | None:
            return None

        def handle(self, item: object, at: float) -> None:
            time.sleep(loop_module.STALL_S * 1.8)  # stands in for a call that blocks

        def tick(self) -> None:
            return None

    stuck = Stuck(Results(), "stuck-loop")
    stuck.start()
    try:
        with caplog.at_level("WARNING", logger="kvpush.worker"):
            stuck.enqueue("go")
            time.sleep(loop_module.STALL_S * 2.2)
    finally:
        stuck.stop()
    stalls = [r.getMessage() for r in caplog.records if "one step has run" in r.getMessage()]
    assert len(stalls) == 1, stalls
    assert stalls[0].startswith("stuck-loop:") and "in handle" in stalls[0], stalls[0]


def test_a_peer_slow_to_answer_the_handshake_is_asked_again_within_the_transfer_timeout(
    nodes: Callable[..., tuple[Node, Node]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefill whose control thread is starved (it accepts, never greets) is asked again
    until the transfer timeout has passed, then the handshake fails; a closed port fails at
    once."""
    import socket

    from kvpush.node import peers as peers_module

    _, decode = nodes("push", transfer_timeout_s=2.0)
    peers = decode.worker.part.peers
    monkeypatch.setattr(peers_module, "HELLO_TIMEOUT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.listen(8)
        port = silent.getsockname()[1]
        peer = peers.get("127.0.0.1", port)
        peer.client = ControlClient("127.0.0.1", port, timeout=0.4)
        started = time.monotonic()
        with (
            caplog.at_level("WARNING", logger="kvpush.worker"),
            pytest.raises(ConnectionError, match="timed out"),
        ):
            peers._ask_hello(peer)
        took = time.monotonic() - started
        silent.settimeout(0)
        accepted = 0
        while True:
            try:
                silent.accept()[0].close()
            except BlockingIOError:
                break
            accepted += 1
    assert took >= 1.0, took  # asked again until the 2 s budget had less than 1 s left
    assert took < 15.0, took  # and then gave up (a busy machine stretches each try)
    retries = sum("slow to answer the handshake" in r.getMessage() for r in caplog.records)
    assert retries >= 1 and accepted == retries + 1, (retries, accepted)
    closed = free_port()
    gone = peers.get("127.0.0.1", closed)
    gone.client = ControlClient("127.0.0.1", closed, timeout=0.4)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="nothing listens"):
        peers._ask_hello(gone)
    assert time.monotonic() - started < 5.0
