"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see docs/planning.md):
- sweep-pinned/: the pinned reference sweep, `kvpush bench sweep --setups
  kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull,single --rates 1,2,4 --input-lens
  256,1024 --num-prompts 24 --iterations 2` (32 output tokens, --max-num-seqs 8), every
  server's whole process tree on its own core, 2026-11-30 18:42-19:18, each point with its
  own dataset seed (eabf6e2), the result files as written. 60 of 60 runs ok.
- profile.json: `kvpush plan measure` (command inside), pinned, 2026-11-30 19:20-19:27 on
  the same host as the sweep. Every parameter comes from probes without a handoff,
  kvpush's transfer metrics and the NIXL bandwidth measured once - none from these results.

The prediction is within 25 % at 10 of 72 points and low almost everywhere; the parameters
were not tuned toward it: this test pins the error actually achieved at every point. kvpush
is predicted 20-30 % low at most points and far lower where prefill's one core saturates
(1024 tokens, 4 req/s, push -78 %); vLLM's connectors are predicted 22-94 % low: their pull
handoff latency (vllm-pull-nospin's TTFT 120-3,860 ms against 52-220 predicted) is kept by
no probe. The client and the proxy share the two cores with the servers, which the model
does not see. No answer came in one burst.
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
    ('kvpush-pull', 256, 1): (-0.322, -0.306, -0.312),
    ('kvpush-pull', 256, 2): (-0.411, -0.250, -0.305),
    ('kvpush-pull', 256, 4): (-0.274, -0.080, -0.134),
    ('kvpush-pull', 1024, 1): (-0.294, -0.106, -0.259),
    ('kvpush-pull', 1024, 2): (-0.192, -0.136, -0.179),
    ('kvpush-pull', 1024, 4): (-0.591, -0.117, -0.439),
    ('kvpush-push', 256, 1): (-0.284, -0.232, -0.250),
    ('kvpush-push', 256, 2): (-0.276, -0.255, -0.270),
    ('kvpush-push', 256, 4): (-0.303, -0.271, -0.257),
    ('kvpush-push', 1024, 1): (-0.296, -0.265, -0.305),
    ('kvpush-push', 1024, 2): (-0.221, -0.310, -0.281),
    ('kvpush-push', 1024, 4): (-0.780, -0.364, -0.672),
    ('vllm-pull', 256, 1): (-0.218, -0.537, -0.459),
    ('vllm-pull', 256, 2): (-0.579, -0.609, -0.600),
    ('vllm-pull', 256, 4): (-0.453, -0.638, -0.587),
    ('vllm-pull', 1024, 1): (-0.333, -0.542, -0.420),
    ('vllm-pull', 1024, 2): (-0.365, -0.504, -0.385),
    ('vllm-pull', 1024, 4): (-0.339, -0.518, -0.355),
    ('vllm-pull-nospin', 256, 1): (-0.567, -0.677, -0.648),
    ('vllm-pull-nospin', 256, 2): (-0.671, -0.679, -0.683),
    ('vllm-pull-nospin', 256, 4): (-0.690, -0.599, -0.623),
    ('vllm-pull-nospin', 1024, 1): (-0.679, -0.603, -0.627),
    ('vllm-pull-nospin', 1024, 2): (-0.851, -0.634, -0.790),
    ('vllm-pull-nospin', 1024, 4): (-0.943, -0.595, -0.913),
}

# The points the item's 25 % holds at, per metric.
WITHIN_25 = {
    "ttft": {("kvpush-pull", 1024, 2), ("kvpush-push", 1024, 2), ("vllm-pull", 256, 1)},
    "tpot": {
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
    },
    "e2el": {("kvpush-pull", 256, 4), ("kvpush-pull", 1024, 2)},
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
