"""`kvpush bench`: measure connectors the way operators compare them.

`kvpush bench hooks` answers "how much of the engine loop does the KV connector take?"
(the articles' 14.7 ms per request). Each setup runs 1P1D under the same streaming load as
`kvpush demo`, with its connector class wrapped by `kvpush.bench.timed`, which times every
hook vLLM calls on its scheduler and worker main threads - the same wrapper for vLLM's
connectors and ours. Per request is the total divided by the requests sent (the load plus
one warm-up); per step divides the worker's total by its engine steps (calls of
start_load_kv).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvpush.plan.cli import format_table
from kvpush.testbed import demo


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: connector hook cost on the engine loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    hooks = tools.add_parser(
        "hooks",
        help="main-thread time of each connector's hooks, per request and per step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(hooks)
    hooks.set_defaults(func=run_hooks)


def hook_totals(ledger: dict[str, Any], role: str) -> tuple[float, int]:
    """(seconds, calls) summed over every hook of one role ("scheduler" or "worker")."""
    part = ledger.get(role, {})
    return sum(part.get("seconds", {}).values()), sum(part.get("calls", {}).values())


def hook_rows(reports: list[demo.SetupReport], requests: int) -> list[list[str]]:
    rows = []
    for report in reports:
        if not report.hooks:
            rows.append([report.setup, report.status, "-", "-", "-", "-", "-", "-"])
            continue
        cells = [report.setup, report.status]
        for server in ("decode-0", "prefill-0"):
            ledger = report.hooks.get(server, {})
            worker_s, _ = hook_totals(ledger, "worker")
            sched_s, _ = hook_totals(ledger, "scheduler")
            steps = ledger.get("worker", {}).get("calls", {}).get("start_load_kv", 0)
            cells.append(f"{1e3 * (worker_s + sched_s) / requests:.3f}")
            cells.append(f"{1e6 * worker_s / steps:.1f}" if steps else "-")
        summary = demo.summarise(report.results)
        cells.append(demo.format_ms(summary.ttft_p50_s))
        cells.append(demo.format_ms(summary.tpot_p50_s))
        rows.append(cells)
    return rows


def run_hooks(args: argparse.Namespace) -> int:
    measured = demo.run_all(args, timed_hooks=True, label="bench-hooks")
    if isinstance(measured, int):
        return measured
    reports, load = measured
    requests = load.requests + 1
    header = [
        "setup",
        "result",
        "decode ms/req",
        "decode us/step",
        "prefill ms/req",
        "prefill us/step",
        "TTFT p50",
        "TPOT p50",
    ]
    print(
        f"connector hooks on vLLM's main threads (scheduler + worker), {requests} requests "
        f"of ~{load.input_len} prompt tokens, {load.output_len} output tokens, "
        f"concurrency {load.concurrency}"
    )
    print(format_table(header, hook_rows(reports, requests)))
    print(
        "(ms/req: all hooks' time / requests; us/step: worker hooks' time / engine steps; "
        "TTFT/TPOT in ms at the client)"
    )
    return 0 if any(r.hooks for r in reports) else 1
