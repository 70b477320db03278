"""The hook timer wraps any connector class; nested hooks count once; ledgers add up."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvpush.bench import timed
from kvpush.bench.cli import hook_rows, hook_totals
from kvpush.bench.compare import RequestResult, SetupReport


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
