"""Streaming quality as a number: the share of tokens that reached the client late.

A token is late when it arrived more than two decode steps after it was produced, "produced"
being the latest time the engine could have made it (one step before the next token, never
after it arrived); see `kvpush.bench.results.late_count`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpush.bench import plot, results, sweep
from kvpush.bench.results import late_count, late_tokens, token_arrivals
from kvpush.plan.machine import measured_points
from kvpush.plan.machine_cli import render_check

UNPINNED = Path(__file__).parent.parent / "data" / "bench" / "sweep-unpinned"
STEP = 0.004  # s


def stream(gaps: list[float], ttft: float = 0.05) -> list[float]:
    return token_arrivals(ttft, gaps, len(gaps) + 1)


def test_a_stream_that_keeps_up_has_no_late_token() -> None:
    assert late_count(stream([STEP] * 31), STEP) == 0
    assert late_count(stream([STEP * 1.5] * 31), STEP) == 0  # slower than a step: still on time


def test_an_answer_sent_in_one_burst_is_late_but_for_its_last_tokens() -> None:
    burst = token_arrivals(0.2, [], 32)  # one chunk held all 32 tokens
    assert burst == [0.2] * 32
    assert late_count(burst, STEP) == 29  # the k-th waited 31 - k steps


def test_small_clumps_are_tolerated_and_longer_ones_counted() -> None:
    three = [STEP] * 10 + [3 * STEP, 0.0, 0.0] + [STEP] * 10  # 3 tokens at once: <= 2 steps
    assert late_count(stream(three), STEP) == 0
    six = [STEP] * 10 + [6 * STEP, 0, 0, 0, 0, 0] + [STEP] * 10  # 6 at once: 3 late
    assert late_count(stream(six), STEP) == 3


def test_chunks_holding_several_tokens_put_the_rest_in_the_last() -> None:
    assert token_arrivals(1.0, [0.5, 0.25], 5) == [1.0, 1.5, 1.75, 1.75, 1.75]


def raw(ttfts: list[float], itls: list[list[float]], outputs: list[int]) -> dict[str, Any]:
    return {"ttfts": ttfts, "itls": itls, "output_lens": outputs}


def test_the_step_is_the_shorter_of_decodes_mean_and_the_runs_fastest_cadence() -> None:
    steady, burst = [STEP] * 31, []
    data = raw([0.05, 0.3], [steady, burst], [32, 32])
    engine = late_tokens(data, STEP * 1e3)
    assert engine == {
        "late_tokens": 29 / 64,
        "late_step_ms": STEP * 1e3,
        "late_step_from": "decode engine mean",
    }
    client = late_tokens(data, None)  # the burst's gaps (none) are left out
    assert client["late_step_from"] == "client gaps p10"
    assert client["late_step_ms"] == pytest.approx(STEP * 1e3)
    assert client["late_tokens"] == 29 / 64
    assert late_tokens(data, 3 * STEP * 1e3)["late_step_from"] == "client gaps p10"
    assert late_tokens({"ttfts": [0.1]}, STEP)["late_tokens"] is None  # not --save-detailed
    summary = results.summarise_bench({**data, "completed": 2}, STEP * 1e3)
    assert summary["late_tokens"] == 29 / 64 and summary["one_burst"] is None  # no latencies


def test_a_stream_that_speeds_up_is_not_late_though_faster_than_the_mean_step() -> None:
    # slow steps then fast ones (a batch emptied): the mean step would make the fast ones'
    # predecessors look held back by up to 10 x (mean - fast)
    gaps = [2 * STEP] * 15 + [STEP / 2] * 16
    mean_ms = sum(gaps) / len(gaps) * 1e3
    assert late_count(stream(gaps), mean_ms / 1e3) > 0  # what the mean alone would claim
    found = late_tokens(raw([0.05] * 10, [gaps] * 10, [32] * 10), mean_ms)
    assert found["late_tokens"] == 0 and found["late_step_from"] == "client gaps p10"


def test_the_engine_step_comes_from_decodes_inter_token_histogram() -> None:
    deltas = {
        'vllm:inter_token_latency_seconds_sum{engine="0"}': 0.62,
        'vllm:inter_token_latency_seconds_count{engine="0"}': 155.0,
    }
    assert sweep.engine_step_ms(deltas) == pytest.approx(4.0)
    assert sweep.engine_step_ms({}) is None and sweep.engine_step_ms(None) is None
    kept = sweep.metric_deltas(
        {("vllm:inter_token_latency_seconds_count", ()): 5.0},
        {("vllm:inter_token_latency_seconds_count", ()): 9.0},
    )
    assert kept == {"vllm:inter_token_latency_seconds_count": 4.0}


def test_the_progress_line_table_and_plan_check_show_it() -> None:
    loaded = results.load_results(UNPINNED)
    for record in loaded:  # the unpinned sweep predates the metric: give some runs one
        if record["setup"] == "kvpush-push" and record["status"] == "ok":
            record["late_tokens"] = 0.5 if record["rate"] == 4 else 0.1
    record = next(r for r in loaded if r["setup"] == "kvpush-push" and r["rate"] == 4)
    assert "50% of tokens late (>2 steps)" in sweep.describe(record)
    rows = results.aggregate(loaded)
    table = plot.table(rows)
    header = table.splitlines()[0].split()
    late = header.index("late")
    assert header[late - 2 : late + 1] == ["1", "burst", "late"]
    cells = {
        tuple(line.split()[:3]): line.split()
        for line in table.splitlines()[1:]
        if line[:1].isdigit()
    }
    push4, pull4 = cells["256", "4", "kvpush-push"], cells["256", "4", "kvpush-pull"]
    assert push4[push4.index("79%") + 1] == "50%"
    assert pull4[pull4.index("4%") + 1] == "-"  # no late share recorded: a dash
    assert "late: output tokens that reached the client more than 2 decode steps" in table
    csv_rows = plot.table_csv(rows).splitlines()
    assert "late_tokens" in csv_rows[0].split(",")
    points = measured_points(loaded)
    assert {p.late_tokens for p in points if p.setup == "kvpush-push"} == {0.5, 0.1}
    from kvpush.plan.machine import CheckRow

    check = render_check([CheckRow(p, 1.0, 1.0, 1.0) for p in points if p.rate == 4])
    assert "1 burst  late" in check.splitlines()[0]
