"""What a node's threads tell the engine loop, and what its hooks cost the engine loop.

`Results` is swapped out under one lock by the hooks (`get_finished`, the stats); the
threads add to it. `HookTimer` times the hooks themselves, on vLLM's main threads. The
stats data is a plain dict (`empty_data`), which vLLM ships between processes.

Both sit on the engine loop's path at every step, so their idle path allocates nothing and
takes no lock: a hook with nothing to take returns at once, and a timer span is one
object per hook, made once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

SERIES = (
    "bytes",
    "descriptors",
    "reg_to_write_s",
    "finish_to_handoff_s",
    "finish_to_write_s",
    "write_s",
    "read_s",
    "wait_s",
)


def empty_data() -> dict[str, Any]:
    data: dict[str, Any] = {name: [] for name in SERIES}
    data.update(failures={}, rejected={}, handoffs={}, hook_s={}, hook_calls={}, gauges={})
    return data


class Span:
    """One hook's running totals; `with span:` times one call. Not thread-safe: a span
    belongs to the one vLLM thread that calls its hook (and drains its timer)."""

    __slots__ = ("calls", "key", "seconds", "started")

    def __init__(self, key: str) -> None:
        self.key = key
        self.seconds = 0.0
        self.calls = 0
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self.started
        self.calls += 1


class HookTimer:
    """Accumulates wall time spent inside vLLM's hooks, i.e. on the engine's main thread.

    `timer(hook)` is the hook's `Span` (made on first use); hooks called every step keep
    theirs (`span = timer(hook)` once, then `with span:`). Hooks and `drain` run on the
    same vLLM thread (the scheduler's, or the worker's), so nothing is locked."""

    def __init__(self, side: str) -> None:
        self.side = side
        self._spans: dict[str, Span] = {}

    def __call__(self, hook: str) -> Span:
        span = self._spans.get(hook)
        if span is None:
            span = self._spans[hook] = Span(f"{self.side}.{hook}")
        return span

    def drain(self, data: dict[str, Any]) -> None:
        for span in self._spans.values():
            calls = span.calls
            if not calls:
                continue
            seconds = span.seconds
            span.seconds, span.calls = 0.0, 0
            data["hook_s"][span.key] = data["hook_s"].get(span.key, 0.0) + seconds
            data["hook_calls"][span.key] = data["hook_calls"].get(span.key, 0) + calls


class Results:
    """What the background threads tell the engine loop; swapped out under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        # Decode with several KV cache groups (vLLM's hybrid KV cache manager): block ids
        # name no request there, so a failed load goes to vLLM by request id instead.
        self.by_request = False
        self.failed: set[str] = set()
        self.data = empty_data()
        # Set with anything added to `data`, so the stats hook can tell without a lock
        # that there is nothing new (a read racing a write only defers it a step).
        self.news = False

    def take(self) -> tuple[set[str], set[str]]:
        if not (self.sending or self.recving):
            return set(), set()
        with self.lock:
            sending, recving = self.sending, self.recving
            self.sending, self.recving = set(), set()
            return sending, recving

    def take_load_errors(self) -> set[int]:
        if not self.load_errors:
            return set()
        with self.lock:
            errors, self.load_errors = self.load_errors, set()
            return errors

    def take_failed(self) -> set[str]:
        """Requests whose KV will not arrive (`by_request`), reported to vLLM as they are
        reported received, or before."""
        if not self.failed:
            return set()
        with self.lock:
            failed, self.failed = self.failed, set()
            return failed

    def take_data(self) -> dict[str, Any]:
        with self.lock:
            data, self.data = self.data, empty_data()
            self.news = False
            return data

    def sent(self, request_id: str) -> None:
        """Prefill: vLLM may free the request's blocks. News for the stats too: a pull
        prefill records no transfer of its own, and without it its hook timings would
        wait for a step after the next interval, which an idle server does not run."""
        with self.lock:
            self.sending.add(request_id)
            self.news = True

    def received(self, request_id: str) -> None:
        """Decode: the request's KV arrived, or its request ended before (nothing to load)."""
        with self.lock:
            self.recving.add(request_id)

    def not_received(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        """Decode: the request's KV will not arrive in `block_ids`; vLLM fails (or
        recomputes) it, by its blocks or, with several KV cache groups, by its id."""
        with self.lock:
            self.recving.add(request_id)
            if self.by_request:
                self.failed.add(request_id)
            else:
                self.load_errors.update(block_ids)

    def count(self, table: str, key: str, n: int = 1) -> None:
        with self.lock:
            self.data[table][key] = self.data[table].get(key, 0) + n
            self.news = True

    def observe(self, **series: float) -> None:
        with self.lock:
            for name, value in series.items():
                self.data[name].append(value)
            self.news = True
