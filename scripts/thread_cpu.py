"""CPU time of kvpush's threads per request, on each side, in push and pull.

A prefill and a decode node (`kvpush.node.WorkerSide`) in this one process, with their
real threads, control channel (with a shared secret, the default) and NIXL, as
`tests/integration/test_worker_pair.py` runs them; no vLLM. The script plays the engine
loop and reads every thread's CPU clock (`/proc/self/task`, native threads such as UCX's
included), attributed to the node whose start created it.

Push is split in two phases:
- `registered`: from decode's hand-off until prefill's writer holds the registration.
  On a real server this runs while prefill's forward computes the prompt, on prefill's
  cores: what push adds to that forward.
- `written`: from prefill's finished prefill to both sides reporting the transfer.

    .venv/bin/python scripts/thread_cpu.py                 # both modes, 300 requests
    .venv/bin/python scripts/thread_cpu.py --mode push -n 50 --blocks 1024 --layers 64 \\
        --heads 1 --unit 16       # 16k tokens, 64 regions: a long prompt on a GPU layout

One process, both nodes: pin it (`taskset -c 0`) to see the costs as one core pays them.
Known limits of the one-process pair: with UCX's TCP transport (`UCX_TLS=tcp`) push WRITEs
of more than ~300 KB fail there (UCX reports the connection reset), and now and then with
shared memory too; and on some hosts every push WRITE over CMA (`process_vm_writev`, which
UCX picks for host memory between processes) fails with an I/O error when both agents are
in one process. The same WRITEs between two processes arrive. So unless `UCX_TLS` is set,
the script leaves CMA out (`UCX_TLS=^cma`), and it stops with an error instead of printing
numbers when any transfer failed: those would be the cost of failing, not of moving KV.
On that host (2026-12-06) only the testbed's own shape (2 KV heads) moved its KV in one
process: `--heads 8` failed every transfer with `^cma`, `sm`, `posix,sysv,self` and with
TCP added, or crashed, at 4 and at 16 blocks. Real models' shapes need the pair in two
processes (as tests/integration/test_nixl_two_process.py runs it), which this script is not.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpush.core.protocol import grant  # noqa: E402
from kvpush.node.config import KvpushConfig  # noqa: E402
from kvpush.node.context import Identity  # noqa: E402
from kvpush.node.push import PushWriter  # noqa: E402
from kvpush.node.specs import RecvSpec, SendSpec  # noqa: E402
from kvpush.node.worker import WorkerSide  # noqa: E402
from tests.node_kv import KVMemory, free_port  # noqa: E402

BLOCK_SIZE = 16
SECRET = os.urandom(32)  # both nodes share it, as a deployment does


def tasks() -> dict[int, str]:
    """This process's threads: native id -> name (Python's, else the kernel's)."""
    named = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            out[tid] = named.get(tid) or Path(f"/proc/{tid}/comm").read_text().strip()
        except OSError:
            continue  # ended meanwhile
    return out


def cpu_ns(tid: int) -> int:
    """CPU time of thread `tid` (Linux's per-thread CPU clock id for a native id)."""
    try:
        return time.clock_gettime_ns((~tid << 3) | 6)
    except OSError:
        return 0  # ended meanwhile


class Ledger:
    """CPU per thread of each node, summed over the measured requests, per phase."""

    def __init__(self) -> None:
        self.owner: dict[int, tuple[str, str]] = {}  # tid -> (node, thread name)
        self.phases: dict[str, collections.Counter[tuple[str, str]]] = {}

    def adopt(self, node: str, before: set[int]) -> None:
        """Threads that appeared since `before` belong to `node`."""
        for tid, name in tasks().items():
            if tid not in before and tid not in self.owner:
                self.owner[tid] = (node, name)

    def snapshot(self) -> dict[int, int]:
        return {tid: cpu_ns(tid) for tid in self.owner}

    def add(self, phase: str, start: dict[int, int], end: dict[int, int]) -> None:
        counter = self.phases.setdefault(phase, collections.Counter())
        for tid, owner in self.owner.items():
            counter[owner] += end.get(tid, 0) - start.get(tid, 0)


def start_node(
    role: str, mode: str, shape: argparse.Namespace, ledger: Ledger
) -> tuple[WorkerSide, KVMemory]:
    before = set(tasks())
    worker = WorkerSide(
        KvpushConfig(mode=mode, port=free_port(), secret=SECRET),
        Identity(f"{role}-0", role, "tiny", 0, 1),
    )
    heads = shape.heads
    kv = KVMemory.make(shape.layers, shape.blocks + 1, heads, BLOCK_SIZE, shape.unit, heads, 1)
    worker.start(kv.layout, kv.memory, "bfloat16")
    ledger.adopt(role, before)
    return worker, kv


def registered(prefill: WorkerSide) -> bool:
    """Whether prefill's push writer holds a registration that waits for its prefill."""
    writer = prefill.part
    assert isinstance(writer, PushWriter)
    return writer.rendezvous.waiting_registrations > 0


def until(done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.0002)


def measure(mode: str, requests: int, warm: int, shape: argparse.Namespace) -> Ledger:
    ledger = Ledger()
    prefill, _ = start_node("prefill", mode, shape, ledger)
    decode, _ = start_node("decode", mode, shape, ledger)
    blocks = shape.blocks
    sent: set[str] = set()
    arrived: set[str] = set()
    num_tokens = blocks * BLOCK_SIZE
    ids = tuple(range(1, blocks + 1))

    failed: set[str] = set()  # transfers whose KV did not arrive

    def step() -> bool:
        """One engine step of each server: collect what finished; whether decode reported
        blocks whose KV did not arrive."""
        for side, mine in ((prefill, sent), (decode, arrived)):
            side.hand_off((), (), ())
            done_sending, done_recving = side.get_finished()
            mine |= done_sending | done_recving
        return bool(decode.get_block_ids_with_load_errors())

    try:
        for i in range(warm + requests):
            tid, p_req, d_req = f"t{i}", f"p{i}", f"d{i}"
            recv = RecvSpec(
                transfer_id=tid,
                request_id=d_req,
                block_ids=ids,
                num_tokens=num_tokens,
                first_token=0,
                prefill_host="127.0.0.1",
                prefill_port=prefill.port,
                prefill_tp=1,
                generation=0,
                remote_block_ids=ids,
                remote_num_tokens=num_tokens,
                remote_engine_id="prefill-0",
                remote_grant=grant(SECRET, "prefill-0", tid, ids, num_tokens, 1),
            )
            send = SendSpec(tid, p_req, ids, num_tokens)
            a = ledger.snapshot()
            if mode == "push":  # decode registers while prefill computes
                decode.hand_off((recv,), (), ())
                until(lambda: registered(prefill), "the registration")
                b = ledger.snapshot()
                prefill.hand_off((), (send,), ())
            else:  # pull: decode hears of the request once prefill is done
                b = a
                prefill.hand_off((), (send,), ())
                decode.hand_off((recv,), (), ())

            def both_done(p_req: str = p_req, d_req: str = d_req, tid: str = tid) -> bool:
                if step():  # one transfer at a time: the errors are this one's
                    failed.add(tid)
                return p_req in sent and d_req in arrived

            until(both_done, f"transfer {tid}")
            time.sleep(0.002)  # let the last messages land
            c = ledger.snapshot()
            if i == warm - 1:  # pools start lazily; the kernel cannot say whose they are
                ledger.adopt("either", set(ledger.owner))
            if i >= warm:
                ledger.add("registered", a, b)
                ledger.add("written", b, c)
    finally:
        prefill.shutdown()
        decode.shutdown()
    if failed:
        raise SystemExit(
            f"{mode}: {len(failed)} of {warm + requests} transfers failed (their errors are "
            "logged above), so no numbers: they would be the cost of failing. A one-process "
            "pair's known limits are in this script's docstring; try another UCX_TLS "
            "(e.g. UCX_TLS=sm) or a smaller shape"
        )
    return ledger


def report(mode: str, ledger: Ledger, requests: int) -> None:
    phases = ["registered", "written"] if mode == "push" else ["written"]
    print(f"\n{mode}: kvpush thread CPU per request, microseconds")
    print(f"  {'node':9s} {'thread':24s}" + "".join(f"{p:>12s}" for p in phases))
    totals: collections.Counter[tuple[str, str]] = collections.Counter()
    for p in phases:
        totals.update(ledger.phases[p])
    for node in ("prefill", "decode", "either"):
        rows = sorted(k for k in totals if k[0] == node and totals[k] / requests >= 500)
        for key in rows:
            cells = "".join(f"{ledger.phases[p][key] / requests / 1e3:12.1f}" for p in phases)
            print(f"  {node:9s} {key[1]:24s}{cells}")
        sums = "".join(
            f"{sum(v for k, v in ledger.phases[p].items() if k[0] == node) / requests / 1e3:12.1f}"
            for p in phases
        )
        print(f"  {node:9s} {'(all threads)':24s}{sums}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("push", "pull", "both"), default="both")
    parser.add_argument("-n", "--requests", type=int, default=300)
    parser.add_argument("--warm", type=int, default=20, help="requests before measuring")
    parser.add_argument("--blocks", type=int, default=16, help="KV blocks per request")
    parser.add_argument("--layers", type=int, default=2, help="KV regions (layers)")
    parser.add_argument("--heads", type=int, default=2, help="KV heads (1: dense blocks)")
    parser.add_argument("--unit", type=int, default=256, help="bytes of K and V per head")
    args = parser.parse_args()
    if "UCX_TLS" not in os.environ:  # before NIXL starts UCX (docstring: CMA in one process)
        os.environ["UCX_TLS"] = "^cma"
        print("UCX_TLS=^cma (CMA fails between two agents of one process on some hosts)")
    for mode in ("push", "pull") if args.mode == "both" else (args.mode,):
        report(mode, measure(mode, args.requests, args.warm, args), args.requests)


if __name__ == "__main__":
    main()
