"""The simulator on this machine: measured parameters, and their check against `kvpush bench`.

A `MachineProfile` holds what `kvpush plan measure` measured on one machine, per connector
setup, on that setup's own 1P1D servers but without a handoff (`kvpush/plan/measure.py`):

- prefill: vLLM's engine-side prefill time (`vllm:request_prefill_time_seconds`) of
  one prompt at a time, per prompt length, on the prefill server (median over prompts);
- front end: the same requests' latency at the client minus the engine's queue and
  prefill time: HTTP, tokenisation, the engine's inbound and outbound queues (median);
- decode step: on the decode server, batches of 1 and `max_num_seqs` streamed local
  requests; the median TPOT the client saw, i.e. the engine's step plus each token's way
  out through the front end (the engine-side step is kept in `extra`, for the record);
- pull's inline submission: the decode worker's main-thread time in the hooks that take
  a step's loads (`start_load_kv`, and `bind_connector_metadata` where kvpush hands them
  over) per handed-off request (`kvpush.bench.timed`), beyond what they cost in a step
  with nothing to load; only the hooks' time is used, never the latency of those
  requests;
- the proxy's added latency per mode from `kvpush proxy bench` (stub backends) and NIXL's
  DRAM-to-DRAM bandwidth (measured between two processes, `NIXL_DRAM_GBPS` in
  `kvpush.plan.measure`), both recorded with their source.

Each setup is measured on its own servers, so whatever its connector runs in the
background - NIXL's spinning progress thread in vLLM's setups, its paced one in the
-nospin setups, nothing in kvpush's - is in that setup's engine numbers.

`sim_params` turns a setup's measurements into `SimParams` (straight-line fits over the
prompt lengths, a plane over batch and context for the decode step) and `check` predicts
every point of a sweep's result files with them: p50 TTFT and TPOT, the median over
several arrival seeds, next to the measured p50 (the median over iterations).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.core.protocol import Mode
from kvpush.plan.model import PlannerError, PrefillSpeed
from kvpush.plan.simulate import SimParams, simulate

SCHEMA = "kvpush.plan.profile/1"
# The simulator's hops per request in each mode (client -> proxy -> prefill, and for pull
# prefill -> proxy -> decode); the proxy's measured added latency is spread over them.
HOPS: dict[Mode, int] = {"pull": 3, "push": 1}


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class PointProbe:
    """One setup's measurements at one prompt length (times in ms)."""

    input_len: int
    prefill_ms: float
    """vLLM's engine-side prefill time of one prompt, alone on the prefill server."""
    front_end_ms: float
    """Client latency of that request minus the engine's queue and prefill time."""
    step_ms: dict[int, float]
    """Decode step time at each batch size, on the decode server, prompts this long."""
    submit_ms: float | None = None
    """Decode's main-thread time in the load hooks per handed-off request, beyond idle."""
    transfer_ms: float | None = None
    """Mean time of one transfer by the connector's own metrics (kvpush's only)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "input_len": self.input_len,
            "prefill_ms": self.prefill_ms,
            "front_end_ms": self.front_end_ms,
            "step_ms": {str(batch): ms for batch, ms in sorted(self.step_ms.items())},
            "submit_ms": self.submit_ms,
            "transfer_ms": self.transfer_ms,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PointProbe:
        return cls(
            input_len=int(data["input_len"]),
            prefill_ms=float(data["prefill_ms"]),
            front_end_ms=float(data["front_end_ms"]),
            step_ms={int(batch): float(ms) for batch, ms in data["step_ms"].items()},
            submit_ms=_optional(data.get("submit_ms")),
            transfer_ms=_optional(data.get("transfer_ms")),
        )


@dataclass(frozen=True, slots=True)
class SetupProbe:
    setup: str
    mode: Mode
    points: tuple[PointProbe, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    """Raw numbers kept for the record (hook totals, client-side samples)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "points": [point.to_json() for point in self.points],
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, setup: str, data: Mapping[str, Any]) -> SetupProbe:
        mode = data["mode"]
        if mode not in HOPS:
            raise PlannerError(f"profile: setup {setup!r} has unknown mode {mode!r}")
        return cls(
            setup=setup,
            mode=mode,
            points=tuple(PointProbe.from_json(point) for point in data["points"]),
            extra=dict(data.get("extra") or {}),
        )


@dataclass(frozen=True, slots=True)
class MachineProfile:
    kv_bytes_per_token: int
    max_num_seqs: int
    link_gbps: float
    memory_gbps: float
    proxy_added_ms: dict[str, float]
    setups: dict[str, SetupProbe]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "provenance": self.provenance,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_num_seqs": self.max_num_seqs,
            "link_gbps": self.link_gbps,
            "memory_gbps": self.memory_gbps,
            "proxy_added_ms": self.proxy_added_ms,
            "setups": {name: probe.to_json() for name, probe in sorted(self.setups.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MachineProfile:
        if data.get("schema") != SCHEMA:
            raise PlannerError(
                f"not a machine profile (schema {data.get('schema')!r}, want {SCHEMA!r}); "
                "write one with `kvpush plan measure`"
            )
        return cls(
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            max_num_seqs=int(data["max_num_seqs"]),
            link_gbps=float(data["link_gbps"]),
            memory_gbps=float(data["memory_gbps"]),
            proxy_added_ms={mode: float(ms) for mode, ms in data["proxy_added_ms"].items()},
            setups={
                name: SetupProbe.from_json(name, probe) for name, probe in data["setups"].items()
            },
            provenance=dict(data.get("provenance") or {}),
        )

    def setup(self, name: str) -> SetupProbe:
        try:
            return self.setups[name]
        except KeyError:
            known = ", ".join(sorted(self.setups)) or "none"
            raise PlannerError(
                f"the profile has no measurements of setup {name!r} (it has: {known}); "
                f"run `kvpush plan measure --setups {name}`"
            ) from None


def load_profile(path: str | Path) -> MachineProfile:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlannerError(f"cannot read --profile {str(path)!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise PlannerError(f"--profile {str(path)!r} is not valid JSON ({exc})") from None
    try:
        return MachineProfile.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PlannerError):
            raise
        raise PlannerError(
            f"--profile {str(path)!r} is incomplete or malformed ({exc!r})"
        ) from None


def save_profile(profile: MachineProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")


# -- from measurements to simulator parameters -------------------------------------------


@dataclass(frozen=True, slots=True)
class Line:
    """y = intercept + slope x, least squares."""

    intercept: float
    slope: float

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> Line:
        if len(xs) == 1:
            return cls(0.0, ys[0] / xs[0])
        slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
        return cls(float(intercept), float(slope))


@dataclass(frozen=True, slots=True)
class StepFit:
    """Decode step (ms) = base + per_seq x batch + per_context x context tokens."""

    base_ms: float
    per_seq_ms: float
    per_context_token_us: float

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> StepFit:
        """Least squares over (batch, prompt tokens, step ms); terms that come out negative
        (noise on a busy machine) are dropped and the rest refitted."""
        rows = [(float(batch), float(batch * tokens), ms) for batch, tokens, ms in samples]
        if not rows:
            raise PlannerError("the profile has no decode step measurements")
        terms = [0, 1, 2]  # base, per sequence, per context token
        while True:
            design = np.array([[1.0, b, c][t] for b, c, _ in rows for t in terms]).reshape(
                len(rows), len(terms)
            )
            values = np.array([ms for _, _, ms in rows])
            solution, *_ = np.linalg.lstsq(design, values, rcond=None)
            coef = dict(zip(terms, (float(v) for v in solution), strict=True))
            negative = [t for t in terms if t != 0 and coef[t] < 0]
            if not negative:
                break
            terms.remove(negative[0])
        return cls(
            base_ms=max(coef[0], 0.0),
            per_seq_ms=coef.get(1, 0.0),
            per_context_token_us=coef.get(2, 0.0) * 1e3,
        )


@dataclass(frozen=True, slots=True)
class Derived:
    """The simulator parameters one setup's measurements give, and the fits behind them."""

    prefill: Line
    front_end: Line
    step: StepFit
    submit_us_per_token: float
    transfer_setup_ms: float
    hop_ms: float


def derive(profile: MachineProfile, setup: str) -> Derived:
    probe = profile.setup(setup)
    points = sorted(probe.points, key=lambda p: p.input_len)
    if not points:
        raise PlannerError(f"the profile has no points for setup {setup!r}")
    lens = [p.input_len for p in points]
    prefill = Line.fit(lens, [p.prefill_ms for p in points])
    if prefill.slope <= 0:
        raise PlannerError(
            f"setup {setup!r}: measured prefill time does not grow with prompt length "
            f"({', '.join(f'{p.prefill_ms:.2f}' for p in points)} ms at {lens} tokens); the "
            "machine was too noisy, run `kvpush plan measure` again"
        )
    front = Line.fit(lens, [p.front_end_ms for p in points])
    # A front end that seems to get faster with longer prompts is noise: keep its mean.
    if front.slope < 0:
        front = Line(statistics.fmean(p.front_end_ms for p in points), 0.0)
    step = StepFit.fit((batch, p.input_len, ms) for p in points for batch, ms in p.step_ms.items())
    submits = [(p.input_len, p.submit_ms) for p in points if p.submit_ms is not None]
    # through the origin: submission is work per block, so per prompt token
    submit = (
        sum(n * ms for n, ms in submits) / sum(n * n for n, _ in submits) * 1e3 if submits else 0
    )
    # a transfer's time beyond moving its bytes at the link's speed, where the connector
    # measures its transfers (kvpush); none is known for vLLM's
    setups = [
        p.transfer_ms - p.input_len * profile.kv_bytes_per_token / (profile.link_gbps * 1e6)
        for p in points
        if p.transfer_ms is not None
    ]
    setup_ms = max(statistics.fmean(setups), 0.0) if setups else 0.0
    added = profile.proxy_added_ms.get(probe.mode)
    if added is None:
        raise PlannerError(f"the profile has no proxy latency for {probe.mode} mode")
    return Derived(prefill, front, step, max(submit, 0.0), setup_ms, added / HOPS[probe.mode])


def sim_params(
    profile: MachineProfile,
    setup: str,
    output_len: int,
    num_prompts: int,
    max_num_seqs: int | None = None,
    seed: int = 0,
    first_token: str = "decode",
) -> SimParams:
    d = derive(profile, setup)
    return SimParams(
        kv_bytes_per_token=profile.kv_bytes_per_token,
        prefill=PrefillSpeed(
            tokens_per_s=1e3 / d.prefill.slope, fixed_s=max(d.prefill.intercept, 0.0) / 1e3
        ),
        tp=1,
        link_gbps=profile.link_gbps,
        transfer_setup_ms=d.transfer_setup_ms,
        hbm_tbps=profile.memory_gbps / 1e3,
        max_num_seqs=max_num_seqs or profile.max_num_seqs,
        output_len=output_len,
        num_prompts=num_prompts,
        hop_ms=d.hop_ms,
        api_fixed_ms=max(d.front_end.intercept, 0.0),
        api_us_per_token=d.front_end.slope * 1e3,
        base_tpot_ms=d.step.base_ms,
        per_seq_ms=d.step.per_seq_ms,
        per_context_token_us=d.step.per_context_token_us,
        pull_submit_us_per_token=d.submit_us_per_token,
        first_token=first_token,
        seed=seed,
    )


# -- the check against a sweep -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measured:
    """One sweep point of one setup: medians over iterations of the ok runs' p50s."""

    setup: str
    input_len: int
    rate: float
    output_len: int
    num_prompts: int
    max_num_seqs: int
    status: str
    runs: int
    ttft_p50: float | None
    tpot_p50: float | None
    e2el_p50: float | None
    one_burst: float | None = None
    """Median over the ok runs of the share of answers that arrived in one burst."""
    late_tokens: float | None = None
    """Median over the ok runs of the share of output tokens that reached the client more
    than two decode steps after they were produced (`kvpush.bench.results.late_tokens`)."""
    first_token: str = "decode"
    """Where the proxy took streamed answers' first token from (results before it was
    recorded: decode, the only way then)."""


METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class CheckRow:
    measured: Measured
    ttft_p50: float
    tpot_p50: float
    e2el_p50: float

    def error(self, metric: str) -> float | None:
        """(predicted - measured) / measured of one metric's p50."""
        measured: float | None = getattr(self.measured, f"{metric}_p50")
        if measured is None or measured <= 0:
            return None
        predicted: float = getattr(self, f"{metric}_p50")
        return (predicted - measured) / measured


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def measured_points(results: Sequence[Mapping[str, Any]]) -> list[Measured]:
    """Group a sweep's run records (`kvpush.bench.results.load_results`) by point."""
    groups: dict[tuple[str, int, float, int], list[Mapping[str, Any]]] = {}
    for record in results:
        key = (
            str(record["setup"]),
            int(record["input_len"]),
            float(record["rate"]),
            int(record["output_len"]),
        )
        groups.setdefault(key, []).append(record)
    points = []
    for (setup, input_len, rate, output_len), runs in sorted(groups.items()):
        ok = [r for r in runs if r.get("status") == "ok"]
        statuses = {str(r.get("status")) for r in runs}
        points.append(
            Measured(
                setup=setup,
                input_len=input_len,
                rate=rate,
                output_len=output_len,
                num_prompts=int(runs[0]["num_prompts"]),
                max_num_seqs=int(runs[0].get("max_num_seqs") or 8),
                status="ok" if len(ok) == len(runs) else "/".join(sorted(statuses - {"ok"})),
                runs=len(runs),
                ttft_p50=_median((r.get("ttft") or {}).get("p50") for r in ok),
                tpot_p50=_median((r.get("tpot") or {}).get("p50") for r in ok),
                e2el_p50=_median((r.get("e2el") or {}).get("p50") for r in ok),
                one_burst=_median(r.get("one_burst") for r in ok),
                late_tokens=_median(r.get("late_tokens") for r in ok),
                first_token=str(runs[0].get("first_token") or "decode"),
            )
        )
    return points


def predict(
    profile: MachineProfile, point: Measured, seeds: int = 10
) -> tuple[float, float, float]:
    """Median over `seeds` arrival sequences of the simulated p50 TTFT, TPOT and E2E (ms)."""
    ttfts, tpots, e2els = [], [], []
    for seed in range(seeds):
        params = sim_params(
            profile,
            point.setup,
            output_len=point.output_len,
            num_prompts=point.num_prompts,
            max_num_seqs=point.max_num_seqs,
            seed=seed,
            first_token=point.first_token,
        )
        run = simulate(params, profile.setup(point.setup).mode, point.rate, point.input_len)
        ttfts.append(run.ttft_ms.p50)
        tpots.append(run.tpot_ms.p50)
        e2els.append(run.e2el_ms.p50)
    return statistics.median(ttfts), statistics.median(tpots), statistics.median(e2els)


def check(
    profile: MachineProfile,
    results: Sequence[Mapping[str, Any]],
    seeds: int = 10,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[CheckRow]:
    """Predict every measured point of a setup the profile knows."""
    points = [p for p in measured_points(results) if p.setup in profile.setups]
    if not points:
        have = ", ".join(sorted({str(r["setup"]) for r in results})) or "none"
        raise PlannerError(
            f"no result is of a setup the profile measured (results: {have}; profile: "
            f"{', '.join(sorted(profile.setups))})"
        )
    rows = []
    for index, point in enumerate(points, start=1):
        if progress is not None:
            progress(index, len(points), f"{point.setup}, {point.input_len} in, {point.rate:g}/s")
        rows.append(CheckRow(point, *predict(profile, point, seeds)))
    return rows
