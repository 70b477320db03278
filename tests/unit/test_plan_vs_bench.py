"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see README "Capacity planning"), with nothing else
running on the 2 cores:
- sweep2/: `kvpush bench sweep --setups kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull
  --rates 1,2,4 --input-lens 256,1024 --num-prompts 24 --iterations 3` (32 output tokens,
  --max-num-seqs 8), 2026-11-29 16:54-17:46, the result files as written plus `one_burst`
  computed from the run's own `vllm bench serve` data.
- profile.json: `kvpush plan measure` (command inside), 18:00-18:06, after the sweep; the
  proxy's added latency from `kvpush proxy bench --streams 1` at 16:48 (1.05 ms pull, 0.97
  push). Every parameter comes from probes without a handoff (medians of lone prompts'
  engine prefill and front-end time, lone and batched streamed TPOT on decode, decode's
  start_load_kv hook time), from kvpush's transfer metrics and the NIXL bandwidth measured
  once (plan/measure.py) -
  none from these results.

The prediction is not within 25% of the measurement at most points, and the parameters
were not tuned toward it: this test pins the error actually achieved at every point. The
model is low everywhere; what it misses, from the largest effect down:
1. CPU contention from everything that is not an engine. Each engine's worker is pinned
   to its core, but both engine-core schedulers, both API servers, the proxy and the
   benchmark client float over the same 2 cores, and the benchmark keeps all of them busy
   at once. Even kvpush-pull at 1 req/s, with no queue and no burst, measured TTFT 41.5,
   TPOT 4.4 and E2E 194 ms against 20.7, 2.2 and 88 predicted from the lone probes; one
   streamed request alone took ~100 ms end to end straight to decode and ~150 ms through
   the proxy. The model gives every process the CPU it needs.
2. Whole answers in one burst (the `1 burst` column of `kvpush plan check`): decode's
   server let all 32 tokens go at once in 25-88 % of kvpush-push's answers, 12-33 % of
   vllm-pull-nospin's and 0-4 % of kvpush-pull's; a proxy that logged each chunk it got
   from decode saw whole answers arrive as one chunk. Those requests' TTFT holds their
   whole decode and their TPOT is 0, hence kvpush-push's TTFT -72..-89 % and TPOT
   +55,000 % at 4 req/s. E2E is immune to it.
3. vLLM's pull handoff latency. vllm-pull-nospin's TTFT is 323-658 ms at every rate,
   flat, against 21-39 ms predicted: the connector's own path from prefill's answer to a
   token (completion found by polling, notifications) takes ~300 ms here, and the probes
   keep no latency of a handed-off request, by design (that is what is predicted).
4. vllm-pull's spinning NIXL progress threads: every point stalled in at least one of
   the three iterations, and its probes' step and hook times (11 ms, 100 us per prompt
   token) are the spinner's share of the core at that moment, not at the sweep's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.bench.results import load_results
from kvpush.plan.machine import CheckRow, check, load_profile

DATA = Path(__file__).resolve().parents[1] / "data" / "plan"

# (setup, input tokens, req/s): relative error (predicted - measured) / measured of the p50
# TTFT, TPOT and E2E latency, the measured p50 being the median over the ok iterations (at
# least one was ok at every point; None would mark a point with none).
ACHIEVED: dict[tuple[str, int, float], tuple[float | None, float | None, float | None]] = {
    ("kvpush-pull", 256, 1): (-0.500, -0.509, -0.545),
    ("kvpush-pull", 256, 2): (-0.558, -0.558, -0.605),
    ("kvpush-pull", 256, 4): (-0.543, -0.265, -0.414),
    ("kvpush-pull", 1024, 1): (-0.512, -0.521, -0.525),
    ("kvpush-pull", 1024, 2): (-0.404, -0.523, -0.499),
    ("kvpush-pull", 1024, 4): (-0.598, -0.649, -0.626),
    ("kvpush-push", 256, 1): (-0.715, -0.247, -0.491),
    ("kvpush-push", 256, 2): (-0.829, +0.477, -0.440),
    ("kvpush-push", 256, 4): (-0.885, +557.414, -0.552),
    ("kvpush-push", 1024, 1): (-0.800, -0.162, -0.465),
    ("kvpush-push", 1024, 2): (-0.724, -0.276, -0.472),
    ("kvpush-push", 1024, 4): (-0.877, +597.759, -0.592),
    ("vllm-pull", 256, 1): (-0.636, -0.515, -0.632),
    ("vllm-pull", 256, 2): (-0.889, -0.415, -0.745),
    ("vllm-pull", 256, 4): (-0.981, -0.326, -0.915),
    ("vllm-pull", 1024, 1): (-0.919, -0.623, -0.874),
    ("vllm-pull", 1024, 2): (-0.566, -0.233, -0.379),
    ("vllm-pull", 1024, 4): (-0.757, -0.287, -0.591),
    ("vllm-pull-nospin", 256, 1): (-0.935, -0.553, -0.830),
    ("vllm-pull-nospin", 256, 2): (-0.968, -0.569, -0.900),
    ("vllm-pull-nospin", 256, 4): (-0.952, -0.648, -0.883),
    ("vllm-pull-nospin", 1024, 1): (-0.913, -0.731, -0.859),
    ("vllm-pull-nospin", 1024, 2): (-0.929, -0.504, -0.851),
    ("vllm-pull-nospin", 1024, 4): (-0.897, -0.756, -0.837),
}

# The points the item's 25 % holds at, per metric: TPOT at three, TTFT and E2E at none.
WITHIN_25 = {
    "ttft": set(),
    "tpot": {("kvpush-push", 256, 1), ("kvpush-push", 1024, 1), ("vllm-pull", 1024, 2)},
    "e2el": set(),
}

# The share of answers that came in one burst, median over the iterations: the effect
# (2) above, recorded with the results.
ONE_BURST: dict[tuple[str, int, float], float] = {
    ("kvpush-pull", 256, 1): 0.0,
    ("kvpush-push", 1024, 4): 0.875,
    ("vllm-pull-nospin", 1024, 1): 0.333,
}


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int, float], CheckRow]:
    profile = load_profile(DATA / "profile.json")
    found = check(profile, load_results(DATA / "sweep2"), seeds=10)
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


@pytest.mark.parametrize("point", sorted(ONE_BURST))
def test_the_share_of_answers_in_one_burst_is_reported(
    point: tuple[str, int, float], rows: dict[tuple[str, int, float], CheckRow]
) -> None:
    assert rows[point].measured.one_burst == pytest.approx(ONE_BURST[point], abs=0.001)
