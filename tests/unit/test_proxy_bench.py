"""`kvpush proxy bench`: its arithmetic and a tiny real run (no timing is asserted)."""

from __future__ import annotations

import math

import pytest

from kvpush.proxy.bench import BenchSpec, Row, Run, drive, measure, render
from kvpush.proxy.stub import StubBackend, StubBehaviour, serve_stub


def run(ttft_ms: list[float], total_ms: list[float] | None = None, completed: int = 10) -> Run:
    ttft, total = [t / 1e3 for t in ttft_ms], [t / 1e3 for t in total_ms or []]
    return Run(ttft, total, completed, 2.0, 0, completed, proxy_cpu=completed * 0.0005)


def test_added_latency_is_the_median_over_repeats_of_proxy_minus_direct() -> None:
    row = Row(
        64,
        direct=[run([1, 1, 1]), run([2, 2, 2]), run([1, 1, 1])],
        proxy=[run([2, 2, 2]), run([2.5, 2.5, 2.5]), run([4, 4, 4])],
    )
    added = row.added(lambda r: r.stat("ttft", 50))
    assert added == pytest.approx(0.001)  # differences 1, 0.5, 3 ms: median 1 ms
    assert math.isnan(row.added(lambda r: r.stat("total", 50)))  # one stream: no load streams


def test_the_table_has_a_row_per_stream_count_and_the_throughput_line() -> None:
    spec = BenchSpec(streams=(1, 64), repeats=1)
    rows = [Row(n, [run([1], [300])], [run([1.4], [301])]) for n in spec.streams]
    throughput = Row(64, [run([], completed=9000)], [run([], completed=3000)])
    text = render(spec, rows, throughput, load=0.5)
    lines = text.splitlines()
    assert any(line.split()[:4] == ["1", "1.00", "1.40", "0.40"] for line in lines)
    assert any(line.startswith("64 ") for line in lines)
    assert "direct 4500 req/s, through the proxy 1500 req/s" in text
    assert "0.50 ms per request, 2000 req/s per core" in text


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"mode": "both"}, "push or pull"),
        ({"streams": (0,)}, "must be positive"),
        ({"repeats": 0}, "--repeats at least 1"),
        ({"tokens": 0}, "--tokens must be positive"),
    ],
)
def test_bad_settings_are_refused(change: dict[str, object], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        BenchSpec(**change)  # type: ignore[arg-type]


async def test_a_run_times_the_probe_and_the_load_streams() -> None:
    stub = StubBackend("decode", StubBehaviour(tokens=("a", "b", "c"), token_gap=0.01))
    runner, url = await serve_stub(stub)
    try:
        spec = BenchSpec(seconds=0.3, warmup=0.05, tokens=3)
        result = await drive(url + "/v1/completions", 3, spec)
    finally:
        await runner.cleanup()
    assert result.ttft and result.total and result.errors == 0
    assert min(result.total) >= 0.02  # three chunks 10 ms apart
    assert all(body["max_tokens"] in (1, 3) for _, body in stub.received)


def test_the_benchmark_runs_end_to_end_in_its_own_processes() -> None:
    spec = BenchSpec(
        streams=(2,),
        seconds=0.3,
        warmup=0.1,
        repeats=1,
        tokens=2,
        token_gap=0.005,
        throughput_streams=2,
    )
    lines: list[str] = []
    rows, throughput = measure(spec, lines.append)
    assert len(lines) == 4 and rows[0].streams == 2
    assert rows[0].proxy[0].ttft and throughput.proxy[0].completed > 0
    assert rows[0].proxy[0].errors == 0 and throughput.proxy[0].errors == 0
    assert throughput.proxy[0].proxy_cpu > 0 and math.isnan(throughput.direct[0].proxy_cpu)
