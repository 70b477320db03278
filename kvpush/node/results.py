"""What a node's threads tell the engine loop, and what its hooks cost the engine loop.

`Results` is swapped out under one lock by the hooks (`get_finished`, the stats); the
threads add to it. `HookTimer` times the hooks themselves, on vLLM's main threads. The
stats data is a plain dict (`empty_data`), which vLLM ships between processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SERIES = ("bytes", "descriptors", "reg_to_write_s", "write_s", "read_s", "wait_s")


def empty_data() -> dict[str, Any]:
    data: dict[str, Any] = {name: [] for name in SERIES}
    data.update(failures={}, rejected={}, hook_s={}, hook_calls={}, gauges={})
    return data


class HookTimer:
    """Accumulates wall time spent inside vLLM's hooks, i.e. on the engine's main thread."""

    def __init__(self, side: str) -> None:
        self.side = side
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}

    @contextmanager
    def __call__(self, hook: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - started
            key = f"{self.side}.{hook}"
            with self._lock:
                self._seconds[key] = self._seconds.get(key, 0.0) + took
                self._calls[key] = self._calls.get(key, 0) + 1

    def drain(self, data: dict[str, Any]) -> None:
        with self._lock:
            for key, seconds in self._seconds.items():
                data["hook_s"][key] = data["hook_s"].get(key, 0.0) + seconds
                data["hook_calls"][key] = data["hook_calls"].get(key, 0) + self._calls[key]
            self._seconds.clear()
            self._calls.clear()


class Results:
    """What the background threads tell the engine loop; swapped out under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.data = empty_data()

    def take(self) -> tuple[set[str], set[str]]:
        with self.lock:
            sending, recving = self.sending, self.recving
            self.sending, self.recving = set(), set()
            return sending, recving

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self.load_errors = self.load_errors, set()
            return errors

    def take_data(self) -> dict[str, Any]:
        with self.lock:
            data, self.data = self.data, empty_data()
            return data

    def sent(self, request_id: str) -> None:
        """Prefill: vLLM may free the request's blocks."""
        with self.lock:
            self.sending.add(request_id)

    def received(self, request_id: str, failed_blocks: tuple[int, ...] = ()) -> None:
        """Decode: the request's KV arrived, or (with `failed_blocks`) will not."""
        with self.lock:
            self.recving.add(request_id)
            self.load_errors.update(failed_blocks)

    def count(self, table: str, key: str, n: int = 1) -> None:
        with self.lock:
            self.data[table][key] = self.data[table].get(key, 0) + n

    def observe(self, **series: float) -> None:
        with self.lock:
            for name, value in series.items():
                self.data[name].append(value)
