"""`kvpush bench plot` on a real sweep (tests/data/bench/sweep-unpinned: the 2026-11-29
sweep before pinning, whose stalls and bursts exercise every mark): every setup drawn or
explained, coalesced points marked, labels inside the panels, every table mark explained,
the table as CSV, and a one-line error for a broken result file."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest

from kvpush.bench import plot, results
from kvpush.cli import main

UNPINNED = Path(__file__).parent.parent / "data" / "bench" / "sweep-unpinned"


@pytest.fixture(scope="module")
def rows() -> list[results.Aggregate]:
    return results.aggregate(results.load_results(UNPINNED))


def test_every_mark_in_the_table_is_explained_under_it(rows: list[results.Aggregate]) -> None:
    text = plot.table(rows)
    body, notes = text.splitlines()[1:25], text.splitlines()[25:]
    used = {mark for mark in plot.FOOTNOTES if any(mark in line for line in body)}
    assert used == {plot.SHAKY, plot.COALESCED}  # vllm-pull stalled in some runs
    explained = {line[0] for line in notes if line[:2] in {f"{m}:" for m in plot.FOOTNOTES}}
    assert explained == used
    assert "1 of 3 runs was ok" in text


def test_a_coalesced_tpot_is_marked_and_gets_no_ratio(rows: list[results.Aggregate]) -> None:
    text = plot.table(rows).splitlines()
    tpot = text[0].index("TPOT p50")  # the column's cells end where its header does
    line = next(cells for cells in text if cells.split()[:3] == ["256", "4", "kvpush-push"])
    assert line[: tpot + len("TPOT p50")].split()[-1] == "0.0^"
    assert line.split()[-1] == line.split()[-3] == "-"  # TPOT/nospin, TPOT/vLLM


def _histograms(ttft: tuple[float, int], e2e: tuple[float, int] = (0.0, 0)) -> dict[str, float]:
    """A server's scraped deltas: vLLM's TTFT and end-to-end histograms (seconds, count)."""
    return {
        'vllm:time_to_first_token_seconds_sum{engine="0"}': ttft[0],
        'vllm:time_to_first_token_seconds_count{engine="0"}': ttft[1],
        'vllm:e2e_request_latency_seconds_sum{engine="0"}': e2e[0],
        'vllm:e2e_request_latency_seconds_count{engine="0"}': e2e[1],
    }


@pytest.mark.parametrize(
    ("setup", "first_token", "expected"),
    [
        ("kvpush-push", "prefill", 15.0),  # prefill's TTFT: its token is the client's first
        ("kvpush-pull", "prefill", 15.0),
        ("kvpush-push", "decode", 40.0),  # decode's TTFT holds its wait for the KV
        ("vllm-pull", "decode", 20.0 + 40.0),  # the proxy runs prefill's leg, then decode
        ("vllm-pull-nospin", "decode", 20.0 + 40.0),
    ],
)
def test_the_servers_share_of_ttft_comes_from_the_server_that_sends_the_first_token(
    setup: str, first_token: str, expected: float
) -> None:
    prefill = _histograms(ttft=(0.015 * 4, 4), e2e=(0.020 * 4, 4))
    decode = _histograms(ttft=(0.040 * 4, 4), e2e=(0.200 * 4, 4))
    result = {"setup": setup, "first_token": first_token}
    result["metrics"] = {"prefill": prefill, "decode": decode}
    assert results.servers_ttft_ms(result) == pytest.approx(expected)


def test_a_single_server_is_its_own_share_and_old_runs_have_none() -> None:
    single = {"setup": "single", "metrics": {"single": _histograms(ttft=(0.03, 2))}}
    assert results.servers_ttft_ms(single) == pytest.approx(15.0)
    old = {"setup": "kvpush-push", "first_token": "prefill", "metrics": {"prefill": {}}}
    assert results.servers_ttft_ms(old) is None  # recorded before the sweep kept them


def test_the_engine_split_is_the_first_token_servers_queue_and_forward() -> None:
    prefill = {
        'vllm:request_queue_time_seconds_sum{engine="0"}': 0.002 * 4,
        'vllm:request_queue_time_seconds_count{engine="0"}': 4,
        'vllm:request_prefill_time_seconds_sum{engine="0"}': 0.030 * 4,
        'vllm:request_prefill_time_seconds_count{engine="0"}': 4,
    }
    decode = {k: v * 10 for k, v in prefill.items()}
    result = {"setup": "kvpush-push", "first_token": "prefill"}
    result["metrics"] = {"prefill": prefill, "decode": decode}
    assert results.engine_split_ms(result) == pytest.approx((2.0, 30.0))
    single = {"setup": "single", "metrics": {"single": prefill}}
    assert results.engine_split_ms(single) == pytest.approx((2.0, 30.0))
    # decode's first token holds its wait for KV: no single server's split to give
    assert results.engine_split_ms({**result, "first_token": "decode"}) == (None, None)
    old = {"setup": "kvpush-push", "first_token": "prefill", "metrics": {"prefill": {}}}
    assert results.engine_split_ms(old) == (None, None)
    row = results.aggregate([{**result, "status": "ok", "input_len": 256, "rate": 1.0}])[0]
    (line,) = list(csv.DictReader(io.StringIO(plot.table_csv([row]))))
    assert (line["queued_ms"], line["scheduled_to_first_token_ms"]) == ("2", "30")


def test_the_table_gives_the_client_mean_ttft_beside_the_servers_share(
    rows: list[results.Aggregate],
) -> None:
    row = next(r for r in rows if r.setup == "kvpush-push")
    shared = results.Aggregate(**{**{f: getattr(row, f) for f in row.__slots__}})
    shared.ttft_mean, shared.servers_ttft_ms = 31.5, 19.25
    shared.first_from_prefill = 0.875
    text = plot.table([shared])
    header = text.splitlines()[0]
    cells = text.splitlines()[1]
    at = header.index("at servers")
    assert cells[: at + len("at servers")].split()[-2:] == ["31.5", "19.2"]
    assert "at servers: the servers' own share" in text
    (line,) = list(csv.DictReader(io.StringIO(plot.table_csv([shared]))))
    assert (line["ttft_mean_ms"], line["servers_ttft_ms"]) == ("31.5", "19.25")
    assert line["first_token_from_prefill"] == "0.875"
    at = header.index("1st from P")
    assert cells[: at + len("1st from P")].split()[-1] == "88%"


def test_every_setup_has_a_line_or_a_marker_saying_why_not(
    rows: list[results.Aggregate],
) -> None:
    failed = [
        results.Aggregate(
            "vllm-push",
            r.input_len,
            r.rate,
            1,
            0,
            ["failed"],
            ["warm-up"],
            None,
            None,
            None,
            None,
            None,
        )  # fmt: skip
        for r in rows
        if r.setup == "vllm-pull"
    ]
    fig = plot.figure([*rows, *failed])
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:4] == ["kvpush-pull", "kvpush-push", "vllm-pull", "vllm-pull-nospin"]
    assert labels[4] == "vllm-push: no numbers (failed at every point)"
    ttft_256 = fig.axes[0]
    (line,) = [ln for ln in ttft_256.get_lines() if ln.get_label() == "vllm-pull"]
    assert list(line.get_xdata()) == [1.0, 2.0, 4.0]  # stalled in some runs, drawn all the same


def test_coalesced_points_sit_on_the_bottom_edge(rows: list[results.Aggregate]) -> None:
    fig = plot.figure(rows)
    tpot_256 = fig.axes[2]  # row by row: TTFT 256, TTFT 1024, TPOT 256, TPOT 1024
    edge = [ln for ln in tpot_256.get_lines() if ln.get_marker() == "v"]
    assert [list(ln.get_xdata()) for ln in edge if len(ln.get_xdata())] == [[4.0]]


def test_status_labels_stay_inside_their_panel(rows: list[results.Aggregate]) -> None:
    fig = plot.figure(rows)
    renderer = fig.canvas.get_renderer()
    labelled = 0
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        for text in ax.texts:
            extent = text.get_window_extent(renderer)
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1, text.get_text()
            assert box.y0 <= extent.y0 and extent.y1 <= box.y1, text.get_text()
            labelled += 1
    assert labelled == 4 * 3  # vllm-pull was not ok in every run at each of 3 rates


@pytest.mark.parametrize("lens", [(256,), (256, 1024)], ids=["one-length", "two-lengths"])
def test_the_legend_fits_in_the_figure_below_the_panels(
    rows: list[results.Aggregate], lens: tuple[int, ...]
) -> None:
    # `kvpush demo` sweeps one prompt length: one narrow column of panels, whose legend
    # in four columns ran off both sides of the figure.
    fig = plot.figure([r for r in rows if r.input_len in lens])
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width
    assert box.y0 >= 0 and box.y1 <= min(ax.get_tightbbox(renderer).y0 for ax in fig.axes)
    assert len(legend.get_texts()) == 7  # 4 setups, then hollow, cross and coalesced


def test_the_table_as_csv_on_stdout_and_to_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "fig.png"
    assert main(["bench", "plot", str(UNPINNED), "--png", str(png), "--csv"]) == 0
    captured = capsys.readouterr()
    table = list(csv.DictReader(io.StringIO(captured.out)))
    assert len(table) == 24 and f"figure: {png}" in captured.err
    push = next(
        r for r in table if (r["setup"], r["rate"], r["input_len"]) == ("kvpush-push", "4", "256")
    )
    assert push["tpot_coalesced"] == "1" and push["tpot_vs_vllm"] == ""
    assert float(push["ttft_vs_vllm"]) == pytest.approx(124.3 / 5185.6, rel=1e-3)
    assert push["ttft_vs_vllm_shaky"] == "1" and push["ttft_vs_nospin_shaky"] == "0"
    out = tmp_path / "table.csv"
    assert main(["bench", "plot", str(UNPINNED), "--png", str(png), "--csv", str(out)]) == 0
    captured = capsys.readouterr()
    assert "TTFT/vLLM" in captured.out and f"table: {out}" in captured.out
    assert out.read_text() == plot.table_csv(results.aggregate(results.load_results(UNPINNED)))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"rate": None}, "field 'rate' is missing"),
        ({"setup": None}, "field 'setup' is missing"),
        ({"input_len": "256"}, "field 'input_len' is '256', not a int"),
        ({"ttft": 12.0}, "field 'ttft' is 12.0, not {'p50': ms"),
        ({"completed": "all"}, "field 'completed' is 'all', not a number"),
    ],
)
def test_a_broken_result_file_is_one_line_naming_file_and_field(
    change: dict[str, object], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(UNPINNED, tmp_path / "sweep")
    broken = tmp_path / "sweep" / "vllm-pull_qps2_in256_out32_iter1.json"
    data = json.loads(broken.read_text())
    for key, value in change.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    broken.write_text(json.dumps(data))
    assert main(["bench", "plot", str(tmp_path / "sweep")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"kvpush bench plot: {broken}: {says}")
    assert "remove the file" in line


def test_an_unwritable_figure_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "plot", str(UNPINNED), "--png", "/proc/no/fig.png"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert "cannot write" in captured.err and "--png" in captured.err
