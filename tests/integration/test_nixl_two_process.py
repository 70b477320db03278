"""Real NIXL transfers between two processes (UCX over loopback, DRAM).

The child process plays decode: it owns KV-shaped memory (4 regions x 64 blocks x 16 KiB,
each region its own allocation), registers it, and answers a Hello on a ControlServer. The
parent plays prefill: it handshakes over a ControlClient, WRITEs and READs blocks, and asks
the child (over a multiprocessing pipe) to check every byte of its memory.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl)")

from kvpush.core.planning import KVLayout  # noqa: E402
from kvpush.core.protocol import PROTOCOL_VERSION, Hello, Message, Role  # noqa: E402
from kvpush.dataplane.control import ControlClient, ControlServer, Peer  # noqa: E402
from kvpush.dataplane.transport import NixlTransport, TransferError  # noqa: E402

REGIONS = 4
BLOCKS = 64
BLOCK_TOKENS, HEADS, HEAD_DIM, ELEM = 16, 8, 64, 2
BLOCK_BYTES = BLOCK_TOKENS * HEADS * HEAD_DIM * ELEM  # 16 KiB
BACKGROUND = 0x5A
PARENT, CHILD = "kv-parent", "kv-child"
Mapping = list[tuple[int, int]]  # (source block, destination block)


def pattern(region: int, block: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of source block `block` of `region`: distinct for every block."""
    return np.random.default_rng([region, block]).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def hello(name: str, role: Role, transport: NixlTransport, regions: list[np.ndarray]) -> Hello:
    unit = HEAD_DIM * ELEM
    layout = KVLayout(
        tuple(r.ctypes.data for r in regions),
        BLOCKS,
        BLOCK_TOKENS,
        HEADS,
        unit,
        block_stride=BLOCK_BYTES,
        head_stride=BLOCK_TOKENS * unit,
        token_stride=unit,
        total_heads=HEADS,
    )
    return Hello(
        version=PROTOCOL_VERSION,
        engine_id=name,
        role=role,
        mode="push",
        model="tiny",
        kv_dtype="bfloat16",
        tp_rank=0,
        tp_size=1,
        layout=layout,
        agent_name=name,
        agent_metadata=transport.metadata(),
        memory=tuple((r.ctypes.data, r.nbytes) for r in regions),
    )


def block_pieces(layout: KVLayout) -> list[tuple[int, int]]:
    """(address, length) of every block, region-major: index = region * BLOCKS + block."""
    return [
        (base + b * layout.block_bytes, layout.block_bytes)
        for base in layout.region_bases
        for b in range(layout.num_blocks)
    ]


# The child process


def _child_main(conn: Connection) -> None:
    transport = NixlTransport(CHILD)
    kv = [np.full((BLOCKS, BLOCK_BYTES), BACKGROUND, dtype=np.uint8) for _ in range(REGIONS)]
    transport.register_regions([(r.ctypes.data, r.nbytes) for r in kv])
    me = hello(CHILD, "decode", transport, kv)

    def on_message(msg: Message, peer: Peer) -> Message | None:
        return me if isinstance(msg, Hello) else None

    with ControlServer("127.0.0.1", 0, on_message) as server:
        conn.send(server.port)
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:
                break
            if cmd == "check":
                conn.send(_check(transport, kv, *args))
            elif cmd == "fill":
                for r in range(REGIONS):
                    for b in args[0]:
                        kv[r][b] = pattern(r, b)
                conn.send(True)
            elif cmd == "exit":
                break
    transport.close()


def _check(transport: NixlTransport, kv: list[np.ndarray], mapping: Mapping, notif: bytes) -> str:
    """ "" if `kv` holds exactly the parent's blocks per `mapping` and background elsewhere."""
    if notif:
        deadline = time.monotonic() + 5.0
        seen: list[bytes] = []
        while notif not in seen:
            if time.monotonic() > deadline:
                return f"notification {notif!r} never arrived (got {seen})"
            seen += transport.get_notifs().get(PARENT, [])
            time.sleep(0.001)
    problems = []
    for r in range(REGIONS):
        expected = np.full((BLOCKS, BLOCK_BYTES), BACKGROUND, dtype=np.uint8)
        for src, dst in mapping:
            expected[dst] = pattern(r, src)
        wrong = [b for b in range(BLOCKS) if not np.array_equal(kv[r][b], expected[b])]
        if wrong:
            problems.append(f"region {r}: blocks {wrong} differ")
        kv[r][:] = BACKGROUND
    return "; ".join(problems)


# The parent


@dataclass
class Pair:
    transport: NixlTransport
    child: Any
    conn: Connection
    remote: Hello
    sources: list[np.ndarray]
    landing: list[np.ndarray]

    def call(self, *cmd: Any, timeout: float = 10.0) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"child did not answer {cmd[0]!r} within {timeout} s"
        return self.conn.recv()

    def local_idx(self, blocks: list[int], landing: bool = False) -> list[int]:
        offset = REGIONS * BLOCKS if landing else 0
        return [offset + r * BLOCKS + b for r in range(REGIONS) for b in blocks]

    def remote_idx(self, blocks: list[int]) -> list[int]:
        return [r * BLOCKS + b for r in range(REGIONS) for b in blocks]

    def source_piece(self, region: int, block: int, count: int = 1) -> tuple[int, int]:
        return self.sources[region].ctypes.data + block * BLOCK_BYTES, count * BLOCK_BYTES

    def remote_piece(self, region: int, block: int, count: int = 1) -> tuple[int, int]:
        return self.remote.layout.region_bases[region] + block * BLOCK_BYTES, count * BLOCK_BYTES


def spawn_child() -> tuple[Any, Connection, int]:
    """Start the child; returns it, its pipe and its control port."""
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child_main, args=(child_conn,), daemon=True)
    child.start()
    assert parent_conn.poll(30.0), "child process did not start"
    return child, parent_conn, parent_conn.recv()


def request_hello(port: int, transport: NixlTransport, sources: list[np.ndarray]) -> Hello:
    with ControlClient("127.0.0.1", port, timeout=10.0) as client:
        remote = client.request(hello(PARENT, "prefill", transport, sources))
    assert isinstance(remote, Hello)
    return remote


def connect(pair: Pair, remote: Hello) -> None:
    """Load the child's agent (replacing one of the same name) and prepare its blocks."""
    assert pair.transport.add_peer(remote.agent_metadata, name=remote.agent_name) == CHILD
    local_blocks = block_pieces(hello(PARENT, "prefill", pair.transport, pair.sources).layout)
    local_blocks += block_pieces(hello(PARENT, "prefill", pair.transport, pair.landing).layout)
    pair.transport.prepare_peer_blocks(CHILD, local_blocks, block_pieces(remote.layout))
    pair.remote = remote


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    child, conn, port = spawn_child()
    transport = NixlTransport(PARENT)
    sources = [np.stack([pattern(r, b) for b in range(BLOCKS)]) for r in range(REGIONS)]
    landing = [np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(REGIONS)]
    transport.register_regions([(a.ctypes.data, a.nbytes) for a in sources + landing])
    remote = request_hello(port, transport, sources)
    started = Pair(transport, child, conn, remote, sources, landing)
    connect(started, remote)
    yield started
    if started.child.is_alive():
        started.conn.send(("exit",))
        started.child.join(5.0)
        if started.child.is_alive():
            started.child.kill()
    transport.close()


def test_handshake_used_the_prepared_fast_path(pair: Pair) -> None:
    assert pair.transport.error_handling == "none"
    assert pair.transport.peers() == [CHILD]
    assert pair.remote.layout.block_bytes == BLOCK_BYTES


def test_write_blocks_merged_run(pair: Pair) -> None:
    src, dst = list(range(3, 11)), list(range(20, 28))
    transfer = pair.transport.write_blocks(
        CHILD, pair.local_idx(src), pair.remote_idx(dst), notif=b"run"
    )
    with transfer:
        pair.transport.wait(transfer, timeout=5.0)
        assert transfer.done
    assert pair.call("check", list(zip(src, dst, strict=True)), b"run") == ""


def test_write_blocks_scattered(pair: Pair) -> None:
    src, dst = [1, 5, 9, 33, 60, 61], [62, 7, 40, 2, 11, 12]
    with pair.transport.write_blocks(
        CHILD, pair.local_idx(src), pair.remote_idx(dst), notif=b"scattered"
    ) as transfer:
        pair.transport.wait(transfer, timeout=5.0)
    assert pair.call("check", list(zip(src, dst, strict=True)), b"scattered") == ""


def test_write_pieces(pair: Pair) -> None:
    singles = [(0, 5), (63, 6), (17, 50)]
    local = [pair.source_piece(r, s) for r in range(REGIONS) for s, _ in singles]
    remote = [pair.remote_piece(r, d) for r in range(REGIONS) for _, d in singles]
    # one piece of four consecutive blocks: 40..43 -> 30..33
    local += [pair.source_piece(r, 40, 4) for r in range(REGIONS)]
    remote += [pair.remote_piece(r, 30, 4) for r in range(REGIONS)]
    # as the planned path posts them: [N, 2] uint64 (address, length) rows
    as_rows = np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)
    with pair.transport.write(CHILD, *as_rows, notif=b"pieces") as transfer:
        pair.transport.wait(transfer, timeout=5.0)
    mapping = singles + [(40 + i, 30 + i) for i in range(4)]
    assert pair.call("check", mapping, b"pieces") == ""


def test_write_completes_while_the_target_never_calls_nixl(pair: Pair) -> None:
    """ucx_error_handling_mode=none: the child sits in conn.recv() the whole time."""
    with pair.transport.write_blocks(CHILD, pair.local_idx([2]), pair.remote_idx([3])) as t:
        pair.transport.wait(t, timeout=2.0)
    assert pair.call("check", [(2, 3)], b"") == ""


def test_read_blocks_and_read_pieces(pair: Pair) -> None:
    child_blocks = [8, 9, 10, 44]
    assert pair.call("fill", child_blocks)
    landing = [0, 1, 2, 63]
    with pair.transport.read_blocks(
        CHILD, pair.local_idx(landing, landing=True), pair.remote_idx(child_blocks)
    ) as transfer:
        pair.transport.wait(transfer, timeout=5.0)
    remote = [pair.remote_piece(r, 44) for r in range(REGIONS)]
    local = [(pair.landing[r].ctypes.data + 30 * BLOCK_BYTES, BLOCK_BYTES) for r in range(REGIONS)]
    with pair.transport.read(CHILD, remote, local) as transfer:
        pair.transport.wait(transfer, timeout=5.0)
    for r in range(REGIONS):
        expected = np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        for src, dst in [*zip(child_blocks, landing, strict=True), (44, 30)]:
            expected[dst] = pattern(r, src)
        assert np.array_equal(pair.landing[r], expected), f"region {r}"
        pair.landing[r][:] = 0
    # the child's filled blocks are its own: reset them through the check
    assert pair.call("check", [(b, b) for b in child_blocks], b"") == ""


def test_memory_the_peer_did_not_register_is_refused(pair: Pair) -> None:
    outside = pair.remote.layout.region_bases[0] + BLOCKS * BLOCK_BYTES + (1 << 30)
    with pytest.raises(TransferError) as info:
        pair.transport.write(CHILD, [pair.source_piece(0, 0)], [(outside, BLOCK_BYTES)])
    assert info.value.kind == "not_found", info.value
    assert pair.call("check", [], b"") == ""


def test_empty_transfer_only_notifies(pair: Pair) -> None:
    transfer = pair.transport.write_blocks(CHILD, [], [], notif=b"nothing to move")
    assert transfer.poll()
    assert pair.call("check", [], b"nothing to move") == ""


def test_bad_arguments_are_value_errors(pair: Pair) -> None:
    with pytest.raises(ValueError, match="pair up"):
        pair.transport.write_blocks(CHILD, [0, 1], [0])
    with pytest.raises(ValueError, match="outside"):
        pair.transport.write_blocks(CHILD, [0], [REGIONS * BLOCKS])
    with pytest.raises(ValueError, match="length"):
        pair.transport.write(CHILD, [(pair.sources[0].ctypes.data, 8)], [(0, 16)])
    base = pair.sources[0].ctypes.data
    rows = np.array([[base, 8], [base + 8, 8]], dtype=np.uint64)
    with pytest.raises(ValueError, match="piece 1: local length 8 != remote length 16"):
        pair.transport.write(CHILD, rows, np.array([[0, 8], [8, 16]], dtype=np.uint64))
    with pytest.raises(ValueError, match="pair up"):
        pair.transport.read(CHILD, rows[:1], rows)
    with pytest.raises(TransferError, match="unknown peer") as info:
        pair.transport.write_blocks("nobody", [0], [0])
    assert info.value.kind == "not_found"


def test_measure_write_latency_and_throughput(pair: Pair) -> None:
    transport = pair.transport

    def timed(local: list[int], remote: list[int], runs: int) -> float:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            with transport.write_blocks(CHILD, local, remote) as transfer:
                transport.wait(transfer, timeout=5.0)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    one = timed([0], [0], 200)
    everything = list(range(BLOCKS))
    merged = timed(pair.local_idx(everything), pair.remote_idx(everything), 20)
    scattered = timed(pair.local_idx(everything), pair.remote_idx(everything[::-1]), 20)
    total = REGIONS * BLOCKS * BLOCK_BYTES
    print(
        f"\nNIXL WRITE, 2 processes, loopback: one 16 KiB block {one * 1e6:.0f} us; "
        f"{total >> 20} MiB as {REGIONS * BLOCKS} blocks: merged runs {merged * 1e3:.2f} ms "
        f"({total / merged / 1e9:.1f} GB/s), reversed (no merging) {scattered * 1e3:.2f} ms "
        f"({total / scattered / 1e9:.1f} GB/s) (medians)"
    )
    assert pair.call("check", [(b, BLOCKS - 1 - b) for b in everything], b"") == ""


def test_concurrent_use_from_two_threads(pair: Pair) -> None:
    """A writer thread and a notification poller share one agent (strict sync mode)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def poll_notifications() -> None:
        while not stop.is_set():
            try:
                pair.transport.get_notifs()
            except BaseException as exc:
                errors.append(exc)
                return

    poller = threading.Thread(target=poll_notifications)
    poller.start()
    try:
        for i in range(300):
            block = i % BLOCKS
            with pair.transport.write_blocks(
                CHILD, pair.local_idx([block]), pair.remote_idx([block])
            ) as transfer:
                pair.transport.wait(transfer, timeout=5.0)
    finally:
        stop.set()
        poller.join()
    assert errors == []
    assert pair.call("check", [(b, b) for b in range(BLOCKS)], b"") == ""


def test_a_removed_peer_stays_loaded_until_its_transfers_are_released(pair: Pair) -> None:
    """Unloading an agent frees what its requests use: `remove_peer` defers it while a
    request to the peer is held, refuses new transfers at once, and unloads on release."""
    transport = pair.transport
    nixl = transport._agent
    transfer = transport.write_blocks(CHILD, pair.local_idx([12]), pair.remote_idx([13]))
    transport.wait(transfer, timeout=5.0)  # complete, but the request is not released yet
    transport.remove_peer(CHILD)
    assert transport.peers() == [] and transport.loaded_peers() == [CHILD]
    assert nixl.check_remote_metadata(CHILD), "not unloaded under a request"
    with pytest.raises(TransferError, match="unknown peer"):
        transport.write_blocks(CHILD, pair.local_idx([0]), pair.remote_idx([0]))
    # A handshake repeated with the same process takes the agent back as it is...
    assert transport.add_peer(pair.remote.agent_metadata, name=CHILD) == CHILD
    assert transport.peers() == [CHILD]
    transport.remove_peer(CHILD)
    # ...new metadata under that name waits until the old requests are gone.
    with pytest.raises(TransferError, match="new metadata") as info:
        transport.add_peer(pair.remote.agent_metadata + b"?", name=CHILD)
    assert info.value.kind == "not_allowed"
    assert transfer.release()
    assert transport.loaded_peers() == [] and not nixl.check_remote_metadata(CHILD)
    connect(pair, pair.remote)  # loaded again for the tests after this one
    with transport.write_blocks(CHILD, pair.local_idx([14]), pair.remote_idx([15])) as again:
        transport.wait(again, timeout=5.0)
    assert pair.call("check", [(12, 13), (14, 15)], b"") == ""


def test_killed_peer_fails_fast_and_its_restart_can_be_loaded(pair: Pair) -> None:
    pair.child.kill()
    pair.child.join(5.0)
    start = time.monotonic()
    with pytest.raises(TransferError) as info:
        transfer = pair.transport.write_blocks(CHILD, pair.local_idx([1]), pair.remote_idx([1]))
        with transfer:
            pair.transport.wait(transfer, timeout=5.0)
    assert info.value.kind == "remote_disconnect", info.value
    assert time.monotonic() - start < 3.0

    # The same agent name comes back with new metadata (vLLM's restart bug, SPEC 3).
    pair.child, pair.conn, port = spawn_child()
    remote = request_hello(port, pair.transport, pair.sources)
    with pytest.raises(TransferError) as info:
        pair.transport.add_peer(remote.agent_metadata)
    assert info.value.kind == "not_allowed" and "pass its name" in str(info.value)
    connect(pair, remote)
    with pair.transport.write_blocks(
        CHILD, pair.local_idx([4, 5]), pair.remote_idx([6, 7]), notif=b"again"
    ) as transfer:
        pair.transport.wait(transfer, timeout=5.0)
    assert pair.call("check", [(4, 6), (5, 7)], b"again") == ""


def test_falls_back_when_ucx_refuses_the_error_handling_mode(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import nixl._api

    real = nixl._api.nixl_agent.create_backend

    def refuse_mode(self: Any, backend: str, params: dict[str, str]) -> None:
        if "ucx_error_handling_mode" in params:
            raise RuntimeError("unknown parameter")
        real(self, backend, params)

    monkeypatch.setattr(nixl._api.nixl_agent, "create_backend", refuse_mode)
    with NixlTransport("kv-fallback") as transport:
        assert transport.error_handling == "peer"
    assert "refused ucx_error_handling_mode=none" in caplog.text
