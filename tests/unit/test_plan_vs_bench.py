"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see README "Capacity planning"):
- profile.json: `kvpush plan measure` on this 2-core machine, 2026-11-29 14:39-14:59,
  load average 10-18 from other work; the command is inside. Every parameter comes from
  probes without a handoff (engine prefill and front-end time of lone prompts, decode step
  time, decode's start_load_kv hook time), from kvpush's transfer metrics, from
  `kvpush proxy bench` and from ../shared/ENVIRONMENT.md - none from these results.
- sweep1/: `kvpush bench sweep --setups kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull
  --rates 1,2,4 --input-lens 256,1024 --num-prompts 24` (one iteration, 32 output tokens,
  --max-num-seqs 8), 2026-11-29 14:17-14:36, the result files as written.

The prediction is not within 25% of the measurement at most points, and the parameters
were not tuned toward it: this test pins the error actually achieved at every point.
What the model misses, from the largest effect down:
1. CPU contention. The engines have a core each in the model; everything else (both
   front ends, the proxy, the benchmark client, other tenants: load average 10-18 on 2
   cores during the sweep) costs no CPU in it. In one run at 1 req/s, kvpush-push's TTFT
   spread from 28 ms to 344 ms around a p50 of 55 ms; the model's 16.5 ms is the path with
   nothing waiting for a core. Hence TTFT errors of -60 to -95 % everywhere but vLLM's
   spinning setup and kvpush-pull at 1024 tokens.
2. Probe noise of the same origin: the engines of kvpush-push and kvpush-pull are the same
   when idle, yet their probes measured 5.1 vs 11.9 ms of prefill at 256 tokens, 3.3 vs 1.1
   ms per decode step; kvpush-pull's larger numbers predict it 70-113 % slow at 1024 tokens.
3. Coalesced streams: a starved front end, proxy or client delivers several tokens in one
   chunk, which moves time from TPOT into TTFT (kvpush-push, 256 tokens, 4 req/s:
   measured TPOT p50 0.004 ms, so that error is +90,000 %). E2E (arrival to last token) is
   immune to it: within 25 % at 3 points where TTFT is at none.
4. vLLM's spinning NIXL progress thread (vllm-pull) shares the engine's core. The probe
   of its servers measured 436 ms of prefill at 256 tokens and 947 at 1024 (kvpush's: 5-23
   ms; an earlier, interrupted probe of the same setup: 18 ms at 256), while the sweep's
   vllm-pull TTFT p50 was 510 ms at 1024 tokens, 1 req/s. How much of the core the spinner
   leaves the engine depends on what else wants it at that moment, so one probe's share
   does not carry over (+513 % there; -63 % at 256 tokens, 4 req/s).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.bench.results import load_results
from kvpush.plan.machine import CheckRow, check, load_profile

DATA = Path(__file__).resolve().parents[1] / "data" / "plan"

# (setup, input tokens, req/s): relative error (predicted - measured) / measured of the p50
# TTFT, TPOT and E2E latency; None where no run was ok (vllm-pull stalled at 1024 tokens, 2
# req/s, and at 4 req/s the proxy ejected its decode server, whose /health the spinning
# thread starved, so the warm-up failed).
ACHIEVED: dict[tuple[str, int, float], tuple[float | None, float | None, float | None]] = {
    ("kvpush-pull", 256, 1): (-0.686, -0.413, -0.569),
    ("kvpush-pull", 256, 2): (-0.765, -0.445, -0.741),
    ("kvpush-pull", 256, 4): (-0.903, -0.042, -0.782),
    ("kvpush-pull", 1024, 1): (+0.695, -0.396, -0.135),
    ("kvpush-pull", 1024, 2): (+0.852, -0.471, -0.295),
    ("kvpush-pull", 1024, 4): (+1.134, -0.275, +0.067),
    ("kvpush-push", 256, 1): (-0.701, -0.446, -0.607),
    ("kvpush-push", 256, 2): (-0.938, -0.792, -0.855),
    ("kvpush-push", 256, 4): (-0.907, +903.410, -0.421),
    ("kvpush-push", 1024, 1): (-0.613, +0.516, -0.171),
    ("kvpush-push", 1024, 2): (-0.691, -0.746, -0.751),
    ("kvpush-push", 1024, 4): (-0.764, -0.806, -0.800),
    ("vllm-pull", 256, 1): (-0.665, -0.186, -0.575),
    ("vllm-pull", 256, 2): (+1.912, +0.747, +1.539),
    ("vllm-pull", 256, 4): (-0.635, -0.396, -0.615),
    ("vllm-pull", 1024, 1): (+5.129, +0.708, +1.702),
    ("vllm-pull", 1024, 2): (None, None, None),
    ("vllm-pull", 1024, 4): (None, None, None),
    ("vllm-pull-nospin", 256, 1): (-0.920, -0.596, -0.796),
    ("vllm-pull-nospin", 256, 2): (-0.915, -0.420, -0.775),
    ("vllm-pull-nospin", 256, 4): (-0.925, -0.659, -0.820),
    ("vllm-pull-nospin", 1024, 1): (-0.908, -0.587, -0.819),
    ("vllm-pull-nospin", 1024, 2): (-0.893, -0.534, -0.799),
    ("vllm-pull-nospin", 1024, 4): (-0.945, -0.124, -0.845),
}

# The points the item's 25 % holds at, per metric: no TTFT at all.
WITHIN_25 = {
    "ttft": set(),
    "tpot": {("kvpush-pull", 256, 4), ("vllm-pull", 256, 1), ("vllm-pull-nospin", 1024, 4)},
    "e2el": {("kvpush-pull", 1024, 1), ("kvpush-pull", 1024, 4), ("kvpush-push", 1024, 1)},
}


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int, float], CheckRow]:
    profile = load_profile(DATA / "profile.json")
    found = check(profile, load_results(DATA / "sweep1"), seeds=10)
    return {(r.measured.setup, r.measured.input_len, r.measured.rate): r for r in found}


def test_every_recorded_point_is_predicted(rows: dict[tuple[str, int, float], CheckRow]) -> None:
    assert set(rows) == set(ACHIEVED)


@pytest.mark.parametrize("point", sorted(ACHIEVED))
def test_error_achieved_is_pinned(
    point: tuple[str, int, float], rows: dict[tuple[str, int, float], CheckRow]
) -> None:
    row = rows[point]
    for metric, expected in zip(("ttft", "tpot", "e2el"), ACHIEVED[point], strict=True):
        error = row.error(metric)
        if expected is None:
            assert error is None
        else:
            assert error == pytest.approx(expected, abs=0.005, rel=0.001), metric


@pytest.mark.parametrize("metric", sorted(WITHIN_25))
def test_where_the_prediction_is_within_25_percent(
    metric: str, rows: dict[tuple[str, int, float], CheckRow]
) -> None:
    within = {
        point
        for point, row in rows.items()
        if (error := row.error(metric)) is not None and abs(error) <= 0.25
    }
    assert within == WITHIN_25[metric]
