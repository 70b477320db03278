"""The hook timer wraps any connector class; nested hooks count once; ledgers add up."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvpush.bench import timed
from kvpush.bench.cli import above_floor, cpu_rows, hook_rows, hook_totals, per_hook_rows
from kvpush.bench.compare import RequestResult, SetupReport
from kvpush.bench.null import NULL_PARAMS, NullConnector
from kvpush.proxy.rewrite import Backend, pull_decode_params
from kvpush.testbed.topology import NULL


class FakeConnector:
    def __init__(self, vllm_config: object, role: object, kv_cache_config: object = None):
        self.role = role

    def get_finished(self, ids: set[str]) -> tuple[None, None]:
        time.sleep(0.002)
        return None, None

    def get_transfer_results(self, ids: set[str]) -> object:
        return self.get_finished(ids)  # nested: must not count twice

    def build_connector_meta(self, output: object) -> str:
        return "meta"


def test_timed_class_times_hooks_once_and_writes_a_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPUSH_HOOK_DIR", str(tmp_path))
    cls = timed.timed_class(FakeConnector)
    assert issubclass(cls, FakeConnector) and cls.__name__ == "TimedFakeConnector"
    worker = cls(None, "KVConnectorRole.WORKER")
    worker.get_transfer_results(set())
    worker.get_finished(set())
    scheduler = cls(None, "KVConnectorRole.SCHEDULER")
    assert scheduler.build_connector_meta(None) == "meta"
    ledger = worker._kvpush_ledger
    assert ledger.calls == {"get_transfer_results": 1, "get_finished": 1}
    assert ledger.seconds["get_transfer_results"] >= 0.002
    worker._kvpush_ledger.dump()
    scheduler._kvpush_ledger.dump()
    totals = timed.read_ledgers(tmp_path)
    assert totals["worker"]["calls"] == {"get_transfer_results": 1, "get_finished": 1}
    assert totals["scheduler"]["calls"] == {"build_connector_meta": 1}
    assert json.loads(next(tmp_path.glob("worker-*.json")).read_text())["role"] == "worker"


class BusyConnector(FakeConnector):
    def build_connector_meta(self, output: object) -> str:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:  # runs: its wall time is CPU time
            pass
        return "meta"


def test_with_the_cpu_clock_on_a_waiting_hook_shows_wall_time_without_cpu_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPUSH_HOOK_DIR", str(tmp_path))
    off = timed.timed_class(FakeConnector)(None, "KVConnectorRole.WORKER")
    off.get_finished(set())
    assert off._kvpush_ledger.cpu == {}  # off by default: no CPU clock read
    off._kvpush_ledger.dump()
    assert "cpu" not in json.loads(next(tmp_path.glob("worker-*.json")).read_text())
    monkeypatch.setenv(timed.CPU_ENV, "1")
    worker = timed.timed_class(BusyConnector)(None, "KVConnectorRole.WORKER")
    worker.get_transfer_results(set())  # sleeps in the nested get_finished: counted once
    worker.build_connector_meta(None)
    ledger = worker._kvpush_ledger
    assert set(ledger.cpu) == {"get_transfer_results", "build_connector_meta"}
    # waiting: its 2 ms asleep cost no CPU; what CPU it shows is the calls around the sleep,
    # cold on a first call (0.2 ms once on a loaded CI host), never near the wall time
    assert ledger.seconds["get_transfer_results"] >= 0.002 > 2 * ledger.cpu["get_transfer_results"]
    assert ledger.cpu["build_connector_meta"] >= 0.02
    assert ledger.cpu["build_connector_meta"] <= ledger.seconds["build_connector_meta"] * 1.01
    # the table: wall, CPU and the waiting share per request, decode then prefill
    report = SetupReport("kvpush-push", "ok")
    hooks = {"worker": {"seconds": {"get_finished": 0.004}, "cpu": {"get_finished": 0.001}}}
    clocks = {"worker": {"seconds": {"get_finished": 0.001}, "cpu": {"get_finished": 0.0012}}}
    report.hooks = {"decode-0": hooks, "prefill-0": clocks}
    assert cpu_rows([report, SetupReport("vllm-pull", "stalled")], requests=2) == [
        # prefill: more CPU than wall (the clocks' own readings) is no waiting
        ["kvpush-push", "2.000", "0.500", "75 %", "0.500", "0.600", "0 %"]
    ]


def test_the_costliest_hooks_are_listed_per_server_with_their_calls() -> None:
    report = SetupReport("kvpush-push", "ok")
    report.hooks = {
        "prefill-0": {
            "scheduler": {
                "seconds": {"request_finished": 0.004, "build_connector_meta": 0.0},
                "calls": {"request_finished": 10, "build_connector_meta": 40},
            },
            "worker": {
                "seconds": {"get_finished": 0.001, "bind_connector_metadata": 0.002},
                "calls": {"get_finished": 40, "bind_connector_metadata": 40},
                "cpu": {"get_finished": 0.0005},
            },
        }
    }
    assert per_hook_rows([report], requests=10, top=2) == [
        # most time first; a hook that took none is left out
        ["kvpush-push", "prefill", "scheduler.request_finished", "0.400", "1.0", "400.0", "-"],
        ["kvpush-push", "prefill", "worker.bind_connector_metadata", "0.200", "4.0", "50.0", "-"],
    ]
    (last,) = per_hook_rows([report], requests=10, top=3)[2:]
    assert last[2:] == ["worker.get_finished", "0.100", "4.0", "25.0", "12.5"]
    assert per_hook_rows([SetupReport("vllm-pull", "stalled")], requests=10) == []


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError):
        timed.NotAConnector  # noqa: B018


def test_hook_rows_divide_by_requests_and_steps() -> None:
    ledger = {
        "worker": {
            "seconds": {"start_load_kv": 0.002, "get_finished": 0.002},
            "calls": {"start_load_kv": 100, "get_finished": 100},
        },
        "scheduler": {"seconds": {"build_connector_meta": 0.006}, "calls": {}},
    }
    assert hook_totals(ledger, "worker") == (0.004, 200)
    report = SetupReport("kvpush-push", "ok", results=[RequestResult(0, "x", 2, 0.1, 0.01)])
    report.hooks = {"decode-0": ledger, "prefill-0": ledger}
    (row,) = hook_rows([report], requests=10)
    assert row[:5] == ["kvpush-push", "ok", "1.000", "40.0", "-"]  # no step table: no p50
    assert row[8] == "-"  # no warm-up reading
    ledger["worker"]["steps"] = {str(timed.step_bucket(30e-6)): 99, "60": 1}
    report.hooks_warm_up = {"decode-0": ledger, "prefill-0": ledger}
    (row,) = hook_rows([report], requests=10)
    median = timed.step_quantile(ledger["worker"]["steps"], 0.5)
    assert median is not None and row[4] == row[7] == f"{1e6 * median:.0f}"
    assert 30 <= float(row[4]) <= 30 * timed.STEP_BUCKET_GROWTH
    assert row[8] == "20.000"  # both servers' hooks, both sides, in ms
    (missing,) = hook_rows([SetupReport("vllm-push", "stalled")], requests=10)
    assert missing[1] == "stalled" and missing[2] == "-" and len(missing) == len(row)


def test_the_load_is_counted_without_the_warm_up() -> None:
    before = {"worker": {"seconds": {"start_load_kv": 0.001}, "calls": {"start_load_kv": 3}}}
    after = {
        "worker": {
            "seconds": {"start_load_kv": 0.004, "get_finished": 0.002},
            "calls": {"start_load_kv": 10, "get_finished": 7},
        },
        "scheduler": {
            "seconds": {"build_connector_meta": 0.5},
            "calls": {"build_connector_meta": 2},
        },
    }
    steady = timed.subtract_ledgers(after, before)
    assert steady["worker"]["calls"] == {"start_load_kv": 7, "get_finished": 7}
    assert steady["worker"]["seconds"]["start_load_kv"] == pytest.approx(0.003)
    assert steady["scheduler"] == after["scheduler"]  # nothing of it before


def test_the_worker_ledger_keeps_the_distribution_of_per_step_totals() -> None:
    """A step runs from one bind_connector_metadata to the next; one slow step moves the
    mean, not the median; readings subtract bucket by bucket."""
    ledger = timed.HookLedger("worker")
    ledger.record("get_finished", 0.5)  # before the first step: not a step of its own
    for _ in range(9):
        ledger.record("bind_connector_metadata", 4e-6)
        ledger.record("get_transfer_results", 6e-6)
    ledger.record("bind_connector_metadata", 0.002)  # closes the ninth step
    ledger.record("bind_connector_metadata", 1e-6)  # closes the slow tenth
    assert sum(ledger.steps.values()) == 10
    median = timed.step_quantile(ledger.steps, 0.5)
    assert median is not None and 10e-6 <= median <= 10e-6 * timed.STEP_BUCKET_GROWTH
    slowest = timed.step_quantile(ledger.steps, 1.0)
    assert slowest is not None and slowest >= 0.002
    assert timed.step_quantile({}, 0.5) is None
    before = {"worker": {"seconds": {}, "calls": {}, "steps": dict(ledger.steps)}}
    ledger.record("bind_connector_metadata", 1e-6)
    after = {"worker": {"seconds": {}, "calls": {}, "steps": dict(ledger.steps)}}
    steady = timed.subtract_ledgers(after, before)["worker"]["steps"]
    assert sum(steady.values()) == 1
    scheduler = timed.HookLedger("scheduler")
    scheduler.record("build_connector_meta", 1e-6)
    assert scheduler.steps == {}


def test_each_setup_is_also_read_against_the_null_floor() -> None:
    def ledger(worker_s: float, steps: int, sched_s: float) -> dict[str, Any]:
        return {
            "worker": {
                "seconds": {"start_load_kv": worker_s},
                "calls": {"start_load_kv": steps},
            },
            "scheduler": {"seconds": {"build_connector_meta": sched_s}, "calls": {}},
        }

    floor = SetupReport(NULL, "ok")
    floor.hooks = {"decode-0": ledger(0.001, 100, 0.0), "prefill-0": ledger(0.002, 100, 0.0)}
    push = SetupReport("kvpush-push", "ok")
    push.hooks = {"decode-0": ledger(0.0015, 100, 0.001), "prefill-0": ledger(0.003, 50, 0.0)}
    stalled = SetupReport("vllm-pull", "stalled")
    lines = above_floor([floor, push, stalled], requests=10)
    assert lines[0].startswith("above the floor")
    # decode: 15 - 10 us/step, (2.5 - 1) ms / 10 requests; prefill: 60 - 20, (3 - 2) / 10
    assert lines[1:] == [
        "  kvpush-push: decode +5.0 us/step, +0.150 ms/req; prefill +40.0 us/step, +0.100 ms/req"
    ]
    assert above_floor([push], requests=10) == []  # no floor measured: nothing to subtract


def test_the_null_connectors_hooks_return_at_once_and_hand_the_proxy_coordinates() -> None:
    assert not inspect.isabstract(NullConnector)  # vLLM can build it: every hook it needs
    connector = object.__new__(NullConnector)  # vLLM's config is not needed to call them
    assert connector.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert connector.update_state_after_alloc(object(), object(), 0) is None
    assert connector.start_load_kv(None) is None and connector.wait_for_save() is None
    assert connector.has_connector_metadata() is False  # vLLM skips its per-layer calls
    delay, params = connector.request_finished(object(), [1, 2])
    assert delay is False and params == NULL_PARAMS and params is not NULL_PARAMS
    # what `kvpush proxy --mode pull` takes from prefill's answer to send decode on
    assert pull_decode_params({"kv_transfer_params": params}, Backend("http://p:1")) == params
    assert timed.resolve("NullConnector") is NullConnector
