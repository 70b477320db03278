"""`kvpush bench plot DIR`: TTFT and TPOT versus request rate, and the ratio table.

One panel per input length, one line per setup, for TTFT and for TPOT (p50 as lines, p99
dashed), medians over iterations. A point where a setup did not finish cleanly (stalled,
failed, not started) is drawn as a red cross at the top of its panel with the status, so a
stall is visible, not just missing. The table gives each setup's TTFT and TPOT as a ratio to
the best of vLLM's connectors at that point (below 1: better than vLLM's best); when
the sweep has `*-nospin` setups, a second ratio compares with the best of those.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvpush.bench.results import Aggregate
from kvpush.plan.cli import format_table

SHIPPED = ("vllm-pull", "vllm-push")


def is_vllm(setup: str) -> bool:
    return setup.startswith("vllm-")


def best(rows: Sequence[Aggregate], metric: str, nospin: bool) -> tuple[float | None, bool]:
    """The lowest `metric` among vLLM's setups (shipped, or nospin ones): (value, partial).

    Setups whose runs were ok come first; only when none was are the partial numbers of
    stalled runs used (then the reference is biased low, i.e. in vLLM's favour).
    """
    candidates = [
        r
        for r in rows
        if is_vllm(r.setup)
        and r.setup.endswith("-nospin") == nospin
        and getattr(r, metric) is not None
    ]
    ok = [getattr(r, metric) for r in candidates if r.status == "ok"]
    if ok:
        return min(ok), False
    partial = [getattr(r, metric) for r in candidates]
    return (min(partial), True) if partial else (None, False)


# Below this a p50 (ms) is no measurement of the setup but of the client: the stream's
# chunks reached it together (a starved proxy or client coalesces them), and a ratio
# against it would be meaningless.
MIN_REFERENCE_MS = 0.1


def ratio(value: float | None, reference: tuple[float | None, bool]) -> str:
    ref, partial = reference
    if value is None or ref is None or ref < MIN_REFERENCE_MS:
        return "-"
    return f"{value / ref:.2f}x" + ("*" if partial else "")


def _ms(value: float | None, partial: bool = False) -> str:
    return "-" if value is None else f"{value:.1f}" + ("*" if partial else "")


def table(rows: Sequence[Aggregate]) -> str:
    """The per-point table with ratios to the best vLLM connector."""
    with_nospin = any(r.setup.endswith("-nospin") for r in rows)
    header = ["in", "qps", "setup", "result", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    header += ["req/s", "TTFT/vLLM", "TPOT/vLLM"]
    if with_nospin:
        header += ["TTFT/nospin", "TPOT/nospin"]
    lines = []
    points = sorted({(r.input_len, r.rate) for r in rows})
    for input_len, rate in points:
        here = [r for r in rows if (r.input_len, r.rate) == (input_len, rate)]
        refs = {
            (metric, nospin): best(here, metric, nospin)
            for metric in ("ttft_p50", "tpot_p50")
            for nospin in (False, True)
        }
        for r in sorted(here, key=lambda r: r.setup):
            result = "ok" if r.status == "ok" else r.status
            if r.runs > 1:
                result += f" {r.ok}/{r.runs}"
            if r.status != "ok":
                result += f" ({r.completed}/{r.requests} done)"
            cells = [
                str(input_len),
                f"{rate:g}",
                r.setup,
                result,
                _ms(r.ttft_p50, r.partial),
                _ms(r.ttft_p99, r.partial),
                _ms(r.tpot_p50, r.partial),
                _ms(r.tpot_p99, r.partial),
                "-" if r.throughput is None else f"{r.throughput:.2f}",
                ratio(r.ttft_p50, refs["ttft_p50", False]),
                ratio(r.tpot_p50, refs["tpot_p50", False]),
            ]
            if with_nospin:
                cells += [
                    ratio(r.ttft_p50, refs["ttft_p50", True]),
                    ratio(r.tpot_p50, refs["tpot_p50", True]),
                ]
            lines.append(cells)
    text = format_table(header, lines)
    notes = [
        "latencies in ms: medians over iterations of each run's p50 / p99; "
        "X/vLLM: this setup's p50 divided by the best ok vLLM connector as shipped "
        f"({', '.join(SHIPPED)}) at that point; below 1.00x is better"
    ]
    if with_nospin:
        notes.append("X/nospin: the same against the best vllm-*-nospin setup")
    if any(r.tpot_p50 is not None and r.tpot_p50 < MIN_REFERENCE_MS for r in rows):
        notes.append(
            f"a TPOT p50 under {MIN_REFERENCE_MS} ms means the tokens reached the client "
            "together (chunks coalesced on a busy machine): no ratio is taken against it"
        )
    if any(r.partial for r in rows):
        notes.append(
            "*: no run was ok there; the numbers are of the requests that finished before "
            "the others timed out, so they understate that setup's latency"
        )
    failures = [r for r in rows if r.status != "ok"]
    for r in failures:
        reason = r.reasons[0] if r.reasons else "no reason recorded"
        notes.append(f"{r.setup} at {r.rate:g} qps, {r.input_len} in: {r.status} ({reason})")
    return text + "\n" + "\n".join(notes)


def draw(rows: Sequence[Aggregate], path: Path, title: str = "") -> Path:
    """TTFT (top) and TPOT (bottom) vs rate, one column per input length; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    input_lens = sorted({r.input_len for r in rows})
    setups = sorted({r.setup for r in rows})
    fig, axes = plt.subplots(2, len(input_lens), figsize=(5.5 * len(input_lens), 8), squeeze=False)
    colours = plt.get_cmap("tab10")
    for col, input_len in enumerate(input_lens):
        for row_index, (metric, label) in enumerate((("ttft", "TTFT"), ("tpot", "TPOT"))):
            ax = axes[row_index][col]
            for s_index, setup in enumerate(setups):
                mine = sorted(
                    (r for r in rows if r.setup == setup and r.input_len == input_len),
                    key=lambda r: r.rate,
                )
                colour = colours(s_index % 10)
                style = ":" if setup.endswith("-nospin") else "-"
                good = [
                    r
                    for r in mine
                    if (r.status == "ok" or r.partial)
                    and (getattr(r, f"{metric}_p50") or 0) >= MIN_REFERENCE_MS
                ]
                ax.plot(
                    [r.rate for r in good],
                    [getattr(r, f"{metric}_p50") for r in good],
                    style,
                    marker="o",
                    color=colour,
                    label=setup,
                )
                ax.plot(
                    [r.rate for r in good],
                    [getattr(r, f"{metric}_p99") for r in good],
                    "--",
                    marker="_",
                    markersize=10,
                    color=colour,
                    alpha=0.5,
                )
                for r in mine:
                    if r.status != "ok":
                        ax.plot(
                            [r.rate],
                            [1.0],
                            "x",
                            color="red",
                            markersize=12,
                            mew=3,
                            transform=ax.get_xaxis_transform(),
                            clip_on=False,
                        )
                        ax.annotate(
                            f"{setup}: {r.status}",
                            (r.rate, 0.97 - 0.05 * s_index),
                            xycoords=("data", "axes fraction"),
                            color=colour,
                            fontsize=7,
                            ha="center",
                        )
            ax.set_title(f"{label} vs request rate, {input_len}-token prompts", fontsize=10)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"{label} (ms; p50 solid, p99 dashed)")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if row_index == 0 and col == 0:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
