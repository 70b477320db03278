"""`kvpush bench`: measure connectors the way operators compare them.

`kvpush bench sweep` runs `vllm bench serve` against every setup over a grid of request
rates and input lengths (the articles' method) and `kvpush bench plot DIR` draws and
tabulates the results.

`kvpush bench hooks` answers "how much of the engine loop does the KV connector take?"
(the articles' 14.7 ms per request). Each setup runs 1P1D under the same streaming load as
`kvpush bench compare`, with its connector class wrapped by `kvpush.bench.timed`, which times every
hook vLLM calls on its scheduler and worker main threads - the same wrapper for vLLM's
connectors and ours. The warm-up request (first contact between the servers: handshakes,
first registrations) is reported on its own; per request is the load's total divided by
its requests, per step the worker's total over the load divided by its engine steps (calls
of start_load_kv), and p50 the median step's total: a few steps where the worker lost its
core weigh on the mean, not on the median. The `null` setup (kvpush.bench.null, on by
default) is the floor: a connector whose hooks all return at once, timed the same way, so
what vLLM's loop pays for calling any connector on this machine; each other setup is also
given as its excess over it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvpush.args import (
    at_least,
    cannot_write,
    port_number,
    positive,
    positive_list,
    positive_numbers,
)
from kvpush.bench import compare, plot, results, soak, sweep, timed, turns
from kvpush.proxy.first_token import SOURCES as FIRST_TOKEN_SOURCES
from kvpush.report import format_table
from kvpush.testbed import source
from kvpush.testbed.model import TinyModelSpec, ensure_tiny_model
from kvpush.testbed.pinning import NO_PIN_HELP
from kvpush.testbed.topology import (
    BENCH_SETUPS,
    MAIN_SETUPS,
    NULL,
    SETUPS,
    SWEEP_SETUPS,
    PairSettings,
    worker_alone_cores,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: latency sweeps against vLLM's connectors, hook cost, plots",
        description=__doc__,
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    hooks = tools.add_parser(
        "hooks",
        help="main-thread time of each connector's hooks, per request and per step",
        description=__doc__,
        epilog=HOOKS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # single has no hooks to time; null is the floor the others are read against
    compare.add_arguments(hooks, (NULL, *MAIN_SETUPS), tuple(SETUPS))
    hooks.add_argument(
        "--worker-alone",
        choices=("prefill", "decode"),
        default="",
        help="give that server's model worker a core to itself and move its API server, "
        "engine core and every connector thread to the other cores (with the other server "
        "and the client), as vLLM's CPU backend reserves cores for them next to the "
        "worker's; the same for every setup. Measures that server's hooks without vLLM's "
        "engine core polling on the worker's core; the other server's figures are then "
        "not as separate hosts would run. Needs 2 cores or more and pinning",
    )
    hooks.add_argument(
        "--cpu-time",
        action="store_true",
        help="also read each hook's thread CPU time and print, per server, CPU ms per "
        "request next to wall ms: their difference is time the hook waited (for the GIL "
        "or for the core) rather than ran. The CPU clock is read outside the wall clock "
        "(a system call each), so the other figures stay as without it",
    )
    hooks.add_argument(
        "--per-hook",
        action="store_true",
        help="also print, per setup and server, the hooks that took the most time: ms "
        "per request, calls per request and us per call (with --cpu-time, CPU us per call)",
    )
    hooks.set_defaults(func=run_hooks)
    comparer = tools.add_parser(
        "compare",
        help="the same prompts through every setup: TTFT/TPOT and whether the text agrees",
        description=compare.__doc__,
        epilog=COMPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_arguments(comparer, SWEEP_SETUPS)
    comparer.set_defaults(func=compare.run)
    sweeper = tools.add_parser(
        "sweep",
        help="vllm bench serve over rates x input lengths for each setup, interleaved",
        description=sweep.__doc__,
        epilog=SWEEP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_sweep_arguments(sweeper)
    sweeper.set_defaults(func=run_sweep)
    plotter = tools.add_parser(
        "plot",
        help="plot TTFT/TPOT vs rate from a sweep's results and print the ratio table",
        description=plot.__doc__,
        epilog=PLOT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plotter.add_argument("dir", type=Path, help="a sweep's --out directory")
    plotter.add_argument(
        "--png", type=Path, default=None, help="where to write the figure (default DIR/sweep.png)"
    )
    plotter.add_argument(
        "--csv",
        nargs="?",
        const="-",
        metavar="FILE",
        help="also write the table as CSV to FILE; '--csv' alone or '--csv -' writes it to "
        "stdout instead of the table",
    )
    plotter.set_defaults(func=run_plot)
    soak.register(tools)
    turns.register(tools)


BENCH_EPILOG = """examples:
  kvpush bench sweep --setups kvpush-push,vllm-pull --rates 1,2,4 --out results/sweep
  kvpush bench plot results/sweep --csv results/sweep/table.csv
  kvpush bench hooks --setups kvpush-push,vllm-pull --requests 12 --concurrency 3
  kvpush bench compare --setups vllm-pull,kvpush-push --requests 32 --concurrency 8
(each has -h with more)
"""
HOOKS_EPILOG = """example (a few minutes per setup here):
  kvpush bench hooks --setups kvpush-push,vllm-pull --requests 12 --concurrency 3
"""
COMPARE_EPILOG = """example (a few minutes per setup here):
  kvpush bench compare --setups vllm-pull,kvpush-push --requests 32 --concurrency 8
"""
PLOT_EPILOG = """examples:
  kvpush bench plot results/sweep                       # table, and results/sweep/sweep.png
  kvpush bench plot results/sweep --png fig.png --csv table.csv
  kvpush bench plot results/sweep --csv - > table.csv   # the table as CSV on stdout
"""

SWEEP_EPILOG = """example (about 40 minutes here):
  kvpush bench sweep --setups kvpush-push,vllm-push,vllm-pull --rates 2,4,8 \\
      --input-lens 256,1024 --output-len 32 --num-prompts 48 --iterations 3 --out results/sweep
  kvpush bench plot results/sweep

setups: {} ({}: one plain vLLM server on the pair's cores, no connector, the load sent
straight to it: what not disaggregating costs or saves)
Interrupt it at any time: run the same command again and it resumes.
""".format(", ".join(BENCH_SETUPS), SWEEP_SETUPS[-1])


def add_sweep_arguments(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None
) -> None:
    """The sweep's options; `defaults` overrides some (the demo's smaller sweep)."""
    d: dict[str, Any] = {
        "setups": ",".join(SWEEP_SETUPS),
        "rates": "2,4,8",
        "input_lens": "256,1024",
        "output_len": 32,
        "num_prompts": 48,
        "iterations": 1,
        "out": Path("results/sweep"),
        "request_timeout": 30.0,
        **(defaults or {}),
    }
    parser.add_argument(
        "--setups", default=d["setups"], help=f"comma-separated setups (default {d['setups']})"
    )
    parser.add_argument(
        "--rates",
        type=positive_numbers(float, "--rates"),
        default=positive_list(float, "--rates", d["rates"]),
        help=f"request rates in requests/s, Poisson arrivals (default {d['rates']})",
    )
    parser.add_argument(
        "--input-lens",
        type=positive_numbers(int, "--input-lens"),
        default=positive_list(int, "--input-lens", d["input_lens"]),
        help=f"prompt lengths in tokens (default {d['input_lens']})",
    )
    parser.add_argument(
        "--output-len",
        type=at_least(1),
        default=d["output_len"],
        help=f"output tokens per request, EOS ignored (default {d['output_len']})",
    )
    parser.add_argument(
        "--num-prompts",
        type=at_least(1),
        default=d["num_prompts"],
        help=f"requests per run (default {d['num_prompts']})",
    )
    parser.add_argument(
        "--iterations",
        type=at_least(1),
        default=d["iterations"],
        help=f"repetitions of the whole grid, setups interleaved (default {d['iterations']})",
    )
    parser.add_argument(
        "--out", type=Path, default=d["out"], help=f"result directory (default {d['out']})"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (default: the tiny model, built under WORKDIR/models/tiny)",
    )
    parser.add_argument(
        "--max-num-seqs", type=at_least(1), default=8, help="per server (default 8)"
    )
    parser.add_argument(
        "--kv-cache-gib", type=positive(), default=1.0, help="per server (default 1)"
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="every server with --no-enable-prefix-caching (default: on, as vLLM's default); "
        "recorded in each result file",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    parser.add_argument(
        "--request-timeout",
        type=positive(),
        default=d["request_timeout"],
        help="the proxy's deadline per request; a request past it counts as a stall "
        f"(default {d['request_timeout']:g} s)",
    )
    parser.add_argument(
        "--run-timeout",
        type=positive(),
        default=None,
        help="wall-clock deadline of one run (default: prompts/rate + request timeout + 90 s)",
    )
    parser.add_argument("--startup-timeout", type=positive(), default=300.0)
    parser.add_argument(
        "--port", type=port_number(), default=8000, help="proxy port (default 8000)"
    )
    parser.add_argument(
        "--kv-port", type=port_number(), default=5600, help="first NIXL side-channel port"
    )
    parser.add_argument("--workdir", type=Path, default=Path(".kvpush"))
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help=NO_PIN_HELP + "; recorded in each result file",
    )
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="on resume, also redo runs that stalled, failed or did not start",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also write OUT/trace/<run>.json per run: CPU seconds of every process and busy "
        "thread of each server, of the load generator and of the proxy (over the run and "
        "every 0.5 s), how long each process's threads stood runnable waiting for a core, "
        "each server's engine steps per second while requests wait and while "
        "they run (from the hook timer, which --trace turns on), when each streamed chunk "
        "reached the client, and every thread's CPU affinity (docs/benchmarks.md)",
    )
    parser.add_argument(
        "--first-token",
        choices=FIRST_TOKEN_SOURCES,
        default=None,
        help="where the proxy takes a streamed answer's first token from (kvpush proxy "
        "--first-token; default: prefill with kvpush's connector, decode with vLLM's, which "
        "cannot reproduce prefill's token). `decode` runs kvpush in vLLM's order, as the "
        "articles measured; recorded in each result file",
    )
    parser.add_argument(
        "--worker-alone",
        choices=("prefill", "decode"),
        default="",
        help="give that server's model worker a core to itself and move everything else of "
        "it (API server, engine core, connector threads) to the other cores, with the other "
        "server, the proxy and the client. `decode` measures decode's steps (TPOT) as a "
        "host with cores to spare runs them, without vLLM's API server and engine core "
        "taking turns on the worker's core; the other server's figures (TTFT) are then "
        "not as separate hosts would run. Not for `single`. Needs 2 cores or more and "
        "pinning; recorded in each result file",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the plot and table at the end")


def sweep_spec(args: argparse.Namespace) -> sweep.SweepSpec:
    if args.worker_alone:
        if not args.pin:
            raise ValueError("--worker-alone needs pinning: drop --no-pin")
        worker_alone_cores(args.worker_alone)
    model = args.model or args.workdir / "models" / "tiny"
    if args.model is None:
        ensure_tiny_model(model, TinyModelSpec())
    elif not (model / "config.json").exists():
        raise ValueError(f"--model {model} holds no model (no config.json)")
    return sweep.SweepSpec(
        setups=[s.strip() for s in args.setups.split(",") if s.strip()],
        rates=args.rates,
        input_lens=args.input_lens,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        iterations=args.iterations,
        out=args.out,
        pair=PairSettings(
            model=model,
            workdir=args.workdir,
            port=args.port,
            kv_port=args.kv_port,
            max_num_seqs=args.max_num_seqs,
            kv_cache_gib=args.kv_cache_gib,
            prefix_caching=args.prefix_caching,
            startup_timeout=args.startup_timeout,
            pin=args.pin,
            worker_alone=args.worker_alone,
        ),
        seed=args.seed,
        request_timeout=args.request_timeout,
        run_timeout=args.run_timeout,
        retry_failed=args.retry_failed,
        trace=args.trace,
        first_token=args.first_token,
    )


def run_sweep(args: argparse.Namespace) -> int:
    try:
        spec = sweep_spec(args)
        spec.out.mkdir(parents=True, exist_ok=True)
    except ValueError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        why = cannot_write(exc, args.out)
        print(f"{args.prog}: {why}; give --out and --workdir you can write", file=sys.stderr)
        return 2
    try:
        sweep.run_sweep(spec)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted; finished runs are kept in {spec.out}; run the same command to resume",
            file=sys.stderr,
        )
        return 130
    if args.no_plot:
        return 0
    return show(spec.out, spec.out / "sweep.png")


def show(directory: Path, png: Path, csv: str | None = None) -> int:
    """Draw the figure of a result directory and print its table (for csv "-", the table
    as CSV instead; for another csv, also write the CSV there). Exit code: 1 if there is
    nothing, 2 for a directory or file that cannot be read or written."""
    try:
        loaded = results.load_results(directory)
        rows = results.aggregate(loaded)
    except (FileNotFoundError, results.ResultError) as exc:
        print(f"kvpush bench plot: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"kvpush bench plot: no sweep results in {directory}", file=sys.stderr)
        return 1
    csv_on_stdout = csv == "-"
    written = [f"figure: {png}"]
    try:  # the files first, so that a path that cannot be written leaves no half output
        if csv and not csv_on_stdout:
            Path(csv).write_text(plot.table_csv(rows))
            written.append(f"table: {csv}")
        plot.draw(rows, png, title=f"kvpush bench sweep {directory.resolve().name}")
    except OSError as exc:
        print(
            f"kvpush bench plot: {cannot_write(exc, png)}; give --png/--csv a path you can write",
            file=sys.stderr,
        )
        return 2
    for label, mixed, describe, key in (
        ("host", "runs from different hosts", results.describe_host, "host"),
        ("code", "runs of different kvpush code", source.describe_code, "code"),
    ):
        seen = sorted({describe(r.get(key)) for r in loaded})
        if len(seen) > 1:
            written.append(f"WARNING: {mixed}: " + "; ".join(seen))
        elif seen != ["-"]:
            written.append(f"{label}: {seen[0]}")
    sys.stdout.write(plot.table_csv(rows) if csv_on_stdout else plot.table(rows) + "\n")
    # With the CSV on stdout the rest goes to stderr, so that stdout stays CSV.
    print("\n" + "\n".join(written), file=sys.stderr if csv_on_stdout else sys.stdout)
    return 0


def run_plot(args: argparse.Namespace) -> int:
    return show(args.dir, args.png or args.dir / "sweep.png", args.csv)


ROLES = ("scheduler", "worker")
CPU_COLUMNS = ("wall ms/req", "cpu ms/req", "waiting")


def hook_totals(ledger: dict[str, Any], role: str) -> tuple[float, int]:
    """(seconds, calls) summed over every hook of one role ("scheduler" or "worker")."""
    part = ledger.get(role, {})
    return sum(part.get("seconds", {}).values()), sum(part.get("calls", {}).values())


def all_hooks_s(ledger: dict[str, Any], table: str = "seconds") -> float:
    """Seconds of every hook of one server, scheduler and worker: wall time, or with
    table "cpu" the thread CPU time (`--cpu-time`; 0 without it)."""
    return sum(sum(ledger.get(role, {}).get(table, {}).values()) for role in ROLES)


def per_step_us(report: compare.SetupReport, server: str) -> float | None:
    """A server's worker hooks' time over the load per engine step, in us."""
    worker = report.hooks.get(server, {}).get("worker", {})
    steps = worker.get("calls", {}).get("start_load_kv", 0)
    return 1e6 * sum(worker.get("seconds", {}).values()) / steps if steps else None


def above_floor(reports: list[compare.SetupReport], requests: int) -> list[str]:
    """Each setup's hook time less the null connector's, per step and per request."""
    floor = next((r for r in reports if r.setup == NULL and r.hooks), None)
    if floor is None:
        return []
    lines = []
    for report in reports:
        if report is floor or not report.hooks:
            continue
        parts = []
        for server in ("decode-0", "prefill-0"):
            step, base = per_step_us(report, server), per_step_us(floor, server)
            mine, theirs = (all_hooks_s(r.hooks.get(server, {})) for r in (report, floor))
            per_step = (
                f"{step - base:+.1f} us/step" if step is not None and base is not None else "-"
            )
            parts.append(
                f"{server[:-2]} {per_step}, {1e3 * (mine - theirs) / requests:+.3f} ms/req"
            )
        lines.append(f"  {report.setup}: " + "; ".join(parts))
    if lines:
        lines.insert(0, "above the floor (each setup less null's, whose hooks return at once):")
    return lines


def hook_rows(reports: list[compare.SetupReport], requests: int) -> list[list[str]]:
    rows = []
    for report in reports:
        if not report.hooks:
            rows.append([report.setup, report.status] + ["-"] * 9)
            continue
        cells = [report.setup, report.status]
        for server in ("decode-0", "prefill-0"):
            ledger = report.hooks.get(server, {})
            step = per_step_us(report, server)
            cells.append(f"{1e3 * all_hooks_s(ledger) / requests:.3f}")
            cells.append(f"{step:.1f}" if step is not None else "-")
            median = timed.step_quantile(ledger.get("worker", {}).get("steps", {}), 0.5)
            cells.append(f"{1e6 * median:.0f}" if median is not None else "-")
        first = sum(all_hooks_s(ledger) for ledger in report.hooks_warm_up.values())
        cells.append(f"{1e3 * first:.3f}" if report.hooks_warm_up else "-")
        summary = compare.summarise(report.results)
        cells.append(compare.format_ms(summary.ttft_p50_s))
        cells.append(compare.format_ms(summary.tpot_p50_s))
        rows.append(cells)
    return rows


def cpu_rows(reports: list[compare.SetupReport], requests: int) -> list[list[str]]:
    """Per setup and server: wall ms and thread CPU ms of its hooks per request, and the
    share of the wall time the hooks spent waiting rather than running."""
    rows = []
    for report in reports:
        if not report.hooks:
            continue
        cells = [report.setup]
        for server in ("decode-0", "prefill-0"):
            ledger = report.hooks.get(server, {})
            wall = all_hooks_s(ledger)
            cpu = all_hooks_s(ledger, "cpu")
            cells += [
                f"{1e3 * wall / requests:.3f}",
                f"{1e3 * cpu / requests:.3f}",
                # CPU time counts the clocks' own readings: a hook that never waited
                # can show more CPU than wall time, which is no waiting
                f"{100 * max(0.0, wall - cpu) / wall:.0f} %" if wall > 0 else "-",
            ]
        rows.append(cells)
    return rows


PER_HOOK_TOP = 6  # hooks listed per setup and server by --per-hook


def per_hook_rows(
    reports: list[compare.SetupReport], requests: int, top: int = PER_HOOK_TOP
) -> list[list[str]]:
    """The `top` hooks by time of each setup's servers (scheduler and worker side apart):
    ms per request, calls per request, us per call and, where the CPU clock was read, CPU
    us per call."""
    rows = []
    for report in reports:
        for server in ("decode-0", "prefill-0"):
            ledger = report.hooks.get(server, {})
            found = [
                (seconds, role, hook, ledger[role])
                for role in ROLES
                for hook, seconds in ledger.get(role, {}).get("seconds", {}).items()
                if seconds > 0
            ]
            for seconds, role, hook, part in sorted(found, reverse=True)[:top]:
                calls = part.get("calls", {}).get(hook, 0)
                cpu = part.get("cpu", {}).get(hook)
                rows.append(
                    [
                        report.setup,
                        server[:-2],
                        f"{role}.{hook}",
                        f"{1e3 * seconds / requests:.3f}",
                        f"{calls / requests:.1f}",
                        f"{1e6 * seconds / calls:.1f}" if calls else "-",
                        f"{1e6 * cpu / calls:.1f}" if cpu is not None and calls else "-",
                    ]
                )
    return rows


def run_hooks(args: argparse.Namespace) -> int:
    if args.cpu_time:  # the servers inherit it: their hook timers read the CPU clock too
        os.environ[timed.CPU_ENV] = "1"
    measured = compare.run_all(args, timed_hooks=True, label="bench-hooks")
    if isinstance(measured, int):
        return measured
    reports, load = measured
    requests = load.requests
    header = [
        "setup",
        "result",
        "decode ms/req",
        "decode us/step",
        "p50",
        "prefill ms/req",
        "prefill us/step",
        "p50",
        "warm-up ms",
        "TTFT p50",
        "TPOT p50",
    ]
    print(
        f"connector hooks on vLLM's main threads (scheduler + worker), {requests} requests "
        "after one warm-up, "
        f"of ~{load.input_len} prompt tokens, {load.output_len} output tokens, "
        f"concurrency {load.concurrency}"
    )
    print(format_table(header, hook_rows(reports, requests)))
    print(
        "(ms/req: all hooks' time over the load / its requests; us/step: worker hooks' time "
        "over the load / its engine steps, p50: the median step's (bucketed, within 25 %); "
        "warm-up ms: both servers' hooks during the warm-up request; "
        "TTFT/TPOT in ms at the client)"
    )
    for line in above_floor(reports, requests):
        print(line)
    if args.cpu_time:
        cpu_header = ["setup"] + [
            f"{server} {what}" for server in ("decode", "prefill") for what in CPU_COLUMNS
        ]
        print("\nthe same hooks' thread CPU time (ms per request) against their wall time:")
        print(format_table(cpu_header, cpu_rows(reports, requests)))
    if args.per_hook:
        print(f"\nthe {PER_HOOK_TOP} costliest hooks of each server, over the load:")
        header = ["setup", "server", "hook", "ms/req", "calls/req", "us/call", "cpu us/call"]
        print(format_table(header, per_hook_rows(reports, requests)))
    return 0 if any(r.hooks for r in reports) else 1
