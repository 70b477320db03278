"""`kvpush bench plot DIR`: TTFT and TPOT versus request rate, and the ratio table.

One panel per input length, one line per setup, for TTFT and for TPOT (p50 as lines, p99
dashed), medians over iterations. Every setup in the legend has a line or says why not:
- a point where a setup was not ok in every iteration (stalled, failed, not started) gets a
  red cross in a band at the top of its panel with the status; where some of its runs were
  ok (or some requests finished), the number is drawn too, as a hollow marker;
- a TPOT p50 of ~0 (the tokens reached the client together: a coalesced stream) is no
  measurement and cannot sit on a log axis, so it is a triangle on the panel's bottom edge.
The table gives each setup's TTFT and TPOT as a ratio to the best of vLLM's connectors at
that point (below 1: better than vLLM's best); when the sweep has `*-nospin` setups, a
second ratio compares with the best of those, and when it has `single` (one plain server,
not disaggregated), a third with that. It shows how well each setup's answers streamed:
the share sent in one burst and the share of tokens that arrived late. Every mark in the
table is explained under it. `table_csv` gives the same table as CSV, with plain numbers
and the marks as columns.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvpush.bench.results import LATE_STEPS, Aggregate
from kvpush.report import format_table

SHIPPED = ("vllm-pull", "vllm-push")
SINGLE = "single"  # kvpush.testbed.topology.SINGLE, not imported: plotting needs no testbed
METRICS = ("ttft_p50", "tpot_p50")

# Below this a p50 (ms) is no measurement of the setup but of the client: the stream's
# chunks reached it together (a starved proxy or client coalesces them), and a ratio
# with it would be meaningless.
MIN_REFERENCE_MS = 0.1

# The table's marks, in the order their footnotes are printed.
PARTIAL, SHAKY, COALESCED = "*", "~", "^"
FOOTNOTES = {
    PARTIAL: "no run was ok there; the numbers are of the requests that finished before "
    "the others timed out, so they understate that setup's latency",
    SHAKY: "no vLLM setup of that kind was ok in every run there; the ratio is to the best "
    "of those with numbers (medians of their ok runs, or of the requests that finished "
    "where no run was ok), so it is less sure",
    COALESCED: f"under {MIN_REFERENCE_MS} ms: the tokens reached the client together "
    "(chunks coalesced on a busy machine), no measurement of the setup; no ratio is taken "
    "with it, and the figure marks it on the bottom edge",
}


def is_vllm(setup: str) -> bool:
    return setup.startswith("vllm-")


def line_style(setup: str) -> Literal["-", ":", "-."]:
    """Solid for a setup as shipped, dotted for a vllm-*-nospin one, dash-dot for single."""
    if setup == SINGLE:
        return "-."
    return ":" if setup.endswith("-nospin") else "-"


def _shipped_vllm(setup: str) -> bool:
    return is_vllm(setup) and not setup.endswith("-nospin")


def _nospin(setup: str) -> bool:
    return is_vllm(setup) and setup.endswith("-nospin")


def _single(setup: str) -> bool:
    return setup == SINGLE


# The references a ratio column can be taken against: which setups are candidates.
REFERENCES: dict[str, Callable[[str], bool]] = {
    "vLLM": _shipped_vllm,
    "nospin": _nospin,
    "single": _single,
}


def coalesced(value: float | None) -> bool:
    return value is not None and value < MIN_REFERENCE_MS


@dataclass(frozen=True, slots=True)
class Reference:
    """The best vLLM p50 at a point; `shaky` when no candidate was ok in every run."""

    value: float | None
    shaky: bool


def best(rows: Sequence[Aggregate], metric: str, kind: str) -> Reference:
    """The lowest `metric` among the setups of a `REFERENCES` kind: vLLM's as shipped
    ("vLLM"), its nospin ones ("nospin"), or the single server ("single").

    Setups whose runs were all ok come first; only when none was are the numbers of the
    others used (their ok runs, or the requests that finished).
    """
    candidates = [r for r in rows if REFERENCES[kind](r.setup) and getattr(r, metric) is not None]
    ok = [getattr(r, metric) for r in candidates if r.status == "ok"]
    if ok:
        return Reference(min(ok), False)
    others = [getattr(r, metric) for r in candidates]
    return Reference(min(others), True) if others else Reference(None, False)


@dataclass(frozen=True, slots=True)
class Ratio:
    value: float | None  # None: no reference, or a coalesced p50 on either side
    shaky: bool = False

    def cell(self) -> str:
        if self.value is None:
            return "-"
        return f"{self.value:.2f}x" + (SHAKY if self.shaky else "")


def ratio(value: float | None, reference: Reference) -> Ratio:
    ref = reference.value
    if value is None or ref is None or coalesced(value) or coalesced(ref):
        return Ratio(None)
    return Ratio(value / ref, reference.shaky)


@dataclass(frozen=True, slots=True)
class Line:
    """One row of the table: a setup at a point, with its ratios by column name."""

    row: Aggregate
    ratios: dict[str, Ratio]


def ratio_columns(rows: Sequence[Aggregate]) -> list[tuple[str, str, str]]:
    """(column, metric, reference kind) for each ratio column the table has: against vLLM,
    and against the nospin setups and the single server where the sweep has them."""
    kinds = ["vLLM"] + [
        kind for kind in ("nospin", "single") if any(REFERENCES[kind](r.setup) for r in rows)
    ]
    return [(f"{metric[:4].upper()}/{kind}", metric, kind) for kind in kinds for metric in METRICS]


def lines(rows: Sequence[Aggregate]) -> list[Line]:
    """The table's rows, by point and setup, with their ratios to vLLM's best there."""
    columns = ratio_columns(rows)
    out = []
    for point in sorted({(r.input_len, r.rate) for r in rows}):
        here = [r for r in rows if (r.input_len, r.rate) == point]
        refs = {(m, k): best(here, m, k) for _, m, k in columns}
        for r in sorted(here, key=lambda r: r.setup):
            ratios = {col: ratio(getattr(r, m), refs[m, k]) for col, m, k in columns}
            out.append(Line(r, ratios))
    return out


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def result_cell(r: Aggregate) -> str:
    result = r.status
    if r.runs > 1:
        result += f" {r.ok}/{r.runs}"
    if r.status != "ok":
        result += f" ({r.completed}/{r.requests} done)"
    return result


def _ms(value: float | None, partial: bool) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" + (PARTIAL if partial else "") + (COALESCED if coalesced(value) else "")


def table(rows: Sequence[Aggregate]) -> str:
    """The per-point table with ratios to the best vLLM connector, and what its marks mean."""
    columns = [col for col, _, _ in ratio_columns(rows)]
    header = ["in", "qps", "setup", "result", "TTFT p50", "TTFT p99", "2nd token p50"]
    header += ["TTFT mean", "at servers", "TPOT p50", "TPOT p99", "decode step", "req/s"]
    header += ["1 burst", "late", "1st from P", *columns]
    cells = []
    for line in lines(rows):
        r = line.row
        cells.append(
            [
                str(r.input_len),
                f"{r.rate:g}",
                r.setup,
                result_cell(r),
                *(_ms(v, r.partial) for v in (r.ttft_p50, r.ttft_p99, r.tt2t_p50)),
                _ms(r.ttft_mean, r.partial),
                "-" if r.servers_ttft_ms is None else f"{r.servers_ttft_ms:.1f}",
                *(_ms(v, r.partial) for v in (r.tpot_p50, r.tpot_p99)),
                "-" if r.decode_step_ms is None else f"{r.decode_step_ms:.1f}",
                "-" if r.throughput is None else f"{r.throughput:.2f}",
                share(r.one_burst),
                share(r.late_tokens),
                share(r.first_from_prefill),
                *(line.ratios[col].cell() for col in columns),
            ]
        )
    notes = [
        "latencies in ms: medians over iterations of each run's p50 / p99; 2nd token: "
        "the time to it (with the first token from prefill, TTFT is prefill's leg and the "
        "handoff shows here); "
        "X/vLLM: this setup's p50 divided by the best vLLM connector as shipped "
        f"({', '.join(SHIPPED)}) at that point, ok in every run if one was; "
        "below 1.00x is better",
        "TTFT mean: the client's; at servers: the servers' own share of it (vLLM's "
        "arrival-to-first-token means on the server that sends the first token, with "
        "prefill's one-token leg added for pull from decode), median over runs; the rest "
        "is the proxy's and the client's, waits for a core included",
        "decode step: decode's engine's mean time per token over the run (vLLM's "
        "inter-token histogram on the decode server, or the single server), median over "
        "runs: TPOT without the proxy and the client",
    ]
    if any(col.endswith("/nospin") for col in columns):
        notes.append("X/nospin: the same against the best vllm-*-nospin setup")
    if any(col.endswith("/single") for col in columns):
        notes.append(
            "X/single: the same against one plain vLLM server on the pair's cores (not "
            "disaggregated, no proxy): above 1.00x disaggregating costs, below it wins"
        )
    notes.append(
        "1 burst: answers whose tokens all reached the client at once; late: output tokens "
        f"that reached the client more than {LATE_STEPS} decode steps after they were "
        "produced (medians over runs; docs/benchmarks.md); 1st from P: streams whose "
        "first token the proxy took from prefill (the rest waited for decode's)"
    )
    if any(r.status != "ok" and r.ok for r in rows):
        notes.append(
            "result 'stalled 1/3': 1 of 3 runs was ok; the latencies are medians of the ok runs"
        )
    used = "".join(cell for row in cells for cell in row[4:])
    notes += [f"{mark}: {text}" for mark, text in FOOTNOTES.items() if mark in used]
    for r in rows:
        if r.status != "ok":
            reason = r.reasons[0] if r.reasons else "no reason recorded"
            notes.append(f"{r.setup} at {r.rate:g} qps, {r.input_len} in: {r.status} ({reason})")
    return format_table(header, cells) + "\n" + "\n".join(notes)


def table_csv(rows: Sequence[Aggregate]) -> str:
    """The table as CSV: numbers unrounded and unmarked, the marks as their own columns."""
    columns = [col for col, _, _ in ratio_columns(rows)]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        [
            "input_len",
            "rate",
            "setup",
            "status",
            "runs",
            "ok_runs",
            "completed",
            "requests",
            "partial",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "tpot_coalesced",
            "request_throughput",
            "one_burst",
            "late_tokens",
            "tt2t_p50_ms",
            "decode_step_ms",
            "ttft_mean_ms",
            "servers_ttft_ms",
            "first_token_from_prefill",
            "queued_ms",
            "scheduled_to_first_token_ms",
            *(col.replace("/", "_vs_").lower() for col in columns),
            *(col.replace("/", "_vs_").lower() + "_shaky" for col in columns),
        ]
    )

    def number(value: float | None) -> str:
        return "" if value is None else f"{value:.6g}"

    for line in lines(rows):
        r = line.row
        ratios = [line.ratios[col] for col in columns]
        writer.writerow(
            [
                r.input_len,
                f"{r.rate:g}",
                r.setup,
                r.status,
                r.runs,
                r.ok,
                r.completed,
                r.requests,
                int(r.partial),
                *(number(v) for v in (r.ttft_p50, r.ttft_p99, r.tpot_p50, r.tpot_p99)),
                int(coalesced(r.tpot_p50)),
                number(r.throughput),
                number(r.one_burst),
                number(r.late_tokens),
                number(r.tt2t_p50),
                number(r.decode_step_ms),
                number(r.ttft_mean),
                number(r.servers_ttft_ms),
                number(r.first_from_prefill),
                number(r.queued_ms),
                number(r.to_first_token_ms),
                *(number(x.value) for x in ratios),
                *(int(x.shaky) for x in ratios),
            ]
        )
    return out.getvalue()


# -- the figure -----------------------------------------------------------------------------

STATUS_BAND = 0.22  # share of a log panel's height kept free at the top for status marks
EDGE_BAND = 0.08  # and at the bottom for coalesced points


def draw(rows: Sequence[Aggregate], path: Path, title: str = "") -> Path:
    """Write `figure` to `path` (a PNG); returns `path`."""
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def figure(rows: Sequence[Aggregate], title: str = "") -> Any:
    """TTFT (top) and TPOT (bottom) vs rate, one column per input length, the legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    input_lens = sorted({r.input_len for r in rows})
    setups = sorted({r.setup for r in rows})
    colours: dict[str, Any] = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(setups)}
    if SINGLE in colours:
        colours[SINGLE] = "black"
    fig, axes = plt.subplots(
        2, len(input_lens), figsize=(5.5 * len(input_lens), 8.8), squeeze=False
    )
    drawn: set[str] = set()
    for col, input_len in enumerate(input_lens):
        for row_index, metric in enumerate(("ttft", "tpot")):
            ax = axes[row_index][col]
            panel = [r for r in rows if r.input_len == input_len]
            for setup in setups:
                mine = sorted((r for r in panel if r.setup == setup), key=lambda r: r.rate)
                if _draw_setup(ax, setup, mine, metric, colours[setup]):
                    drawn.add(setup)
            _finish_panel(ax, panel, metric, input_len, colours)
    handles, labels = _legend(rows, setups, drawn, colours)
    # As many columns as fit the figure's width (one panel column is narrow).
    ncol = min(len(handles), 4)
    while True:
        legend = fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
        if ncol == 1 or legend.get_window_extent().width <= fig.bbox.width:
            break
        legend.remove()
        ncol -= 1
    legend_rows = -(-len(handles) // ncol)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.025 * legend_rows + 0.01, 1, 1))
    return fig


def _draw_setup(ax: Any, setup: str, mine: Sequence[Aggregate], metric: str, colour: Any) -> bool:
    """One setup's p50 line (labelled with the setup; filled markers where every run was
    ok, hollow elsewhere), its p99 dashed, and its coalesced points on the bottom edge;
    True if anything was drawn."""
    p50 = [(r, getattr(r, f"{metric}_p50")) for r in mine]
    measured = [(r, v) for r, v in p50 if v is not None and not coalesced(v)]
    ax.plot(
        [r.rate for r, _ in measured],
        [v for _, v in measured],
        line_style(setup),
        color=colour,
        label=setup,
    )
    for ok, face in ((True, colour), (False, "white")):
        points = [(r.rate, v) for r, v in measured if (r.status == "ok") == ok]
        ax.plot(
            [x for x, _ in points],
            [y for _, y in points],
            "o",
            color=colour,
            markerfacecolor=face,
            markeredgewidth=1.5,
        )
    p99 = [(r.rate, getattr(r, f"{metric}_p99")) for r in mine]
    p99 = [(x, y) for x, y in p99 if y is not None and not coalesced(y)]
    ax.plot([x for x, _ in p99], [y for _, y in p99], "--", color=colour, alpha=0.5)
    flat = [r.rate for r, v in p50 if coalesced(v)]
    ax.plot(
        flat,
        [EDGE_BAND / 3] * len(flat),
        "v",
        color=colour,
        markersize=9,
        transform=ax.get_xaxis_transform(),
    )
    return bool(measured or flat)


def _finish_panel(
    ax: Any, panel: Sequence[Aggregate], metric: str, input_len: int, colours: dict[str, Any]
) -> None:
    """Axes, scale and bands, and the status of every point that was not ok, inside."""
    from matplotlib.ticker import NullLocator

    label = metric.upper()
    rates = sorted({r.rate for r in panel})
    ax.set_title(f"{label} vs request rate, {input_len}-token prompts", fontsize=10)
    # Rates are usually doubled from point to point: a log axis spaces them evenly.
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"{label} (ms; p50 solid, p99 dashed)")
    ax.set_xticks(rates, [f"{x:g}" for x in rates])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.margins(x=0.1)
    values = [getattr(r, f"{metric}_{q}") for r in panel for q in ("p50", "p99")]
    if any(v is not None and not coalesced(v) for v in values):
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        span = high / low
        # Bands outside the data: crosses and labels at the top, triangles at the bottom.
        ax.set_ylim(low / span**EDGE_BAND, high * span**STATUS_BAND)
    ax.grid(True, which="both", alpha=0.3)
    not_ok = [r for r in panel if r.status != "ok"]
    to_axes = ax.get_xaxis_transform() + ax.transAxes.inverted()
    stacked: dict[float, int] = {}
    for r in sorted(not_ok, key=lambda r: r.setup):
        ax.plot(
            [r.rate],
            [0.95],
            "x",
            color="red",
            markersize=11,
            mew=3,
            transform=ax.get_xaxis_transform(),
        )
        where = to_axes.transform((r.rate, 0))[0]  # 0 at the left edge, 1 at the right
        ha = "left" if where < 0.2 else "right" if where > 0.8 else "center"
        ran = f" {r.ok}/{r.runs} ok" if r.runs > 1 else ""
        row = stacked.get(r.rate, 0)
        stacked[r.rate] = row + 1
        ax.annotate(
            f"{r.setup}: {r.status}{ran}",
            (r.rate, 0.95),
            xycoords=("data", "axes fraction"),
            xytext=(0, -11 - 9 * row),
            textcoords="offset points",
            color=colours[r.setup],
            fontsize=7,
            ha=ha,
            va="top",
            annotation_clip=False,
        )


def _legend(
    rows: Sequence[Aggregate], setups: Sequence[str], drawn: set[str], colours: dict[str, Any]
) -> tuple[list[Any], list[str]]:
    """A line per setup, or a cross and why it has none; then what the marks mean."""
    from matplotlib.lines import Line2D

    handles: list[Any] = []
    labels = []
    for setup in setups:
        if setup in drawn:
            line = Line2D([], [], linestyle=line_style(setup), marker="o", color=colours[setup])
            handles.append(line)
            labels.append(setup)
            continue
        statuses = sorted({r.status for r in rows if r.setup == setup})
        handles.append(Line2D([], [], linestyle="", marker="x", mew=2, color=colours[setup]))
        labels.append(f"{setup}: no numbers ({', '.join(statuses)} at every point)")
    grey = "0.4"
    handles += [
        Line2D([], [], linestyle="", marker="o", color=grey, markerfacecolor="white"),
        Line2D([], [], linestyle="", marker="x", color="red", mew=2),
    ]
    labels += [
        "hollow: not ok in every run (numbers of what finished)",
        "where not every run was ok, and why",
    ]
    if any(coalesced(r.tpot_p50) for r in rows):
        handles.append(Line2D([], [], linestyle="", marker="v", color=grey))
        labels.append("TPOT p50 ~0: tokens arrived together (coalesced)")
    return handles, labels
