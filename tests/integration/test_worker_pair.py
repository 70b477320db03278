"""A prefill and a decode node (`kvpush.node`) in one process: real threads, control
channel and NIXL transfers (UCX over loopback) on KV memory laid out as vLLM's CPU backend
lays it out, without vLLM at all (`tests/node_kv.py`).

The tests play the engine loop: they hand the workers the metadata the scheduler would
build and collect `get_finished` the way vLLM does every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl)")

from kvpush.core.protocol import Hello, Message  # noqa: E402
from kvpush.dataplane.control import ControlServer, Peer  # noqa: E402
from kvpush.node.config import KvpushConfig  # noqa: E402
from kvpush.node.context import Identity  # noqa: E402
from kvpush.node.faults import Faults  # noqa: E402
from kvpush.node.specs import AbortSpec, HoldSpec, RecvSpec, SendSpec  # noqa: E402
from kvpush.node.worker import WorkerSide  # noqa: E402
from tests.node_kv import KVMemory, free_port  # noqa: E402

LAYERS, BLOCKS, HEADS, UNIT = 2, 16, 2, 256  # UNIT: K and V of 64 bf16 values
PREFILL_BLOCKS = (5, 6, 7)
NUM_TOKENS = 10


def kv_cache(block_size: int, seed: int | None, tp: int = 1) -> KVMemory:
    """A TP rank's KV memory: random bytes (a seed) or zeros."""
    return KVMemory.make(LAYERS, BLOCKS, HEADS // tp, block_size, UNIT, HEADS, seed)


def tokens(cache: KVMemory, blocks: tuple[int, ...], n: int) -> np.ndarray:
    """The first `n` tokens of every layer: [layer, token, head, K and V bytes]."""
    return cache.tokens(blocks, n)


@dataclass
class Step:
    """What one engine step's metadata brings the node."""

    recv: list[RecvSpec | HoldSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    aborted: list[AbortSpec] = field(default_factory=list)


@dataclass
class Side:
    worker: WorkerSide
    cache: KVMemory
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)

    def step(self, meta: Step | None = None) -> None:
        """One engine step's worth of connector calls."""
        meta = meta or Step()
        self.worker.hand_off(meta.recv, meta.send, meta.aborted)
        sending, recving = self.worker.get_finished()
        self.sending |= sending
        self.recving |= recving
        self.load_errors |= self.worker.get_block_ids_with_load_errors()


@dataclass
class Pair:
    prefill: Side
    decode: Side

    def run_until(self, done: object, timeout: float = 10.0) -> float:
        """Step both sides until `done()` is true; returns the seconds it took."""
        assert callable(done)
        started = time.monotonic()
        while not done():
            assert time.monotonic() - started < timeout, "timed out"
            self.prefill.step()
            self.decode.step()
            time.sleep(0.001)
        return time.monotonic() - started

    def start(self, transfer_id: str) -> None:
        """Prefill finishes and decode allocates blocks for `transfer_id`, in one step."""
        self.prefill.step(Step(send=[send_spec(transfer_id)]))
        self.decode.step(Step(recv=[self.recv_spec(transfer_id=transfer_id)]))

    def recv_spec(self, block_ids: tuple[int, ...] = (1, 9, 3), **over: object) -> RecvSpec:
        fields: dict[str, object] = {
            "transfer_id": "t1",
            "request_id": "d1",
            "block_ids": block_ids,
            "num_tokens": NUM_TOKENS,
            "prefill_host": "127.0.0.1",
            "prefill_port": self.prefill.worker.port,
            "prefill_tp": 1,
            "generation": 0,
            "remote_block_ids": PREFILL_BLOCKS,
            "remote_num_tokens": NUM_TOKENS,
        }
        fields.update(over)
        return RecvSpec(**fields)  # type: ignore[arg-type]


def start_side(
    role: str,
    mode: str,
    block_size: int,
    seed: int | None,
    tp: tuple[int, int] = (0, 1),
    port: int = 0,
    faults: str = "",
    pp: tuple[int, int] = (0, 1),
    **config: float,
) -> Side:
    worker = WorkerSide(
        KvpushConfig(
            mode=mode,
            port=port or free_port(),
            faults=Faults.parse(faults),
            **config,  # type: ignore[arg-type]
        ),
        Identity(f"{role}-0", role, "tiny", *tp, pp_rank=pp[0], pp_size=pp[1]),
    )
    cache = kv_cache(block_size, seed, tp[1])
    worker.start(cache.layout, cache.memory, "bfloat16")
    return Side(worker, cache)


@pytest.fixture
def pair_factory() -> Iterator[object]:
    made: list[Pair] = []

    def make(
        prefill_mode: str = "pull",
        decode_mode: str = "pull",
        decode_block_size: int = 4,
        faults: str = "",
        prefill_stage: tuple[int, int] = (0, 1),
        **config: float,
    ) -> Pair:
        pair = Pair(
            start_side(
                "prefill", prefill_mode, 4, seed=1, faults=faults, pp=prefill_stage, **config
            ),
            start_side("decode", decode_mode, decode_block_size, None, faults=faults, **config),
        )
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.decode.worker.shutdown()
        pair.prefill.worker.shutdown()


def arrived_whole(pair: Pair) -> None:
    """Step until decode reports t1 (into blocks 1, 9, 3) and prefill its blocks: the KV
    arrived, byte for byte as prefill's."""
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert pair.decode.load_errors == set()
    moved = tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)
    assert np.array_equal(moved, tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS))


def send_spec(transfer_id: str = "t1") -> SendSpec:
    return SendSpec(transfer_id, "p1", PREFILL_BLOCKS, NUM_TOKENS)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("decode_block_size", [4, 8], ids=["same-shape", "planned"])
def test_kv_arrives_byte_exact_and_prefill_frees_its_blocks(
    pair_factory: object, mode: str, decode_block_size: int
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode, decode_block_size)
    decode_blocks = (1, 9, 3) if decode_block_size == 4 else (1, 9)
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[pair.recv_spec(decode_blocks)]))
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert pair.decode.recving == {"d1"} and pair.prefill.sending == {"p1"}
    assert pair.decode.load_errors == set()
    moved = tokens(pair.decode.cache, decode_blocks, NUM_TOKENS)
    assert np.array_equal(moved, tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS))
    # transfer metrics are recorded by the side that initiates: prefill WRITEs, decode READs
    initiator = pair.decode if mode == "pull" else pair.prefill
    data = initiator.worker.stats_data()
    assert len(data["bytes"]) == 1 and len(data["read_s" if mode == "pull" else "write_s"]) == 1
    decode_data = data if mode == "pull" else pair.decode.worker.stats_data()
    assert len(decode_data["wait_s"]) == 1 and not decode_data["failures"]
    assert pair.prefill.worker.stats_data()["gauges"]["prefill_held_blocks"] == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("decode_block_size", [4, 8], ids=["same-shape", "planned"])
def test_a_decode_prefix_hit_gets_only_the_uncached_tail(
    pair_factory: object, mode: str, decode_block_size: int
) -> None:
    """Decode's prefix cache holds the first block; only the rest moves, into the blocks
    allocated for it, and decode's cached block is left alone."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode, decode_block_size)
    cached, tail = 11, (9, 3) if decode_block_size == 4 else (9,)
    first_token = decode_block_size
    pair.decode.cache.array[:, cached] = 7
    before = pair.decode.cache.array.copy()
    pair.prefill.step(Step(send=[send_spec()]))
    spec = pair.recv_spec(tail, first_token=first_token)
    pair.decode.step(Step(recv=[spec]))
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert pair.decode.load_errors == set()
    blocks = (cached, *tail)
    moved = tokens(pair.decode.cache, blocks, NUM_TOKENS)
    want = tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS)
    assert np.array_equal(moved[:, first_token:], want[:, first_token:])
    assert np.array_equal(pair.decode.cache.array[:, cached], before[:, cached]), "cache kept"
    initiator = pair.decode if mode == "pull" else pair.prefill
    (moved_bytes,) = initiator.worker.stats_data()["bytes"]
    per_token = LAYERS * HEADS * UNIT
    assert moved_bytes >= (NUM_TOKENS - first_token) * per_token
    assert moved_bytes < NUM_TOKENS * per_token


def test_pull_prefill_refuses_a_push_decode_naming_both_modes(pair_factory: object) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory("pull", "push")
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    took = pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert took < 2.0
    assert pair.decode.load_errors == {1, 9, 3}, "decode's request fails"
    assert pair.prefill.sending == {"p1"}, "prefill frees its blocks at once, not at lease end"
    prefill = pair.prefill.worker.stats_data()
    assert prefill["failures"] == {"incompatible_peer": 1}
    decode = pair.decode.worker.stats_data()["failures"]
    assert decode == {"incompatible_peer": 1, "receive_failed": 1}


def test_pull_decode_refuses_a_push_prefill_at_the_handshake(
    pair_factory: object, caplog: pytest.LogCaptureFixture
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "pull", lease_s=0.5)
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    took = pair.run_until(lambda: pair.decode.recving)
    assert took < 2.0 and pair.decode.load_errors == {1, 9, 3}
    messages = [r.getMessage() for r in caplog.records]
    assert any("runs in push mode, local in pull mode" in m for m in messages), messages
    assert any("runs in pull mode, local in push mode" in m for m in messages), messages
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"incompatible_peer": 1, "receive_failed": 1}
    pair.run_until(lambda: pair.prefill.sending)  # its lease for a registration ends


def test_pull_lease_expires_when_no_decode_reads(pair_factory: object) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory(lease_s=0.3)
    pair.prefill.step(Step(send=[send_spec()]))
    took = pair.run_until(lambda: pair.prefill.sending)
    assert 0.25 < took < 2.0
    assert pair.prefill.worker.stats_data()["gauges"]["prefill_leases"] == 0


def test_pull_read_after_the_lease_ended_fails_instead_of_using_reused_blocks(
    pair_factory: object,
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory(lease_s=0.2)
    pair.prefill.step(Step(send=[send_spec()]))
    pair.run_until(lambda: pair.prefill.sending)
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    pair.run_until(lambda: pair.decode.recving)
    assert pair.decode.load_errors == {1, 9, 3}


def test_pull_decode_renews_the_lease_while_it_waits(pair_factory: object) -> None:
    assert callable(pair_factory)
    # Renewals every 0.5 s; the margins are wide because this machine's load is noisy.
    pair: Pair = pair_factory(lease_s=1.0, transfer_timeout_s=10.0)
    receiver, keeper = pair.decode.worker.part, pair.prefill.worker.part
    assert receiver is not None and keeper is not None
    # Hold decode's handshakes back (a slow first contact), so no READ starts for 2.5 s.
    gates = [receiver.peers.handshakes.submit(time.sleep, 2.5) for _ in range(2)]
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    pair.run_until(lambda: pair.decode.recving, timeout=10.0)
    assert all(gate.done() for gate in gates)
    assert pair.decode.load_errors == set(), "renewals kept the 1 s lease alive"
    with keeper.lock:
        assert keeper.leases.stats.renewed >= 2
    pair.run_until(lambda: pair.prefill.sending)
    moved = tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)
    assert np.array_equal(moved, tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS))


def hold_spec(pair: Pair, transfer_id: str = "t1") -> HoldSpec:
    return HoldSpec(transfer_id, "d1", "127.0.0.1", pair.prefill.worker.port, 1)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("held", [True, False], ids=["held", "not-held"])
def test_a_request_waiting_for_decode_blocks_past_the_lease_keeps_prefill_kv(
    pair_factory: object, mode: str, held: bool
) -> None:
    """Decode's KV cache is full: a request from prefill waits there for blocks, longer
    than prefill's lease. Held (decode renews every half lease), its KV arrives whole once
    it has blocks; not held (what kvpush did before), prefill frees it at the lease end
    and the request fails (lease_lost in pull, no registration in time in push)."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode, lease_s=0.6, transfer_timeout_s=10.0)
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[hold_spec(pair)] if held else []))
    waited_until = time.monotonic() + 1.8  # three leases
    pair.run_until(lambda: time.monotonic() > waited_until)
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    if not held:
        pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
        assert pair.decode.load_errors == {1, 9, 3}
        return
    arrived_whole(pair)
    for side in (pair.decode, pair.prefill):
        assert side.worker.stats_data()["failures"] == {}
    gauges = pair.decode.worker.stats_data()["gauges"]
    assert gauges["decode_requests_without_blocks"] == 0


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_request_that_ends_before_it_had_blocks_stops_its_renewals(
    pair_factory: object, mode: str
) -> None:
    """Held, then ended (the client left) before decode had blocks: prefill frees its KV at
    once, and decode stops renewing."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode, lease_s=5.0)
    receiver = pair.decode.worker.part
    assert receiver is not None
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[hold_spec(pair)]))
    pair.run_until(lambda: receiver.gauges()["decode_requests_without_blocks"] == 1)
    abort = AbortSpec("t1", "d1", "127.0.0.1", pair.prefill.worker.port, 1)
    pair.decode.step(Step(aborted=[abort]))
    took = pair.run_until(lambda: pair.prefill.sending)
    assert took < 2.0, "freed by decode's message, not at prefill's 5 s lease end"
    assert receiver.gauges()["decode_requests_without_blocks"] == 0


def test_pull_decode_abort_reports_the_request_and_frees_prefill(pair_factory: object) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory()
    # a first transfer makes the peers known to each other
    pair.prefill.step(Step(send=[SendSpec("t0", "p0", (1, 2, 3), NUM_TOKENS)]))
    first = pair.recv_spec(transfer_id="t0", request_id="d0", remote_block_ids=(1, 2, 3))
    pair.decode.step(Step(recv=[first]))
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    pair.prefill.step(Step(send=[send_spec()]))
    # decode's request ends before its READ is even posted
    pair.decode.step(Step(recv=[pair.recv_spec()], aborted=[AbortSpec("t1", "d1")]))
    took = pair.run_until(lambda: "d1" in pair.decode.recving and "p1" in pair.prefill.sending)
    assert took < 2.0, "prefill freed its blocks on decode's ReadDone, not at lease end"
    assert pair.decode.load_errors == set()


def test_push_decode_abort_frees_its_blocks_once_prefill_confirms(pair_factory: object) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", prefill_timeout_s=5.0)
    # decode registers and its request ends before prefill finished
    pair.decode.step(Step(recv=[pair.recv_spec()], aborted=[AbortSpec("t1", "d1")]))
    took = pair.run_until(lambda: pair.decode.recving)
    assert took < 2.0, "prefill's acknowledgement frees the blocks, not the 5 s deadline"
    assert pair.decode.load_errors == set()
    assert pair.decode.worker.stats_data()["failures"] == {}, "an abort is not a failure"
    pair.prefill.step(Step(send=[send_spec()]))
    pair.run_until(lambda: pair.prefill.sending)  # decode gave up: freed at once
    assert np.count_nonzero(tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)) == 0


def test_push_decode_registers_only_with_the_engine_its_params_name(pair_factory: object) -> None:
    """The control port decode was sent to belongs to prefill-0, but the request names a
    data-parallel engine of it (the proxy's dp= or engine= wrong for that server): decode
    fails the request at once, registering nothing that would pair with the wrong prefill;
    with the engine named right the KV arrives."""
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", prefill_timeout_s=5.0)
    pair.decode.step(Step(recv=[pair.recv_spec(remote_engine_id="prefill-0_dp1")]))
    took = pair.run_until(lambda: pair.decode.recving)
    assert took < 2.0 and pair.decode.load_errors == {1, 9, 3}
    assert pair.decode.worker.stats_data()["failures"] == {"wrong_engine": 1, "receive_failed": 1}
    gauges = pair.prefill.worker.stats_data()["gauges"]
    assert gauges["prefill_waiting_registrations"] == 0, "nothing was registered"
    pair.decode.recving.clear()
    pair.decode.load_errors.clear()
    right = pair.recv_spec(transfer_id="t2", generation=1, remote_engine_id="prefill-0")
    pair.decode.step(Step(recv=[right]))
    pair.prefill.step(Step(send=[send_spec("t2")]))
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert pair.decode.load_errors == set()
    moved = tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)
    assert np.array_equal(moved, tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_takes_KV_only_from_the_prefill_ranks_its_params_describe(
    pair_factory: object, mode: str
) -> None:
    """The prefill rank at the port decode was sent to is stage 0 of two pipeline stages,
    but kv_transfer_params say one stage (the proxy's pp= left out): decode fails the
    request at once, taking nothing from it, instead of counting one stage's layers as the
    whole KV."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode, prefill_stage=(0, 2), prefill_timeout_s=5.0)
    if mode == "pull":
        pair.prefill.step(Step(send=[send_spec("t1")]))
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    took = pair.run_until(lambda: pair.decode.recving)
    assert took < 2.0 and pair.decode.load_errors == {1, 9, 3}
    stats = pair.decode.worker.stats_data()
    assert stats["failures"] == {"wrong_engine": 1, "receive_failed": 1}
    if mode == "push":
        gauges = pair.prefill.worker.stats_data()["gauges"]
        assert gauges["prefill_waiting_registrations"] == 0, "nothing was registered"
    else:
        assert not stats["bytes"], "nothing was read"


def test_push_abort_during_a_write_waits_for_the_write_to_end(pair_factory: object) -> None:
    """The blocks of an aborted request are reported (so vLLM reuses them) only after the
    WRITE in flight into them ended: nothing lands in reassigned blocks."""
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", faults="delay_write=1.0", transfer_timeout_s=5.0)
    pair.start("t1-fault-delay_write")
    writer = pair.prefill.worker.part
    assert writer is not None
    pair.run_until(lambda: len(writer.inflight) == 1)  # the WRITE is posted
    pair.decode.step(Step(aborted=[AbortSpec("t1-fault-delay_write", "d1")]))
    took = pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert 0.7 < took < 3.0, "reported only once the write in flight ended"
    assert pair.decode.load_errors == set()


def test_push_timeout_fails_the_request_once_prefill_confirms(pair_factory: object) -> None:
    """A lost registration: decode fails at its deadline; prefill's answer to the cancel
    releases decode's blocks right after, and the cancel frees prefill's blocks."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(
        "push", "push", faults="drop_registration", prefill_timeout_s=0.5, lease_s=5.0
    )
    pair.start("t1-fault-drop_registration")
    took = pair.run_until(lambda: pair.decode.recving)
    assert 0.45 < took < 2.0
    assert pair.decode.load_errors == {1, 9, 3}
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"transfer_timeout": 1, "receive_failed": 1}
    took = pair.run_until(lambda: pair.prefill.sending)
    assert took < 2.0, "decode's cancel freed prefill's blocks, not prefill's 5 s lease end"


def test_push_waits_for_a_prefill_queued_past_the_transfer_timeout(pair_factory: object) -> None:
    """Decode registers as the request arrives; prefill may hold it in its queue far longer
    than a transfer takes. A prefill that finishes after `transfer_timeout_s` but within
    `prefill_timeout_s` still hands its KV over, byte for byte, with nothing failed."""
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", transfer_timeout_s=0.3, prefill_timeout_s=10.0)
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    receiver, writer = pair.decode.worker.part, pair.prefill.worker.part
    assert receiver is not None and writer is not None
    pair.run_until(lambda: writer.rendezvous.waiting_registrations == 1)
    queued_until = time.monotonic() + 1.0  # prefill's queue, then its forward
    pair.run_until(lambda: time.monotonic() > queued_until)
    assert not pair.decode.recving, "decode still waits: 1 s is past the transfer timeout only"
    pair.prefill.step(Step(send=[send_spec()]))
    arrived_whole(pair)
    for side in (pair.decode, pair.prefill):
        assert side.worker.stats_data()["failures"] == {}


def test_push_prefill_forgets_arrival_times_of_registrations_never_written(
    pair_factory: object,
) -> None:
    from kvpush.core.protocol import Registration
    from kvpush.node.inbox import Registered

    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", prefill_timeout_s=0.5)
    writer = pair.prefill.worker.part
    decode = pair.decode.worker.ctx
    assert writer is not None and decode is not None

    def reg(transfer_id: str) -> Registered:
        registration = Registration(
            transfer_id, "r", "decode-0", decode.hello.host, decode.hello.port, 0, 1, (1,), 4,
            0, 500, agent_name=decode.hello.agent_name,
        )  # fmt: skip
        return Registered(registration, decode.hello, 1)

    writer.inbox.put((reg("old"), time.monotonic() - 5.0))
    writer.inbox.put((reg("new"), time.monotonic()))
    pair.run_until(lambda: ("new", 0) in writer.registered_at)
    assert list(writer.registered_at) == [("new", 0)]


def test_push_nixl_error_fails_the_request_at_once(pair_factory: object) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", faults="nixl_error", transfer_timeout_s=10.0)
    pair.start("t1-fault-nixl_error")
    took = pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert took < 2.0 and pair.decode.load_errors == {1, 9, 3}
    assert pair.prefill.worker.stats_data()["failures"] == {"write_failed": 1}
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"prefill_failed": 1, "receive_failed": 1}
    # the next transfer is served normally
    pair.decode.recving.clear()
    pair.prefill.sending.clear()
    pair.start("t2")
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert pair.decode.load_errors == {1, 9, 3}, "no new load errors"


def test_push_failed_write_still_brings_decode_prefills_first_token(pair_factory: object) -> None:
    """For a decode that computes the prompt itself after the failure (vLLM's
    kv_load_failure_policy "recompute"): its first step must still sample prefill's token,
    which the client may already have."""
    from kvpush.node.sampled import SAMPLED

    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", faults="nixl_error", transfer_timeout_s=10.0)
    transfer_id = "t9-fault-nixl_error"
    spec = SendSpec(transfer_id, "p1", PREFILL_BLOCKS, NUM_TOKENS, sampled=421)
    pair.prefill.step(Step(send=[spec]))
    pair.decode.step(Step(recv=[pair.recv_spec(transfer_id=transfer_id)]))
    pair.run_until(lambda: pair.decode.recving)
    assert pair.decode.load_errors == {1, 9, 3}
    assert SAMPLED.get(transfer_id) == 421


def test_push_write_that_never_completes_is_cancelled_at_the_transfer_timeout(
    pair_factory: object,
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", faults="delay_write=30", transfer_timeout_s=0.6)
    pair.start("t1-fault-delay_write")
    took = pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert 0.5 < took < 3.0
    assert pair.decode.load_errors == {1, 9, 3}
    assert pair.prefill.worker.stats_data()["failures"] == {"write_timeout": 1}


def test_pull_read_posted_late_moves_nothing_before_it_is_due(pair_factory: object) -> None:
    """The delay_post test hook: decode's READ counts as in flight from the start, but no
    byte of it moves until it is posted; then it completes byte-exact."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(faults="delay_post=0.6", transfer_timeout_s=5.0)
    pair.start("t1-fault-delay_post")
    receiver = pair.decode.worker.part
    assert receiver is not None
    pair.run_until(lambda: len(receiver.inflight) == 1)  # the READ counts as in flight
    quiet_until = time.monotonic() + 0.3
    pair.run_until(lambda: time.monotonic() > quiet_until)
    assert not pair.decode.recving
    assert np.count_nonzero(tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)) == 0
    took = pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert took < 3.0 and pair.decode.load_errors == set()
    moved = tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)
    assert np.array_equal(moved, tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS))


def test_pull_read_posted_after_its_deadline_times_out_from_the_start(
    pair_factory: object,
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory(faults="delay_post=30", transfer_timeout_s=0.6)
    pair.start("t1-fault-delay_post")
    took = pair.run_until(lambda: pair.decode.recving)
    assert 0.5 < took < 3.0, "the timeout runs from when the READ counted as in flight"
    assert pair.decode.load_errors == {1, 9, 3}
    assert pair.decode.worker.stats_data()["failures"].get("transfer_timeout") == 1


def test_pull_read_given_up_keeps_the_blocks_past_the_fence_until_it_ends(
    pair_factory: object,
) -> None:
    """A READ decode gave up at its deadline that has not ended when the fence runs out
    (over TCP: the link down longer than fence_s) may still land, whole: decode reports the
    request, so that vLLM reuses its blocks, only once the READ ended, however late. Here
    the test hook holds the READ's completion 2 s: deadline 0.4 s, fence 0.4 s."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(faults="delay_write=2.0", transfer_timeout_s=0.4, fence_s=0.4)
    pair.start("t1-fault-delay_write")
    receiver = pair.decode.worker.part
    assert receiver is not None
    past_fence = time.monotonic() + 1.2
    pair.run_until(lambda: time.monotonic() > past_fence)
    assert not pair.decode.recving, "the blocks went back while the READ could still land"
    assert receiver.gauges()["decode_fenced_transfers"] == 1
    took = pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert took + 1.2 > 1.9, "reported once the READ ended, 2 s after it was posted"
    assert pair.decode.load_errors == {1, 9, 3}
    assert receiver.gauges()["decode_fenced_transfers"] == 0
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"transfer_timeout": 1, "receive_failed": 1, "read_outlived_fence": 1}


def test_push_prefill_that_stays_silent_is_fenced_then_released_by_time(
    pair_factory: object,
) -> None:
    """A 'prefill' that accepts frames and never answers (a frozen process): decode fails at
    its deadline, and reuses the blocks only fence_s later."""
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", prefill_timeout_s=0.4, fence_s=0.8)
    received: list[Message] = []

    def silent(msg: Message, peer: Peer) -> Message | None:
        received.append(msg)  # answers the handshake, then nothing
        return pair.prefill.worker.ctx.hello if isinstance(msg, Hello) else None

    with ControlServer("127.0.0.1", 0, silent) as frozen:
        spec = pair.recv_spec(prefill_port=frozen.port)
        pair.decode.step(Step(recv=[spec]))
        took = pair.run_until(lambda: pair.decode.recving)
    assert 1.1 < took < 3.0, "deadline 0.4 s + fence 0.8 s"
    assert pair.decode.load_errors == {1, 9, 3}
    assert [type(m).__name__ for m in received] == ["Hello", "Registration", "Cancel"]
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"transfer_timeout": 1, "receive_failed": 1, "fence_timeout": 1}


def test_push_prefill_that_exits_fails_its_transfers_before_their_deadline(
    pair_factory: object,
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", prefill_timeout_s=20.0)
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    receiver = pair.decode.worker.part
    assert receiver is not None
    pair.run_until(lambda: "t1" in receiver.expecting and receiver.expecting["t1"].connections)
    pair.prefill.worker.shutdown()  # closes its control server, as an exiting process does
    took = pair.run_until(lambda: pair.decode.recving)
    assert took < 3.0, "the liveness watch, not the 20 s deadline"
    assert pair.decode.load_errors == {1, 9, 3}
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"peer_gone": 1, "receive_failed": 1}


def test_push_decode_restarted_on_the_same_address_is_handshaken_again(
    pair_factory: object,
) -> None:
    """Prefill notices that decode's control connection closed and handshakes with the new
    process before writing, so the first transfer after the restart already succeeds. Here
    decode goes away in the middle of a WRITE, whose WriteDone then finds nobody."""
    assert callable(pair_factory)
    pair: Pair = pair_factory("push", "push", faults="delay_write=0.5")
    pair.start("t1-fault-delay_write")
    writer = pair.prefill.worker.part
    assert writer is not None
    pair.run_until(lambda: len(writer.inflight) == 1)  # the WRITE is posted
    port = pair.decode.worker.port
    pair.decode.worker.shutdown()
    pair.run_until(lambda: pair.prefill.sending)
    assert pair.prefill.worker.stats_data()["failures"] == {"peer_gone": 1}
    pair.decode = start_side("decode", "push", 4, None, port=port)
    pair.prefill.sending.clear()
    pair.start("t2")
    arrived_whole(pair)


def test_decode_request_that_ends_before_it_got_blocks_frees_prefill_at_once(
    pair_factory: object,
) -> None:
    assert callable(pair_factory)
    for mode in ("push", "pull"):
        pair: Pair = pair_factory(mode, mode, lease_s=30.0)
        pair.start("t0")  # a first transfer: the two know each other
        pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)  # noqa: B023
        pair.prefill.sending.clear()
        pair.prefill.step(Step(send=[send_spec()]))
        port = pair.prefill.worker.port
        abort = AbortSpec("t1", "d1", "127.0.0.1", port, 1)
        pair.decode.step(Step(aborted=[abort]))
        took = pair.run_until(lambda: pair.prefill.sending)  # noqa: B023
        assert took < 2.0, f"{mode}: not at the 30 s lease end"
        receiver = pair.decode.worker.part
        assert receiver is not None
        time.sleep(0.2)  # prefill's answer (pull) has arrived by now
        for peer in receiver.peers.peers.values():
            assert peer.hello is None or peer.client.alive(peer.connection), "kept"


def test_pull_decode_reads_nothing_with_coordinates_prefill_did_not_grant(
    pair_factory: object,
) -> None:
    """With a secret, prefill signs the blocks it leased; decode refuses coordinates that
    were forged or altered on the way before it reads anything."""
    from kvpush.core.protocol import grant

    assert callable(pair_factory)
    secret = b"pair-secret"
    pair: Pair = pair_factory(secret=secret)  # type: ignore[arg-type]
    pair.prefill.step(Step(send=[send_spec()]))
    genuine = grant(secret, "prefill-0", "t1", PREFILL_BLOCKS, NUM_TOKENS, 1)
    forged = pair.recv_spec(remote_block_ids=(5, 6, 8), remote_grant=genuine)
    pair.decode.step(Step(recv=[forged]))
    took = pair.run_until(lambda: pair.decode.recving)
    assert took < 2.0 and pair.decode.load_errors == {1, 9, 3}
    assert np.count_nonzero(tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)) == 0
    failures = pair.decode.worker.stats_data()["failures"]
    assert failures == {"bad_grant": 1, "receive_failed": 1}
    # the genuine coordinates are read
    pair.decode.recving.clear()
    granted = pair.recv_spec(
        transfer_id="t1",
        generation=1,
        remote_engine_id="prefill-0",
        remote_grant=genuine,
    )
    pair.decode.load_errors.clear()
    pair.decode.step(Step(recv=[granted]))
    pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)
    assert pair.decode.load_errors == set(), "the forged read left the genuine lease alone"
    assert pair.decode.worker.stats_data()["failures"] == {}
    moved = tokens(pair.decode.cache, (1, 9, 3), NUM_TOKENS)
    assert np.array_equal(moved, tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS))


def test_pull_decode_with_twice_the_tp_reads_its_heads_and_frees_prefill_after_both(
    pair_factory: object,
) -> None:
    assert callable(pair_factory)
    pair: Pair = pair_factory()  # prefill TP 1; its decode (TP 1) stays idle
    port = free_port()
    ranks = [start_side("decode", "pull", 4, None, tp=(r, 2), port=port) for r in (0, 1)]
    try:
        for side in ranks:
            side.step(Step(recv=[pair.recv_spec()]))
        pair.prefill.step(Step(send=[send_spec()]))
        started = time.monotonic()
        while not (all(side.recving for side in ranks) and pair.prefill.sending):
            assert time.monotonic() - started < 10, "timed out"
            for side in (pair.prefill, *ranks):
                side.step()
            time.sleep(0.001)
        source = tokens(pair.prefill.cache, PREFILL_BLOCKS, NUM_TOKENS)
        for rank, side in enumerate(ranks):
            assert side.load_errors == set()
            heads = source[:, :, rank : rank + 1]
            assert np.array_equal(tokens(side.cache, (1, 9, 3), NUM_TOKENS), heads)
        assert pair.prefill.worker.stats_data()["gauges"]["prefill_leases"] == 0
    finally:
        for side in ranks:
            side.worker.shutdown()


def test_a_peer_that_went_away_is_forgotten_so_the_next_transfer_handshakes_again(
    pair_factory: object,
) -> None:
    from kvpush.dataplane.transport import TransferError

    assert callable(pair_factory)
    pair: Pair = pair_factory()
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[pair.recv_spec()]))
    pair.run_until(lambda: pair.decode.recving)
    receiver = pair.decode.worker.part
    assert receiver is not None
    peers = receiver.peers
    peer = peers.get("127.0.0.1", pair.prefill.worker.port)
    assert peer.hello is not None
    peers.lost(peer, TransferError("timeout", "slow"))
    assert peers.get("127.0.0.1", pair.prefill.worker.port) is peer, "only a vanished peer"
    peers.lost(peer, TransferError("remote_disconnect", "gone"))
    fresh = peers.get("127.0.0.1", pair.prefill.worker.port)
    assert fresh is not peer and fresh.hello is None


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_restarted_peer_s_old_nixl_agent_is_unloaded(pair_factory: object, mode: str) -> None:
    """The side that loads the other's agent (prefill in push, decode in pull) keeps exactly
    one across restarts of the other: each restart's old agent is unloaded from NIXL."""
    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode)
    # push: prefill writes and loads decode's agent; pull: decode reads, loads prefill's
    loader, restarted = ("prefill", "decode") if mode == "push" else ("decode", "prefill")
    old_agents: list[str] = []
    for i in range(4):
        pair.prefill.sending.clear()
        pair.decode.recving.clear()
        pair.start(f"t{i}")
        pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)  # noqa: B023
        assert pair.decode.load_errors == set()
        transport = getattr(pair, loader).worker.transport
        other = getattr(pair, restarted).worker
        assert other.ctx is not None
        assert transport.loaded_peers() == [other.ctx.hello.agent_name], f"round {i}"
        for name in old_agents:
            assert not transport._agent.check_remote_metadata(name), f"{name} still loaded"
        old_agents.append(other.ctx.hello.agent_name)
        port = other.port
        other.shutdown()
        seed = 1 if restarted == "prefill" else None
        setattr(pair, restarted, start_side(restarted, mode, 4, seed, port=port))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kv_moves_with_a_secret_inside_mutual_tls(
    pair_factory: object, mode: str, tmp_path: object
) -> None:
    """The settings reach every connection: the control server and every peer's client
    use the secret's proof and TLS with the node's certificate."""
    pytest.importorskip("cryptography")
    from pathlib import Path

    from tests.control_peers import issue

    assert callable(pair_factory) and isinstance(tmp_path, Path)
    files = issue(tmp_path, "ca", "node")
    pair: Pair = pair_factory(
        mode,
        mode,
        secret=b"pair-secret",
        tls_cert=files.cert,
        tls_key=files.key,
        tls_ca=files.ca,
    )
    for side in (pair.prefill, pair.decode):
        server = side.worker.server
        assert server is not None and server.tls is not None and server.secret == b"pair-secret"
    if mode == "pull":
        from kvpush.core.protocol import grant

        genuine = grant(b"pair-secret", "prefill-0", "t1", PREFILL_BLOCKS, NUM_TOKENS, 1)
        spec = pair.recv_spec(remote_grant=genuine, remote_engine_id="prefill-0")
    else:
        spec = pair.recv_spec()
    pair.prefill.step(Step(send=[send_spec()]))
    pair.decode.step(Step(recv=[spec]))
    arrived_whole(pair)
    for side in (pair.prefill, pair.decode):
        assert side.worker.stats_data()["rejected"] == {}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_transfers_after_idle_connections_were_replaced_succeed(
    pair_factory: object, mode: str
) -> None:
    """Idle timeouts close and replace control connections; the next transfer handshakes
    again where it must and succeeds."""
    from kvpush.dataplane.control import Limits

    assert callable(pair_factory)
    pair: Pair = pair_factory(mode, mode, control=Limits(idle_timeout_s=0.4))
    for i in range(3):
        pair.prefill.sending.clear()
        pair.decode.recving.clear()
        pair.start(f"t{i}")
        pair.run_until(lambda: pair.decode.recving and pair.prefill.sending)  # noqa: B023
        assert pair.decode.load_errors == set(), f"round {i}"
        time.sleep(0.6)  # past both the client's (0.2 s) and the server's (0.4 s) idle limit
    for side in (pair.prefill, pair.decode):
        stats = side.worker.stats_data()
        assert stats["failures"] == {} and stats["rejected"] == {}, stats
