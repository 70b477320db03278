"""The proxy's backends: a pool per role, their health and ejection, the legs in flight.

`Backends` is what the request path (`legs`), the health checks (`monitor`) and the admin
API (`admin`) share. A backend is ejected after failed health checks or at once when a
connection to it is refused; the legs still running on it are then aborted at once (each
is a `Flight`), so no request waits on a dead backend. The fleet file and the admin API
change the pools' members (`apply_fleet`, or a pool's `add`/`remove`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType

from kvpush.proxy import rewrite
from kvpush.proxy.balance import BackendState, Change, Pool
from kvpush.proxy.client import TIMED_OUT
from kvpush.proxy.config import ProxyConfig
from kvpush.proxy.errors import LOST, UNSENT, BackendFailure, error_kind
from kvpush.proxy.fleet import ROLES, Fleet, check_fleet
from kvpush.proxy.metrics import Metrics

log = logging.getLogger("kvpush.proxy")


def make_pools(config: ProxyConfig) -> dict[str, Pool]:
    """A pool per role, with the configured backends and that role's policy."""
    pools = {role: Pool(role, config.policies[role], config.health) for role in ROLES}
    for backend in config.prefill:
        pools["prefill"].add(backend)
    for backend in config.decode:
        pools["decode"].add(backend)
    return pools


class Backends:
    def __init__(self, mode: str, pools: dict[str, Pool], metrics: Metrics) -> None:
        self.mode = mode
        self.pools = pools
        self.metrics = metrics
        self._flights: dict[BackendState, set[Flight]] = {}
        # push: prefill legs in flight per data-parallel engine of each prefill (by URL),
        # and where the next tie goes, so that engines share a burst as vLLM's own
        # balancing would
        self._dp_legs: dict[str, list[int]] = {}
        self._dp_next: dict[str, int] = {}

    def choose(self, role: str, units: float, tried: set[str]) -> BackendState:
        """The backend of `role` for a leg of `units`, not one of `tried` (NoBackend if none)."""
        return self.pools[role].pick(units, time.monotonic(), tried)

    def take_dp_rank(self, backend: rewrite.Backend) -> int:
        """The data-parallel engine of push prefill `backend` for a new prefill leg: the one
        with the fewest prefill legs in flight, ties taking turns. Give it back with
        `give_dp_rank` once the leg ended."""
        if backend.dp_size == 1:
            return 0
        legs = self._dp_legs.get(backend.url)
        if legs is None or len(legs) != backend.dp_size:
            legs = self._dp_legs[backend.url] = [0] * backend.dp_size
        start = self._dp_next.get(backend.url, 0) % backend.dp_size
        order = [(start + i) % backend.dp_size for i in range(backend.dp_size)]
        rank = min(order, key=legs.__getitem__)
        legs[rank] += 1
        self._dp_next[backend.url] = rank + 1
        return rank

    def give_dp_rank(self, backend: rewrite.Backend, rank: int) -> None:
        legs = self._dp_legs.get(backend.url)
        if backend.dp_size > 1 and legs is not None and rank < len(legs) and legs[rank] > 0:
            legs[rank] -= 1

    def first_token_of(self, state: BackendState, source: str) -> None:
        """Record whose first token decode `state` continues from ("pinned": prefill's,
        "own": its own), saying so in the log when it is its own."""
        if source == "own" and state.first_token != "own":
            log.warning(
                "decode %s samples its own first token (speculative decoding loads no "
                "custom logits processor; a model with state layers computes its prompt's "
                "last token on decode): streams take their first token from decode while "
                "it serves",
                state.url,
            )
        state.first_token = source

    def prefill_may_give_first_token(self) -> bool:
        """Whether a stream may take its first token from prefill: no decode says it
        samples its own (a fleet is one kind of decode in practice; a mixed one gives up
        the early token for all, not a wrong first token to some)."""
        return all(state.first_token != "own" for state in self.pools["decode"])

    def flight(self, role: str, state: BackendState, units: float, tokens: int) -> Flight:
        """A leg on `state`, to run inside `async with`."""
        return Flight(self, role, state, units, tokens)

    def apply_fleet(self, fleet: Fleet) -> list[str]:
        """Make the pools hold exactly `fleet`'s backends; returns what changed."""
        check_fleet(self.mode, fleet)
        changes = []
        for role in ROLES:
            pool = self.pools[role]
            wanted = {b.url: b for b in fleet.of(role)}
            for state in list(pool):
                if wanted.get(state.url) != state.backend:
                    pool.remove(state.url)
                    changes.append(f"removed {role} {state.url}")
            for url, backend in wanted.items():
                if pool.find(url) is None:
                    pool.add(backend)
                    changes.append(f"added {role} {rewrite.format_backend(backend)}")
        return changes

    def checked(self, role: str, state: BackendState, problem: str | None) -> None:
        """Record a health check (problem None: it passed).

        A check that timed out says the backend is slow, not gone: the last healthy backend
        of a role is not ejected for that (ejecting it would turn one overloaded server into
        a 503 for every request; its requests stay bounded by --request-timeout). Errors and
        refused connections still eject it.
        """
        slow = problem is not None and problem.startswith(TIMED_OUT)
        others = [s for s in self.pools[role] if s.healthy and s is not state]
        if slow and state.healthy and not others:
            log.info("%s backend %s: %s; kept, as the last healthy one", role, state.url, problem)
            return
        change = self.pools[role].checked(state, problem is None, problem or "")
        if change is Change.EJECTED:
            self._ejected(role, state)
        elif change is Change.RETURNED:
            log.info("%s backend %s passed its health checks and is back", role, state.url)

    def eject(self, role: str, state: BackendState, reason: str) -> None:
        if self.pools[role].eject(state, reason) is Change.EJECTED:
            self._ejected(role, state)

    def _ejected(self, role: str, state: BackendState) -> None:
        self.metrics.ejections.labels(role, state.url).inc()
        flights = list(self._flights.get(state, ()))
        log.warning(
            "%s backend %s ejected (%s); aborting %d legs on it",
            role,
            state.url,
            state.reason,
            len(flights),
        )
        for flight in flights:
            flight.abort(state.reason)


class Flight:
    """One leg in flight on one backend: its share of the backend's load, and a scope that
    ends the leg at once if the backend is ejected meanwhile (no request waits on a dead
    backend). Failures leaving it are counted; a refused connection ejects the backend."""

    __slots__ = ("backends", "role", "leg", "scope", "aborted")

    def __init__(
        self, backends: Backends, role: str, state: BackendState, units: float, tokens: int
    ) -> None:
        self.backends = backends
        self.role = role
        self.leg = backends.pools[role].begin(state, units, tokens, time.monotonic())
        self.scope = asyncio.timeout(None)
        self.aborted = ""

    def answered(self) -> None:
        self.backends.pools[self.role].first_byte(self.leg, time.monotonic())

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self.scope.reschedule(asyncio.get_running_loop().time())

    async def __aenter__(self) -> Flight:
        await self.scope.__aenter__()
        self.backends._flights.setdefault(self.leg.state, set()).add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state = self.leg.state
        flights = self.backends._flights[state]
        flights.discard(self)
        if not flights:
            del self.backends._flights[state]
        self.backends.pools[self.role].end(self.leg)
        try:
            await self.scope.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not self.aborted:
                raise
            exc = BackendFailure(
                self.role, state.backend, 502, f"ejected while in flight ({self.aborted})", LOST
            )
            self._count(exc)
            raise exc from None
        if isinstance(exc, BackendFailure):
            self._count(exc)
            if exc.safety == UNSENT:
                self.backends.eject(self.role, state, exc.detail)

    def _count(self, exc: BackendFailure) -> None:
        self.backends.metrics.errors.labels(self.role, exc.backend.url, error_kind(exc)).inc()
