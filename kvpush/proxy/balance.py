"""Backend pools and the choice among them: pure state with time passed in (no I/O, no clock).

Each backend of a role carries what the proxy knows of it: the legs it has in flight, an
estimate of how long it takes per unit of work, what it last reported on its own /metrics
(optional), and whether it is healthy. A prefill's unit of work is a prompt token (prefill
computes the prompt); a decode's is a request (its first token waits for a slot and the KV
handoff, not for the prompt's length).

`least_loaded` picks the backend where the new leg should finish first:

    cost = (units queued there / its engines + units of this leg) x seconds per unit

- units queued: the proxy's own legs in flight, plus requests the backend reports running
  or waiting beyond those (other clients' load, from `vllm:num_requests_running/_waiting`);
  a server of N data-parallel engines (`dp=N`) works through them N at a time;
- seconds per unit: an exponentially weighted mean over the legs it finished (prefill: the
  leg's duration per prompt token; decode: time to its first byte). Two corrections keep it
  honest: a leg still waiting longer than the estimate raises it at once (a backend that
  stopped answering stops attracting work before any health check notices), and a backend
  left idle drifts back towards the pool's best estimate (half-life IDLE_HALF_LIFE_S), so
  one that was slow is tried again later rather than never;
- a backend reporting its KV cache at least KV_FULL used is chosen only if all are.

Ties go round in turn. `round_robin` ignores load and takes healthy backends in turn.
The names are spelled as vLLM's and SGLang's routers spell theirs; the hyphenated ones
this proxy used first (`least-loaded`, `round-robin`) still work.

Health: a backend is ejected after `unhealthy_after` failed health checks in a row, or at
once when a connection to it is refused, and returns after `healthy_after` passing checks;
an ejected backend gets no new legs.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from enum import Enum

from kvpush.proxy.rewrite import Backend

POLICIES = ("least_loaded", "round_robin")
POLICY_ALIASES = {"least-loaded": "least_loaded", "round-robin": "round_robin"}
IDLE_HALF_LIFE_S = 10.0
EWMA_WEIGHT = 0.3  # of a new sample
KV_FULL = 0.95


class NoBackend(Exception):
    """No backend of a role can take a leg now; the message lists why, per backend."""


class Change(Enum):
    EJECTED = "ejected"
    RETURNED = "returned"


@dataclass(frozen=True, slots=True)
class Reported:
    """What a vLLM backend said about its own load on /metrics (summed over its engines)."""

    running: float
    waiting: float
    kv_usage: float | None  # fraction of KV blocks in use, 0..1


_VLLM_GAUGE = re.compile(
    r"^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|gpu_cache_usage_perc)"
    r"(?:\{[^}]*\})?\s+(\S+)",
    re.MULTILINE,
)


def parse_vllm_metrics(text: str) -> Reported | None:
    """Read running/waiting requests and KV usage from vLLM's /metrics; None if absent."""
    sums: dict[str, float] = {}
    usage: float | None = None
    for name, value in _VLLM_GAUGE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if name.endswith("cache_usage_perc"):
            usage = number if usage is None else max(usage, number)
        else:
            sums[name] = sums.get(name, 0.0) + number
    if not sums and usage is None:
        return None
    return Reported(
        sums.get("num_requests_running", 0.0), sums.get("num_requests_waiting", 0.0), usage
    )


def check_policy(policy: str) -> str:
    """The policy's name as in POLICIES (an alias is accepted); ValueError lists the names."""
    name = POLICY_ALIASES.get(policy, policy)
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return name


@dataclass(frozen=True, slots=True)
class HealthRules:
    unhealthy_after: int = 3
    healthy_after: int = 2

    def __post_init__(self) -> None:
        if self.unhealthy_after < 1 or self.healthy_after < 1:
            raise ValueError("--eject-after and --return-after must be at least 1")


@dataclass(eq=False, slots=True)
class BackendState:
    """One backend as the proxy sees it. Compared and hashed by identity."""

    backend: Backend
    in_flight: int = 0
    units: float = 0.0  # cost units of the legs in flight
    tokens: int = 0  # tokens of the legs in flight, for the metrics
    estimate: float | None = None  # seconds per unit
    sampled_at: float = 0.0
    reported: Reported | None = None
    healthy: bool = True
    reason: str = ""  # why it is ejected
    ejections: int = 0
    failed_checks: int = 0
    passed_checks: int = 0
    # Legs still waiting for their first byte, oldest first: key -> (started, units).
    waiting: dict[int, tuple[float, float]] = field(default_factory=dict)
    # A decode's answer to "whose first token do you continue from?" (kvpush:info, read
    # once it is healthy; or learned from a stream that did not): "pinned" (prefill's),
    # "own" (it samples its own), None until known.
    first_token: str | None = None

    @property
    def url(self) -> str:
        return self.backend.url


@dataclass(eq=False, slots=True)
class Leg:
    """One leg's claim on a backend, from `Pool.begin` to `Pool.end`."""

    state: BackendState
    key: int
    started: float
    units: float
    tokens: int


@dataclass(slots=True)
class Pool:
    """The backends of one role, the choice among them, and their health transitions."""

    role: str
    policy: str = "least_loaded"
    rules: HealthRules = field(default_factory=HealthRules)
    states: list[BackendState] = field(default_factory=list)
    _turn: int = 0
    _keys: int = 0
    _units_per_leg: float = 1.0  # running mean, to price requests only /metrics knows of

    def __post_init__(self) -> None:
        self.policy = check_policy(self.policy)

    def __iter__(self) -> Iterator[BackendState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def find(self, url: str) -> BackendState | None:
        return next((s for s in self.states if s.url == url), None)

    def add(self, backend: Backend) -> BackendState:
        if self.find(backend.url):
            raise ValueError(f"{self.role} backend {backend.url} is already in the pool")
        state = BackendState(backend)
        self.states.append(state)
        return state

    def remove(self, url: str) -> BackendState:
        """Take a backend out of the choice; legs already on it finish normally."""
        state = self.find(url)
        if state is None:
            known = ", ".join(s.url for s in self.states) or "none"
            raise ValueError(f"no {self.role} backend {url} (the {self.role} pool has: {known})")
        self.states.remove(state)
        return state

    def available(self, exclude: Collection[str] = ()) -> bool:
        return any(s.healthy and s.url not in exclude for s in self.states)

    def ensure_available(self) -> None:
        if not self.available():
            raise NoBackend(self._why_none(()))

    # -- choice -------------------------------------------------------------------------

    def pick(self, units: float, now: float, exclude: Collection[str] = ()) -> BackendState:
        candidates = [s for s in self.states if s.healthy and s.url not in exclude]
        if not candidates:
            raise NoBackend(self._why_none(exclude))
        if len(candidates) == 1:
            return candidates[0]
        start = self._turn % len(candidates)
        self._turn += 1
        if self.policy == "round_robin":
            return candidates[start]
        floor, fallback = self._baseline()
        ordered = candidates[start:] + candidates[:start]
        return min(ordered, key=lambda s: self._cost(s, units, now, floor, fallback))

    def cost(self, state: BackendState, units: float, now: float) -> float:
        """The expected seconds for a leg of `units` on `state` (for tests and the admin view)."""
        return self._cost(state, units, now, *self._baseline())[1]

    def _baseline(self) -> tuple[float, float]:
        """The best estimate in the pool (idle ones drift to it) and the mean (for new ones)."""
        known = [s.estimate for s in self.states if s.estimate is not None]
        if not known:
            return 1.0, 1.0
        return min(known), sum(known) / len(known)

    def _cost(
        self, state: BackendState, units: float, now: float, floor: float, fallback: float
    ) -> tuple[bool, float]:
        per_unit = fallback
        if state.estimate is not None:
            per_unit = state.estimate
            if per_unit > floor:
                idle = max(0.0, now - state.sampled_at)
                per_unit = floor + (per_unit - floor) * 0.5 ** (idle / IDLE_HALF_LIFE_S)
        if state.waiting:
            started, leg_units = next(iter(state.waiting.values()))
            per_unit = max(per_unit, (now - started) / leg_units)
        queued = state.units
        reported = state.reported
        kv_full = False
        if reported is not None:
            unseen = reported.running + reported.waiting - state.in_flight
            if unseen > 0:
                queued += unseen * self._units_per_leg
            kv_full = reported.kv_usage is not None and reported.kv_usage >= KV_FULL
        return kv_full, (queued / state.backend.dp_size + units) * per_unit

    # -- accounting ---------------------------------------------------------------------

    def begin(self, state: BackendState, units: float, tokens: int, now: float) -> Leg:
        units = max(units, 1.0)
        self._keys += 1
        leg = Leg(state, self._keys, now, units, tokens)
        state.in_flight += 1
        state.units += units
        state.tokens += tokens
        state.waiting[leg.key] = (now, units)
        self._units_per_leg += EWMA_WEIGHT * (units - self._units_per_leg)
        return leg

    def first_byte(self, leg: Leg, now: float) -> None:
        """The leg's backend answered: learn its speed from how long that took."""
        state = leg.state
        if state.waiting.pop(leg.key, None) is None:
            return
        sample = max(now - leg.started, 0.0) / leg.units
        if state.estimate is None:
            state.estimate = sample
        else:
            state.estimate += EWMA_WEIGHT * (sample - state.estimate)
        state.sampled_at = now

    def end(self, leg: Leg) -> None:
        """The leg is over (done, failed or cancelled); one that never answered teaches nothing."""
        state = leg.state
        state.waiting.pop(leg.key, None)
        state.in_flight -= 1
        state.units -= leg.units
        state.tokens -= leg.tokens

    # -- health -------------------------------------------------------------------------

    def checked(self, state: BackendState, ok: bool, detail: str = "") -> Change | None:
        """Record one health check's result; says when the backend leaves or returns."""
        if ok:
            state.failed_checks = 0
            state.passed_checks += 1
            if not state.healthy and state.passed_checks >= self.rules.healthy_after:
                state.healthy, state.reason = True, ""
                # It may have restarted: what was learned about it no longer holds.
                state.estimate, state.reported, state.first_token = None, None, None
                return Change.RETURNED
            return None
        state.passed_checks = 0
        state.failed_checks += 1
        if state.failed_checks >= self.rules.unhealthy_after:
            return self.eject(state, f"{state.failed_checks} health checks failed: {detail}")
        return None

    def eject(self, state: BackendState, reason: str) -> Change | None:
        state.passed_checks = 0
        if not state.healthy:
            return None
        state.healthy, state.reason = False, reason
        state.ejections += 1
        return Change.EJECTED

    def _why_none(self, exclude: Collection[str]) -> str:
        if not self.states:
            return (
                f"no {self.role} backend is configured; add one (POST /admin/backends or the "
                "--config file)"
            )
        reasons = []
        for s in self.states:
            if s.url in exclude:
                reasons.append(f"{s.url} (already failed for this request)")
            else:
                reasons.append(f"{s.url} (ejected: {s.reason})")
        return (
            f"no healthy {self.role} backend: {'; '.join(reasons)}. An ejected backend returns "
            f"after {self.rules.healthy_after} passing health checks"
        )
