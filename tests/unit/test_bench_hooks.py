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
    assert row[:4] == ["kvpush-push", "ok", "1.000", "40.0"]
    assert row[6] == "-"  # no warm-up reading
    report.hooks_warm_up = {"decode-0": ledger, "prefill-0": ledger}
    (row,) = hook_rows([report], requests=10)
    assert row[6] == "20.000"  # both servers' hooks, both sides, in ms
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
