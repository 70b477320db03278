"""The base of the worker's background threads, and what they report to the engine loop."""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from kvpush.vllm.stats import empty_data

if TYPE_CHECKING:
    from kvpush.vllm.worker import WorkerSide

log = logging.getLogger("kvpush.worker")


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


class Loop(threading.Thread):
    """A daemon thread draining `inbox`; subclasses handle items and timeouts."""

    def __init__(self, worker: WorkerSide, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.worker = worker
        self.inbox: queue.Queue[tuple[object, float]] = queue.Queue()
        self._later: list[tuple[float, int, object, float]] = []
        self._seq = itertools.count()
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put((None, 0.0))
        self.join(timeout=5)

    def later(self, item: object, at: float, delay: float) -> None:
        """Handle `item` (queued at `at`) again `delay` seconds from now, on this thread."""
        heapq.heappush(self._later, (time.monotonic() + delay, next(self._seq), item, at))

    def run(self) -> None:
        while not self._stopping:
            try:
                item, at = self.inbox.get(timeout=self.wait_time())
            except queue.Empty:
                item, at = None, 0.0
            try:
                if item is not None:
                    self.handle(item, at)
                while self._later and self._later[0][0] <= time.monotonic():
                    _, _, due, due_at = heapq.heappop(self._later)
                    self.handle(due, due_at)
                self.tick()
            except Exception:  # a bug must not kill the thread silently
                log.exception("%s: unexpected error", self.name)
                self.worker.results.count("failures", "internal_error")

    def wait_time(self) -> float | None:
        """How long to wait for the next item: until the next deadline (None: no limit)."""
        later = self._later[0][0] if self._later else None
        due = [d for d in (self.next_deadline(), later) if d is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def next_deadline(self) -> float | None:
        raise NotImplementedError

    def handle(self, item: object, at: float) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def gauges(self) -> dict[str, float]:
        return {}
