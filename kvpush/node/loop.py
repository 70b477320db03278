"""The base of a node's background threads: an inbox, deadlines, and nothing that spins."""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable

from kvpush.dataplane import threads
from kvpush.node.results import Results

log = logging.getLogger("kvpush.worker")

STALL_S = 2.0  # one step of a loop longer than this is logged, with where it is stuck


def _nothing() -> None:
    return None


class Loop(threading.Thread):
    """A daemon thread draining `inbox`; subclasses handle items and timeouts."""

    def __init__(self, results: Results, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.results = results
        # SimpleQueue: a put from vLLM's main thread (start_load_kv) is one C call, a
        # third of queue.Queue's Python-level lock and condition when this thread waits
        self.inbox: queue.SimpleQueue[tuple[object, float]] = queue.SimpleQueue()
        self._later: list[tuple[float, int, object, float]] = []
        self._seq = itertools.count()
        self._stopping = False
        self.busy_since = 0.0  # when the step under way began (0: waiting for work)
        # Called when this part may become the target of a transfer (it waits for KV, or
        # holds KV a peer will read): the node's target progress (`kvpush.node.progress`).
        self.on_target: Callable[[], None] = _nothing

    def start(self) -> None:
        super().start()
        _Watchdog.watch(self)

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put((None, 0.0))
        self.join(timeout=5)

    def enqueue(self, item: object) -> None:
        """From any thread: hand `item` to this thread (arrived now)."""
        self.inbox.put((item, time.monotonic()))

    def later(self, item: object, at: float, delay: float) -> None:
        """Handle `item` (queued at `at`) again `delay` seconds from now, on this thread."""
        heapq.heappush(self._later, (time.monotonic() + delay, next(self._seq), item, at))

    def run(self) -> None:
        threads.background()
        while not self._stopping:
            try:
                item, at = self.inbox.get(timeout=self.wait_time())
            except queue.Empty:
                item, at = None, 0.0
            self.busy_since = time.monotonic()
            try:
                if item is not None:
                    self.handle(item, at)
                while self._later and self._later[0][0] <= time.monotonic():
                    _, _, due, due_at = heapq.heappop(self._later)
                    self.handle(due, due_at)
                self.tick()
            except Exception:  # a bug must not kill the thread silently
                log.exception("%s: unexpected error", self.name)
                self.results.count("failures", "internal_error")
            finally:
                self.busy_since = 0.0

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


class _Watchdog(threading.Thread):
    """One per process: logs a loop whose step has run past STALL_S, with its stack.

    A loop's deadlines only fire between steps, so a call that blocks (into NIXL, say)
    would hold back every timeout on that thread; this says so in the log, where it is.
    """

    _instance: _Watchdog | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__(name="kvpush-watchdog", daemon=True)
        self.loops: weakref.WeakSet[Loop] = weakref.WeakSet()
        self.policy = ""  # the thread policy it runs under, once running

    @classmethod
    def watch(cls, loop: Loop) -> None:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                cls._instance.start()
            cls._instance.loops.add(loop)

    def run(self) -> None:
        self.policy = threads.background()  # it wakes every second, on the engine's cores too
        reported: dict[str, float] = {}
        while True:
            time.sleep(STALL_S / 2)
            now = time.monotonic()
            for loop in list(self.loops):
                since = loop.busy_since
                if not since or now - since < STALL_S or reported.get(loop.name) == since:
                    continue
                reported[loop.name] = since
                frame = sys._current_frames().get(loop.ident or -1)
                where = "".join(traceback.format_stack(frame)[-8:]) if frame else "?"
                log.warning(
                    "%s: one step has run %.1f s (its deadlines wait for it); it is at:\n%s",
                    loop.name,
                    now - since,
                    where,
                )
