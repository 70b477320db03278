"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see docs/planning.md):
- sweep-pinned/: the pinned reference sweep, `kvpush bench sweep --setups
  kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull,single --rates 1,2,4 --input-lens
  256,1024 --num-prompts 24 --iterations 2` (32 output tokens, --max-num-seqs 8), every
  server's whole process tree on its own core, 2026-11-30 11:32-11:50 and 12:23-12:40, the
  result files as written (iteration 1's `late_tokens` recomputed from each run's own `vllm
  bench serve` data with the step rule of f438b31). Two iterations, the second without
  single's two runs at 1024 tokens and 2-4 req/s (its turn on the shared box ran out); the
  third got no turn in time.
- profile.json: `kvpush plan measure` (command inside), 2026-11-29 18:00-18:06, unpinned
  and on the VM's previous host (AVX-512); not re-measured pinned (no lock turn). Every
  parameter comes from probes without a handoff, kvpush's transfer metrics and the NIXL
  bandwidth measured once - none from these results.

The prediction is not within 25% of the measurement at most points, and the parameters
were not tuned toward it: this test pins the error actually achieved at every point. The
model is low almost everywhere, and by more than on the unpinned sweep of 2026-11-29: that sweep
ran on the profile's host, this one on a host without AVX-512 (vLLM's AVX2 kernels), which
the profile never saw (TPOT 5-13 ms measured against 2.1-2.3 predicted, vllm-pull aside).
What else it misses: the client and the proxy share the two cores with the servers, and
vLLM's pull handoff latency (vllm-pull-nospin's TTFT ~90-360 ms against 21-39 predicted)
is kept by no probe. No answer came in one burst (`one_burst` 0 at every point; 25-88 % of
kvpush-push's before pinning).
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
    ("kvpush-pull", 256, 1): (-0.750, -0.681, -0.702),
    ("kvpush-pull", 256, 2): (-0.702, -0.604, -0.652),
    ("kvpush-pull", 256, 4): (-0.738, -0.753, -0.745),
    ("kvpush-pull", 1024, 1): (-0.848, -0.728, -0.781),
    ("kvpush-pull", 1024, 2): (-0.699, -0.766, -0.755),
    ("kvpush-pull", 1024, 4): (-0.688, -0.758, -0.732),
    ("kvpush-push", 256, 1): (-0.821, -0.671, -0.717),
    ("kvpush-push", 256, 2): (-0.618, -0.653, -0.665),
    ("kvpush-push", 256, 4): (-0.606, -0.660, -0.653),
    ("kvpush-push", 1024, 1): (-0.870, -0.700, -0.772),
    ("kvpush-push", 1024, 2): (-0.400, -0.622, -0.587),
    ("kvpush-push", 1024, 4): (-0.409, -0.631, -0.593),
    ("vllm-pull", 256, 1): (-0.633, -0.379, -0.441),
    ("vllm-pull", 256, 2): (-0.590, -0.542, -0.560),
    ("vllm-pull", 256, 4): (-0.643, -0.578, -0.600),
    ("vllm-pull", 1024, 1): (-0.707, -0.505, -0.615),
    ("vllm-pull", 1024, 2): (+0.093, -0.283, -0.177),
    ("vllm-pull", 1024, 4): (+0.685, -0.040, +0.152),
    ("vllm-pull-nospin", 256, 1): (-0.853, -0.826, -0.834),
    ("vllm-pull-nospin", 256, 2): (-0.770, -0.800, -0.795),
    ("vllm-pull-nospin", 256, 4): (-0.807, -0.809, -0.804),
    ("vllm-pull-nospin", 1024, 1): (-0.891, -0.767, -0.825),
    ("vllm-pull-nospin", 1024, 2): (-0.640, -0.776, -0.748),
    ("vllm-pull-nospin", 1024, 4): (-0.692, -0.748, -0.735),
}

# The points the item's 25 % holds at, per metric: all of them vllm-pull's, at 1024 tokens.
WITHIN_25 = {
    "ttft": {("vllm-pull", 1024, 2)},
    "tpot": {("vllm-pull", 1024, 4)},
    "e2el": {("vllm-pull", 1024, 2), ("vllm-pull", 1024, 4)},
}

# The share of answers that came in one burst: none anywhere once pinned (kvpush-push at
# 1024 tokens and 4 req/s was 0.875 before pinning).
ONE_BURST: dict[tuple[str, int, float], float] = {
    ("kvpush-pull", 256, 1): 0.0,
    ("kvpush-push", 1024, 4): 0.0,
    ("vllm-pull-nospin", 1024, 1): 0.0,
}


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int, float], CheckRow]:
    profile = load_profile(DATA / "profile.json")
    found = check(profile, load_results(DATA / "sweep-pinned"), seeds=10)
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
