"""What kvpush's connector hooks cost vLLM's engine loop, per step and per request.

A micro-benchmark, not a check of speed: it calls the hooks in the order vLLM's engine
calls them in one step (`build_connector_meta`, `has_pending_push_work` and
`update_connector_output` on the scheduler; `bind_connector_metadata` to
`clear_connector_metadata`, with the stats, on the worker), through `KvpushConnector` as
vLLM holds it and through the `kvpush bench hooks` timer (`kvpush.bench.timed`), and prints
microseconds. Run it with `pytest -s tests/unit/test_hook_cost.py` to see the numbers; its
asserts are only about what the hooks return. No engine, threads or NIXL: the worker's part
is a stub inbox, so what is timed is the hooks' own work.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.bench.timed import HookLedger, timed_class
from kvpush.node.config import KvpushConfig
from kvpush.node.context import Identity
from kvpush.node.results import HookTimer, empty_data
from kvpush.node.specs import RecvSpec
from kvpush.node.worker import WorkerSide
from kvpush.vllm import connector as connector_module
from kvpush.vllm.connector import NOTHING_FINISHED, STATS_EVERY_S, KvpushConnector
from kvpush.vllm.metadata import EMPTY_METADATA
from kvpush.vllm.scheduler import SchedulerSide
from tests.unit.test_vllm_adapter import FakeRequest, vllm_blocks

STEPS = int(os.environ.get("KVPUSH_HOOK_BENCH_STEPS", "5000"))
REQUESTS = int(os.environ.get("KVPUSH_HOOK_BENCH_REQUESTS", "500"))


class StubPart:
    """The node part's surface the hooks touch: an inbox, and gauges for the stats."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[tuple[object, float]] = queue.SimpleQueue()

    def gauges(self) -> dict[str, float]:
        return {}


@dataclass
class FakeOutput:
    """vLLM's KVConnectorOutput, as far as `update_connector_output` reads it."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None


def connector(cls: type, role: str, timed: bool = False) -> Any:
    """A connector of class `cls` holding one side, built without a vLLM config."""
    conn: Any = object.__new__(cls)
    conn._connector_metadata = None
    if timed:
        conn._kvpush_ledger = HookLedger("scheduler" if role == "scheduler" else "worker")
    if role == "scheduler":
        conn.scheduler = SchedulerSide(KvpushConfig(), "decode-0", is_producer=False)
        conn.worker = None
    else:
        conn.scheduler = None
        conn.worker = WorkerSide(KvpushConfig(), Identity("decode-0", "decode", "tiny", 0, 1))
        conn.worker.part = StubPart()
    return conn


def engine_step(sched: Any, worker: Any, output: FakeOutput) -> Any:
    """One engine step's hooks, in vLLM 0.32's order (scheduler, then worker)."""
    sched.has_pending_push_work()
    meta = sched.build_connector_meta(None)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    done = worker.get_transfer_results(set())
    worker.get_block_ids_with_load_errors()
    worker.get_kv_connector_stats()
    worker.clear_connector_metadata()
    output.finished_sending = done.finished_sending
    output.finished_recving = done.finished_recving
    sched.update_connector_output(output)
    sched.get_kv_connector_stats()
    return done


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    """Best of three runs of `n` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - started)
    return best / n * 1e6


def recv_spec() -> RecvSpec:
    return RecvSpec("t1", "r1", (3, 4), 32, "127.0.0.1", 5600, 1, 0)


def push_request(i: int) -> FakeRequest:
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "transfer_id": f"t{i}",
    }
    return FakeRequest(f"r{i}", list(range(48)), params)


@pytest.mark.parametrize("timed", [False, True], ids=["connector", "bench-hooks-timer"])
def test_hook_cost_per_idle_step(timed: bool) -> None:
    """An engine step with nothing to move: what decode pays at every step it waits."""
    cls = timed_class(KvpushConnector) if timed else KvpushConnector
    sched, worker = connector(cls, "scheduler", timed), connector(cls, "worker", timed)
    output = FakeOutput()
    done = engine_step(sched, worker, output)
    assert not done.finished_sending and not done.finished_recving
    assert worker.worker.part.inbox.empty()

    def scheduler_only() -> None:
        sched.has_pending_push_work()
        sched.build_connector_meta(None)
        sched.update_connector_output(output)
        sched.get_kv_connector_stats()

    meta = sched.build_connector_meta(None)

    def worker_only() -> None:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.get_transfer_results(set())
        worker.get_block_ids_with_load_errors()
        worker.get_kv_connector_stats()
        worker.clear_connector_metadata()

    step = per_call_us(lambda: engine_step(sched, worker, output), STEPS)
    sched_us = per_call_us(scheduler_only, STEPS)
    worker_us = per_call_us(worker_only, STEPS)
    label = "through kvpush.bench.timed" if timed else "KvpushConnector"
    print(
        f"\nidle engine step, {label}: {step:.2f} us in all "
        f"(scheduler {sched_us:.2f} us, worker {worker_us:.2f} us)"
    )
    if timed:  # what `kvpush bench hooks` reports: the timer's own totals per step
        for side in (sched, worker):
            ledger = side._kvpush_ledger
            steps = 1 + 6 * STEPS  # the first step, then three runs of two loops each
            print(
                f"  {ledger.role} hooks as the timer counts them: "
                f"{sum(ledger.seconds.values()) / steps * 1e6:.2f} us per step"
            )


def test_hook_cost_per_push_request() -> None:
    """What one push request adds on decode beyond its steps: matching, allocation, the
    spec shipped and queued, its completion collected, its end."""
    sched, worker = connector(KvpushConnector, "scheduler"), connector(KvpushConnector, "worker")
    output = FakeOutput()
    requests = [push_request(i) for i in range(REQUESTS)]
    part = worker.worker.part
    started = time.perf_counter()
    for req in requests:
        assert sched.get_num_new_matched_tokens(req, 0) == (48, True)
        sched.update_state_after_alloc(req, vllm_blocks([3, 4, 5]), 48)
        engine_step(sched, worker, output)  # the step that ships its RecvSpec
        item, _ = part.inbox.get_nowait()
        assert isinstance(item, RecvSpec) and item.request_id == req.request_id
        worker.worker.results.received(req.request_id)
        done = engine_step(sched, worker, output)  # the step that collects it
        assert done.finished_recving == {req.request_id}
        sched.request_finished(req, [3, 4, 5])
    took = (time.perf_counter() - started) / REQUESTS * 1e6
    print(f"\npush request on decode, 2 engine steps and its own hooks: {took:.2f} us")
    assert not sched.scheduler.has_pending_push_work()


def test_timed_wrapper_counts_nested_hooks_once() -> None:
    """get_transfer_results calls get_finished: the timer counts one call, as before."""
    cls = timed_class(KvpushConnector)
    worker = connector(cls, "worker", timed=True)
    worker.bind_connector_metadata(SimpleNamespace(recv=[], send=[], aborted=[]))
    worker.get_transfer_results(set())
    calls = worker._kvpush_ledger.calls
    assert calls.get("get_transfer_results") == 1 and "get_finished" not in calls


# -- what the fast paths keep: the hooks' semantics ------------------------------------


def test_a_step_with_nothing_to_ship_gets_the_shared_empty_metadata() -> None:
    sched = connector(KvpushConnector, "scheduler")
    first, second = sched.build_connector_meta(None), sched.build_connector_meta(None)
    assert first is second is EMPTY_METADATA
    assert (first.recv, first.send, first.aborted) == ([], [], [])
    req = push_request(1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, vllm_blocks([3, 4, 5]), 48)
    meta = sched.build_connector_meta(None)
    assert meta is not EMPTY_METADATA and [s.request_id for s in meta.recv] == ["r1"]
    assert sched.build_connector_meta(None) is EMPTY_METADATA
    assert EMPTY_METADATA.recv == []  # shipping a spec never touched the shared one


def test_a_step_where_nothing_finished_gets_one_frozen_empty_answer() -> None:
    """Shared, so that such a step allocates nothing; frozen, so that anyone changing it
    fails at once instead of reporting requests into later steps."""
    worker = connector(KvpushConnector, "worker")
    a, b = worker.get_transfer_results(set()), worker.get_transfer_results(set())
    assert a is b is NOTHING_FINISHED
    assert not (a.finished_sending or a.finished_recving or a.failed_recving)
    with pytest.raises(AttributeError):
        a.finished_recving.add("r0")  # type: ignore[attr-defined]
    worker.worker.results.not_received("r1", (7,))
    worker.worker.results.sent("r2")
    done = worker.get_transfer_results(set())
    assert (done.finished_recving, done.finished_sending) == ({"r1"}, {"r2"})
    assert done.failed_recving == set()  # one KV cache group: vLLM takes the blocks
    done.finished_recving.add("mine")  # a step's real sets are its own
    assert worker.get_block_ids_with_load_errors() == {7}
    assert worker.get_transfer_results(set()) is NOTHING_FINISHED
    assert worker.get_block_ids_with_load_errors() == set()


def test_with_several_kv_cache_groups_a_failed_load_is_reported_by_request() -> None:
    """vLLM's hybrid KV cache manager: block ids are per group, and vLLM stops the engine
    on a block-level load error, so the failed request goes in `failed_recving`, in the
    step that reports it received or earlier, and no block is named."""
    worker = connector(KvpushConnector, "worker")
    results = worker.worker.results
    results.by_request = True
    results.not_received("r1", (7, 0, 0, 9))
    results.received("r2")
    done = worker.get_transfer_results(set())
    assert (done.finished_recving, done.failed_recving) == ({"r1", "r2"}, {"r1"})
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.get_transfer_results(set()) is NOTHING_FINISHED


def test_a_step_with_nothing_to_hand_over_touches_no_part() -> None:
    """bind_connector_metadata keeps the metadata (as the base class does) and hands the
    part only what there is: an empty step reaches neither the inbox nor the timer."""

    class Exploding:
        @property
        def inbox(self) -> Any:
            raise AssertionError("an empty step reached the part")

    worker = connector(KvpushConnector, "worker")
    worker.worker.part = Exploding()
    worker.bind_connector_metadata(EMPTY_METADATA)
    assert worker._get_connector_metadata() is EMPTY_METADATA
    assert worker.worker.timer("bind_connector_metadata").calls == 0
    worker.worker.part = StubPart()
    spec = recv_spec()
    worker.bind_connector_metadata(SimpleNamespace(recv=[spec], send=[], aborted=[]))
    assert worker.worker.part.inbox.get_nowait()[0] is spec
    assert worker.worker.timer("bind_connector_metadata").calls == 1


def test_a_step_that_reports_nothing_stays_out_of_the_scheduler_side() -> None:
    sched = connector(KvpushConnector, "scheduler")
    side = sched.scheduler
    req = push_request(1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, vllm_blocks([3, 4, 5]), 48)
    sched.build_connector_meta(None)
    assert req.request_id in side._receiving

    class Refuse:
        def update_connector_output(self, *args: Any) -> None:
            raise AssertionError("an empty output reached the scheduler side")

    sched.scheduler = Refuse()
    sched.update_connector_output(FakeOutput())
    sched.update_connector_output(FakeOutput(set(), set()))
    sched.scheduler = side
    sched.update_connector_output(FakeOutput(finished_recving={req.request_id}))
    assert req.request_id not in side._receiving


def test_stats_carry_transfers_at_once_and_hook_timings_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(connector_module.time, "monotonic", lambda: clock[0])
    worker = connector(KvpushConnector, "worker")
    handing = SimpleNamespace(recv=[recv_spec()], send=[], aborted=[])  # a step with a spec
    worker.bind_connector_metadata(handing)
    first = worker.get_kv_connector_stats()  # the first call sends what the hooks cost
    assert first is not None and first.data["hook_calls"] == {"worker.bind_connector_metadata": 1}
    for _ in range(5):
        worker.bind_connector_metadata(handing)
        assert worker.get_kv_connector_stats() is None  # only timings: held back
    worker.worker.results.observe(bytes=4096.0, write_s=0.001)
    news = worker.get_kv_connector_stats()  # a transfer: at once, with the timings so far
    assert news is not None and news.data["bytes"] == [4096.0]
    assert news.data["hook_calls"] == {"worker.bind_connector_metadata": 5}
    worker.bind_connector_metadata(handing)
    assert worker.get_kv_connector_stats() is None
    clock[0] += STATS_EVERY_S
    later = worker.get_kv_connector_stats()
    assert later is not None and later.data["hook_calls"] == {"worker.bind_connector_metadata": 1}
    sched = connector(KvpushConnector, "scheduler")

    def ship(i: int) -> None:  # a step that ships a spec (an empty one is not timed)
        req = push_request(i)
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, vllm_blocks([3, 4, 5]), 48)
        assert sched.build_connector_meta(None) is not EMPTY_METADATA

    ship(1)
    stats = sched.get_kv_connector_stats()
    assert stats is not None and stats.data["hook_calls"]["scheduler.build_connector_meta"] == 1
    ship(2)
    assert sched.get_kv_connector_stats() is None
    clock[0] += STATS_EVERY_S
    assert sched.get_kv_connector_stats() is not None


def test_hook_timer_spans_add_up_and_drain_once() -> None:
    timer = HookTimer("worker")
    span = timer("get_finished")
    assert timer("get_finished") is span
    for _ in range(3):
        with span:
            pass
    data = empty_data()
    timer.drain(data)
    assert data["hook_calls"] == {"worker.get_finished": 3}
    assert data["hook_s"]["worker.get_finished"] >= 0
    again = empty_data()
    timer.drain(again)
    assert again["hook_calls"] == {} and again["hook_s"] == {}


def test_vllm_skips_the_per_layer_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's attention wrapper (`maybe_transfer_kv_layer`) calls wait_for_layer_load and
    save_kv_layer around every layer of every forward while the connector says it has
    metadata; kvpush moves whole requests and says no, so the layers run without them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.model_executor.layers.attention import attention
    from vllm.model_executor.layers.attention import kv_transfer_utils as per_layer

    conn = connector(KvpushConnector, "worker")
    conn.bind_connector_metadata(EMPTY_METADATA)
    calls: list[str] = []
    monkeypatch.setattr(conn, "wait_for_layer_load", lambda name: calls.append("wait"))
    monkeypatch.setattr(conn, "save_kv_layer", lambda *args, **kw: calls.append("save"))
    monkeypatch.setattr(per_layer, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(per_layer, "is_v1_kv_transfer_group", lambda: True)
    monkeypatch.setattr(per_layer, "get_kv_transfer_group", lambda: conn)
    context = (object(), None, None, None)  # metadata present: a real forward
    monkeypatch.setattr(attention, "get_attention_context", lambda name: context)

    @per_layer.maybe_transfer_kv_layer
    def attend(x: int, layer_name: str) -> int:
        return x + 1

    assert attend(1, "model.layers.0.self_attn.attn") == 2
    assert calls == []
    # what any connector with bound metadata gets, and kvpush got before
    monkeypatch.setattr(
        conn, "has_connector_metadata", lambda: KVConnectorBase_V1.has_connector_metadata(conn)
    )
    assert attend(1, "model.layers.0.self_attn.attn") == 2
    assert calls == ["wait", "save"]


def test_specs_reach_the_threads_before_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's model runner calls start_load_kv only after the step's forward (async loads);
    kvpush hands a step's specs over when vLLM binds the metadata, before the forward, so
    a finished prefill's push never waits for the next prefill's forward. Run through
    vLLM's own per-step context, with the forward as the body."""
    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

    conn = connector(KvpushConnector, "worker")
    monkeypatch.setattr(mixin, "get_kv_transfer_group", lambda: conn)
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    sched = connector(KvpushConnector, "scheduler")
    req = push_request(1)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, vllm_blocks([3, 4, 5]), 48)
    output = SimpleNamespace(kv_connector_metadata=sched.build_connector_meta(None))
    output.has_sync_kv_loads = False
    output.finished_req_ids = set()
    inbox = conn.worker.part.inbox
    calls: list[str] = []
    monkeypatch.setattr(conn, "start_load_kv", lambda *a, **kw: calls.append("start_load_kv"))
    with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(output):
        seen_in_forward = [inbox.get_nowait()[0].request_id for _ in range(inbox.qsize())]
        assert calls == []  # vLLM has not called start_load_kv yet
    assert calls == ["start_load_kv"]  # it does, after the forward
    assert seen_in_forward == ["r1"]
