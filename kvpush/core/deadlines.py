"""Records by due time, for the state machines' timeouts (time is passed in)."""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, Protocol, TypeVar


class Timed(Protocol):
    deadline: float
    alive: bool


T = TypeVar("T", bound=Timed)


class Deadlines(Generic[T]):
    """Records by due time. A record that ends early stays in the heap with alive=False and
    is skipped when it surfaces, which keeps removal O(1)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = itertools.count()

    def add(self, item: T) -> None:
        heapq.heappush(self._heap, (item.deadline, next(self._seq), item))

    def pop_due(self, now: float) -> list[T]:
        due: list[T] = []
        seen: set[int] = set()  # a record re-added at its current deadline surfaces twice
        while self._heap and self._heap[0][0] <= now:
            when, _, item = heapq.heappop(self._heap)
            if item.alive and item.deadline == when and id(item) not in seen:
                seen.add(id(item))
                due.append(item)
        return due

    def next(self) -> float | None:
        while self._heap:
            when, _, item = self._heap[0]
            if item.alive and item.deadline == when:
                return when
            heapq.heappop(self._heap)
        return None
