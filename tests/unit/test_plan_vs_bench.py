"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see docs/planning.md):
- sweep-pinned/: the pinned reference sweep, `kvpush bench sweep --setups
  kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull,single --rates 1,2,4 --input-lens
  256,1024 --num-prompts 24 --iterations 3` (32 output tokens, --max-num-seqs 8), every
  server's whole process tree on its own core, each point with its own dataset seed
  (eabf6e2), the result files as written: 2026-12-01 01:35-02:29 at 8932cb7 (kvpush hands
  a step's specs over before the forward since 49247aa). 90 of 90 ok.
- profile.json: `kvpush plan measure` (command inside), pinned, 2026-11-30 19:20-19:27 on
  the same host as the sweep. Every parameter comes from probes without a handoff,
  kvpush's transfer metrics and the NIXL bandwidth measured once - none from these results.

The prediction is within 25 % at 22 of 72 point-metrics and low almost everywhere; the
parameters were not tuned toward it: this test pins the error actually achieved at every
point. kvpush is predicted between 40 % and 3 % low everywhere but where prefill's one
core saturates (1024 tokens, 4 req/s: TTFT -55 % pull, -52 % push); vLLM's connectors are
predicted 12-95 % low: their pull handoff latency (vllm-pull-nospin's TTFT 121-4,817 ms)
is kept by no probe. The profile was measured before 49247aa, whose earlier hand-off is not
in its parameters. The client and the proxy share the two cores with the servers, which
the model does not see. No answer came in one burst.
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
    ("kvpush-pull", 256, 1): (-0.402, -0.278, -0.304),
    ("kvpush-pull", 256, 2): (-0.337, -0.296, -0.313),
    ("kvpush-pull", 256, 4): (-0.360, -0.284, -0.312),
    ("kvpush-pull", 1024, 1): (-0.216, -0.129, -0.203),
    ("kvpush-pull", 1024, 2): (-0.223, -0.213, -0.207),
    ("kvpush-pull", 1024, 4): (-0.552, -0.026, -0.390),
    ("kvpush-push", 256, 1): (-0.341, -0.184, -0.193),
    ("kvpush-push", 256, 2): (-0.330, -0.238, -0.273),
    ("kvpush-push", 256, 4): (-0.244, -0.119, -0.150),
    ("kvpush-push", 1024, 1): (-0.217, -0.096, -0.253),
    ("kvpush-push", 1024, 2): (-0.246, -0.183, -0.276),
    ("kvpush-push", 1024, 4): (-0.518, -0.085, -0.407),
    ("vllm-pull", 256, 1): (-0.154, -0.510, -0.428),
    ("vllm-pull", 256, 2): (-0.304, -0.481, -0.468),
    ("vllm-pull", 256, 4): (-0.291, -0.563, -0.495),
    ("vllm-pull", 1024, 1): (-0.198, -0.478, -0.290),
    ("vllm-pull", 1024, 2): (-0.119, -0.445, -0.237),
    ("vllm-pull", 1024, 4): (-0.260, -0.446, -0.288),
    ("vllm-pull-nospin", 256, 1): (-0.570, -0.718, -0.706),
    ("vllm-pull-nospin", 256, 2): (-0.660, -0.652, -0.663),
    ("vllm-pull-nospin", 256, 4): (-0.704, -0.647, -0.655),
    ("vllm-pull-nospin", 1024, 1): (-0.739, -0.697, -0.731),
    ("vllm-pull-nospin", 1024, 2): (-0.897, -0.662, -0.851),
    ("vllm-pull-nospin", 1024, 4): (-0.954, -0.642, -0.931),
}

# The points the item's 25 % holds at, per metric.
WITHIN_25 = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 1024, 1),
        ("vllm-pull", 1024, 2),
    },
    "tpot": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("kvpush-push", 1024, 4),
    },
    "e2el": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 4),
        ("vllm-pull", 1024, 2),
    },
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
