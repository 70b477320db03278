"""The simulator against this machine: `kvpush plan check` on a recorded `kvpush bench` sweep.

Fixtures in tests/data/plan/, as recorded (see docs/planning.md):
- sweep-pinned/: the pinned reference sweep, `kvpush bench sweep --setups
  kvpush-push,kvpush-pull,vllm-pull-nospin,vllm-pull,single --rates 1,2,4 --input-lens
  256,1024 --num-prompts 24 --iterations 3` (32 output tokens, --max-num-seqs 8), every
  server's whole process tree on its own core, each point with its own dataset seed
  (eabf6e2), the result files as written: iterations 1-2 2026-11-30 18:42-19:18 at
  e7df3de, iteration 3 (the same command resumed) 21:44-22:01 at ceb11fb. 90 of 90 ok.
- profile.json: `kvpush plan measure` (command inside), pinned, 2026-11-30 19:20-19:27 on
  the same host as the sweep. Every parameter comes from probes without a handoff,
  kvpush's transfer metrics and the NIXL bandwidth measured once - none from these results.

The prediction is within 25 % at 26 of 72 point-metrics and low almost everywhere; the
parameters were not tuned toward it: this test pins the error actually achieved at every
point. kvpush is predicted between 33 % low and 10 % high everywhere but where prefill's one
core saturates (1024 tokens, 4 req/s: TTFT -58 % pull, -65 % push); vLLM's connectors are
predicted 19-94 % low: their pull handoff latency (vllm-pull-nospin's TTFT 117-3,459 ms)
is kept by no probe. The client and the proxy share the two cores with the servers, which
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
    ("kvpush-pull", 256, 1): (-0.311, -0.277, -0.283),
    ("kvpush-pull", 256, 2): (-0.260, 0.104, -0.003),
    ("kvpush-pull", 256, 4): (-0.259, 0.012, -0.048),
    ("kvpush-pull", 1024, 1): (-0.214, -0.045, -0.231),
    ("kvpush-pull", 1024, 2): (-0.176, 0.016, -0.142),
    ("kvpush-pull", 1024, 4): (-0.580, 0.001, -0.406),
    ("kvpush-push", 256, 1): (-0.210, -0.189, -0.195),
    ("kvpush-push", 256, 2): (-0.247, -0.163, -0.182),
    ("kvpush-push", 256, 4): (-0.331, -0.215, -0.287),
    ("kvpush-push", 1024, 1): (-0.231, -0.134, -0.279),
    ("kvpush-push", 1024, 2): (-0.170, -0.071, -0.164),
    ("kvpush-push", 1024, 4): (-0.653, -0.284, -0.520),
    ("vllm-pull", 256, 1): (-0.189, -0.510, -0.424),
    ("vllm-pull", 256, 2): (-0.537, -0.545, -0.581),
    ("vllm-pull", 256, 4): (-0.191, -0.529, -0.450),
    ("vllm-pull", 1024, 1): (-0.277, -0.511, -0.372),
    ("vllm-pull", 1024, 2): (-0.221, -0.419, -0.251),
    ("vllm-pull", 1024, 4): (-0.275, -0.505, -0.292),
    ("vllm-pull-nospin", 256, 1): (-0.553, -0.676, -0.644),
    ("vllm-pull-nospin", 256, 2): (-0.663, -0.671, -0.662),
    ("vllm-pull-nospin", 256, 4): (-0.669, -0.598, -0.620),
    ("vllm-pull-nospin", 1024, 1): (-0.655, -0.555, -0.610),
    ("vllm-pull-nospin", 1024, 2): (-0.848, -0.615, -0.783),
    ("vllm-pull-nospin", 1024, 4): (-0.936, -0.528, -0.903),
}

# The points the item's 25 % holds at, per metric.
WITHIN_25 = {
    "ttft": {
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
        ("vllm-pull", 256, 1),
        ("vllm-pull", 256, 4),
        ("vllm-pull", 1024, 2),
    },
    "tpot": {
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-pull", 1024, 4),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 256, 4),
        ("kvpush-push", 1024, 1),
        ("kvpush-push", 1024, 2),
    },
    "e2el": {
        ("kvpush-pull", 256, 2),
        ("kvpush-pull", 256, 4),
        ("kvpush-pull", 1024, 1),
        ("kvpush-pull", 1024, 2),
        ("kvpush-push", 256, 1),
        ("kvpush-push", 256, 2),
        ("kvpush-push", 1024, 2),
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
