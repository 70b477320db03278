"""`kvpush plan measure` and `kvpush plan check`: the simulator against this machine.

`measure` writes a machine profile (`kvpush/plan/measure.py`); `check` predicts every point
of `kvpush bench sweep` result files from it and prints predicted against measured p50 TTFT
and TPOT with the relative error; `plan simulate --profile P --setup S` simulates any grid
with one setup's measured parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.args import UsageError, port_number
from kvpush.core.protocol import Mode
from kvpush.plan.machine import (
    METRICS,
    CheckRow,
    Derived,
    MachineProfile,
    check,
    derive,
    load_profile,
    sim_params,
)
from kvpush.plan.model import PlannerError
from kvpush.plan.simulate import SimParams
from kvpush.report import format_table, pyplot, save_figure

MEASURE_EPILOG = """\
examples:
  kvpush plan measure --model .kvpush/models/tiny --out profile.json
  kvpush plan measure --model .kvpush/models/tiny --setups kvpush-push,vllm-pull \\
      --input-lens 256,1024 --port 19100 --proxy-port 19250 --kv-port 16700 --out p.json

Each setup's 1P1D servers are started as `kvpush bench sweep` starts them and probed
without a handoff: prefill time and front-end time of prompts sent one at a time, decode
step time at batch 1 and --max-num-seqs as a streaming client sees it (local requests),
and the decode worker's main-thread time in the hooks that take a step's loads per
handed-off request (hook time only; never a TTFT or TPOT of a handed-off request).
Medians throughout. Ports: prefill PORT+100, decode PORT+200, the probe's proxy
--proxy-port (default PORT), NIXL side channels from --kv-port. About 2-3 minutes per
setup on 2 cores."""

CHECK_EPILOG = """\
examples:
  kvpush plan check results/sweep --profile profile.json
  kvpush plan check tests/data/plan/sweep-reference \\
      --profile tests/data/plan/profile-reference.json --plot c.png

error = (predicted - measured) / measured, of the p50 (for the measurement: the median
over iterations of each ok run's p50; for the prediction: the median over --seeds arrival
sequences of the simulated p50, same prompt count, output length and --max-num-seqs)."""


def register(nested: Any) -> None:
    m = nested.add_parser(
        "measure",
        help="measure this machine's simulator parameters on real servers (no handoff)",
        description="Measure the simulator's parameters for each connector setup on this "
        "machine and write them as a profile for `plan simulate --profile` and `plan check`.",
        epilog=MEASURE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument("--model", type=Path, required=True, help="model folder, e.g. models/tiny")
    m.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    m.add_argument(
        "--setups",
        default="kvpush-push,kvpush-pull,vllm-pull,vllm-pull-nospin",
        help="connector setups (default: kvpush-push,kvpush-pull,vllm-pull,vllm-pull-nospin)",
    )
    m.add_argument("--input-lens", default="256,1024", help="prompt tokens (default: 256,1024)")
    m.add_argument("--max-num-seqs", type=int, default=8, help="per server (default: 8)")
    m.add_argument(
        "--output-lens",
        default="16,80",
        help="two output lengths for the decode step probe; the client's TPOT is taken at the "
        "longer, the engine's step from the difference (default: 16,80)",
    )
    m.add_argument("--prefill-requests", type=int, default=16, help="per length (default: 16)")
    m.add_argument(
        "--decode-rounds", type=int, default=5, help="batches per step probe (default: 5)"
    )
    m.add_argument("--hook-requests", type=int, default=6, help="per length (default: 6)")
    m.add_argument("--port", type=port_number(), default=8000, help="base port (default: 8000)")
    m.add_argument("--proxy-port", type=port_number(), help="the probe's proxy (default: --port)")
    m.add_argument(
        "--kv-port", type=port_number(), default=5600, help="first NIXL side-channel port"
    )
    m.add_argument("--kv-cache-gib", type=float, default=1.0, help="per server (default: 1)")
    m.add_argument("--workdir", type=Path, default=Path(".kvpush"), help="logs and caches")
    m.add_argument("--startup-timeout", type=float, default=300.0)
    m.add_argument("--redo", action="store_true", help="measure setups already in --out again")
    from kvpush.testbed.pinning import NO_PIN_HELP

    m.add_argument("--no-pin", dest="pin", action="store_false", help=NO_PIN_HELP)
    from kvpush.plan.measure import MEMCPY_GBPS, NIXL_DRAM_GBPS, PROXY_ADDED_MS

    default_added = ",".join(f"{mode}={ms}" for mode, ms in PROXY_ADDED_MS.items())
    m.add_argument(
        "--proxy-added-ms",
        default=default_added,
        help=f"the proxy's added p50 latency per mode from `kvpush proxy bench --streams 1` "
        f"(default: {default_added}, measured here)",
    )
    m.add_argument(
        "--link-gbps",
        type=float,
        default=NIXL_DRAM_GBPS,
        help=f"NIXL transfer GB/s (default: {NIXL_DRAM_GBPS}, a DRAM-to-DRAM WRITE between two "
        "processes as measured on a 2-core x86 VM)",
    )
    m.add_argument(
        "--memory-gbps",
        type=float,
        default=MEMCPY_GBPS,
        help=f"memory GB/s for decode's KV reads (default: {MEMCPY_GBPS}, memcpy)",
    )
    m.set_defaults(func=run_measure)

    c = nested.add_parser(
        "check",
        help="predict `kvpush bench sweep` results from a measured profile; show the error",
        description="Predict every point of sweep result files with the simulator and a "
        "machine profile, and print predicted vs measured p50 TTFT and TPOT.",
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("results", type=Path, nargs="+", help="`kvpush bench sweep --out` folders")
    c.add_argument("--profile", required=True, help="machine profile from `plan measure`")
    c.add_argument("--setups", help="only these setups (comma-separated)")
    c.add_argument("--seeds", type=int, default=10, help="arrival sequences (default: 10)")
    c.add_argument("--plot", metavar="FILE.png", help="draw predicted vs measured")
    c.add_argument("--json", action="store_true", help="print JSON, not tables")
    c.set_defaults(func=run_check)


def _fail(exc: UsageError) -> int:
    print(f"kvpush plan: error: {exc}", file=sys.stderr)
    return 2


def _pairs(flag: str, text: str) -> dict[str, float]:
    pairs = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, _, value = item.partition("=")
        try:
            pairs[key.strip()] = float(value)
        except ValueError:
            raise PlannerError(f"{flag} takes MODE=MS pairs, e.g. pull=3.0,push=3.8") from None
    if set(pairs) != {"pull", "push"}:
        raise PlannerError(f"{flag} needs both pull= and push= (got {text!r})")
    return pairs


def profile_params(args: argparse.Namespace) -> tuple[SimParams, tuple[Mode, ...]]:
    """`plan simulate --profile P --setup S`: that setup's measured parameters."""
    profile = load_profile(args.profile)
    if args.setup is None:
        raise PlannerError(f"--profile needs --setup, one of: {', '.join(sorted(profile.setups))}")
    params = sim_params(
        profile,
        args.setup,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        first_token=args.first_token,
    )
    return params, (profile.setup(args.setup).mode,)


def run_measure(args: argparse.Namespace) -> int:
    from kvpush.plan.measure import MeasureSpec, measure
    from kvpush.testbed.topology import PairSettings

    try:
        lens = [int(n) for n in args.input_lens.split(",") if n.strip()]
        outs = [int(n) for n in args.output_lens.split(",") if n.strip()]
        if len(outs) != 2:
            raise PlannerError("--output-lens takes exactly two lengths, e.g. 16,80")
        spec = MeasureSpec(
            pair=PairSettings(
                model=args.model,
                workdir=args.workdir,
                port=args.port,
                kv_port=args.kv_port,
                max_num_seqs=args.max_num_seqs,
                kv_cache_gib=args.kv_cache_gib,
                startup_timeout=args.startup_timeout,
                pin=args.pin,
            ),
            setups=[s.strip() for s in args.setups.split(",") if s.strip()],
            input_lens=lens,
            out=args.out,
            output_lens=(outs[0], outs[1]),
            prefill_requests=args.prefill_requests,
            decode_rounds=args.decode_rounds,
            hook_requests=args.hook_requests,
            proxy_port=args.proxy_port,
        )
        profile = measure(
            spec,
            _pairs("--proxy-added-ms", args.proxy_added_ms),
            args.link_gbps,
            args.memory_gbps,
            ["kvpush", *sys.argv[1:]],
            redo=args.redo,
        )
    except ValueError as exc:
        return _fail(exc if isinstance(exc, UsageError) else UsageError(str(exc)))
    print(f"\nprofile written to {args.out}")
    print(render_derived(profile))
    return 0


def _pct(error: float | None) -> str:
    return "-" if error is None else f"{error * 100:+.0f}%"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_derived(profile: MachineProfile) -> str:
    headers = [
        "setup", "mode", "prefill ms", "+us/tok", "front end ms", "+us/tok",
        "step ms", "+ms/seq", "+us/ctx tok", "submit us/tok", "xfer setup ms", "hop ms",
    ]  # fmt: skip
    rows = []
    for name in sorted(profile.setups):
        d: Derived = derive(profile, name)
        rows.append(
            [
                name,
                profile.setups[name].mode,
                f"{d.prefill.intercept:.2f}",
                f"{d.prefill.slope * 1e3:.2f}",
                f"{d.front_end.intercept:.2f}",
                f"{d.front_end.slope * 1e3:.2f}",
                f"{d.step.base_ms:.2f}",
                f"{d.step.per_seq_ms:.3f}",
                f"{d.step.per_context_token_us:.4f}",
                f"{d.submit_us_per_token:.2f}",
                f"{d.transfer_setup_ms:.3f}",
                f"{d.hop_ms:.2f}",
            ]
        )
    return "simulator parameters per setup (fits over the profile's measurements)\n" + format_table(
        headers, rows
    )


def render_check(rows: Sequence[CheckRow], limit: float = 0.25) -> str:
    headers = ["in", "qps", "setup", "result"]
    for name in ("TTFT", "TPOT", "E2E"):
        headers += [f"{name} p50", "predicted", "error"]
    headers += ["1 burst", "late"]
    cells = []
    for row in sorted(
        rows, key=lambda r: (r.measured.input_len, r.measured.rate, r.measured.setup)
    ):
        m = row.measured
        line = [
            str(m.input_len),
            f"{m.rate:g}",
            m.setup,
            m.status if m.runs == 1 else f"{m.status} x{m.runs}",
        ]
        for metric in METRICS:
            digits = 2 if metric == "tpot" else 1
            line += [
                _ms(getattr(m, f"{metric}_p50"), digits),
                _ms(getattr(row, f"{metric}_p50"), digits),
                _pct(row.error(metric)),
            ]
        line += [_share(m.one_burst), _share(m.late_tokens)]
        cells.append(line)
    lines = [
        format_table(headers, cells),
        "(ms; error = (predicted - measured) / measured; E2E = arrival to last token; "
        "1 burst = share of answers whose tokens all reached the client at once, which "
        "puts their decode into TTFT and none into TPOT; late = share of output tokens that "
        "reached the client more than 2 decode steps after they were produced)",
    ]
    from_prefill = sorted({r.measured.setup for r in rows if r.measured.first_token == "prefill"})
    if from_prefill:
        lines.append(
            f"first token from prefill (as the sweep's proxy sent it): {', '.join(from_prefill)}"
        )
    for setup in sorted({r.measured.setup for r in rows}):
        mine = [r for r in rows if r.measured.setup == setup]
        parts = []
        for metric in METRICS:
            errors = [e for r in mine if (e := r.error(metric)) is not None]
            if not errors:
                parts.append(f"{metric.upper()} not measured")
                continue
            within = sum(abs(e) <= limit for e in errors)
            worst = max(errors, key=abs)
            parts.append(
                f"{metric.upper()} within {limit:.0%} at {within}/{len(errors)} points "
                f"(worst {_pct(worst)})"
            )
        lines.append(f"{setup}: " + ", ".join(parts))
    return "\n".join(lines)


def check_json(rows: Sequence[CheckRow]) -> list[dict[str, Any]]:
    return [
        {
            "setup": r.measured.setup,
            "input_len": r.measured.input_len,
            "rate": r.measured.rate,
            "status": r.measured.status,
            "measured": {f"{m}_p50": getattr(r.measured, f"{m}_p50") for m in METRICS},
            "predicted": {f"{m}_p50": getattr(r, f"{m}_p50") for m in METRICS},
            "error": {f"{m}_p50": r.error(m) for m in METRICS},
            "one_burst": r.measured.one_burst,
            "late_tokens": r.measured.late_tokens,
        }
        for r in rows
    ]


def plot_check(rows: Sequence[CheckRow], path: str) -> None:
    """Measured (solid) and predicted (dashed) p50 vs rate; a column per input length."""
    plt = pyplot()
    lens = sorted({r.measured.input_len for r in rows})
    setups = sorted({r.measured.setup for r in rows})
    fig, axes = plt.subplots(2, len(lens), figsize=(5.5 * len(lens), 8), squeeze=False)
    colours = plt.get_cmap("tab10")
    for col, input_len in enumerate(lens):
        for row_index, metric in enumerate(("ttft", "tpot")):
            ax = axes[row_index][col]
            for index, setup in enumerate(setups):
                mine = sorted(
                    (
                        r
                        for r in rows
                        if (r.measured.setup, r.measured.input_len) == (setup, input_len)
                    ),
                    key=lambda r: r.measured.rate,
                )
                colour = colours(index % 10)
                seen = [r for r in mine if getattr(r.measured, f"{metric}_p50") is not None]
                ax.plot(
                    [r.measured.rate for r in seen],
                    [getattr(r.measured, f"{metric}_p50") for r in seen],
                    "-o",
                    color=colour,
                    label=f"{setup} measured",
                )
                ax.plot(
                    [r.measured.rate for r in mine],
                    [getattr(r, f"{metric}_p50") for r in mine],
                    "--x",
                    color=colour,
                    alpha=0.7,
                    label=f"{setup} predicted",
                )
            ax.set_yscale("log")
            ax.set_title(f"input {input_len:,} tokens")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"p50 {metric.upper()} (ms)")
            ax.grid(True, alpha=0.3, which="both")
            ax.legend(fontsize=7)
    save_figure(plt, fig, path)


def run_check(args: argparse.Namespace) -> int:
    from kvpush.bench.results import ResultError, load_results

    try:
        profile = load_profile(args.profile)
        results: list[dict[str, Any]] = []
        for directory in args.results:
            try:
                results += load_results(directory)
            except FileNotFoundError as exc:
                raise PlannerError(f"{exc}; pass a `kvpush bench sweep --out` folder") from None
            except ResultError as exc:
                raise PlannerError(str(exc)) from None
        if args.setups:
            wanted = {s.strip() for s in args.setups.split(",")}
            results = [r for r in results if r["setup"] in wanted]
        if args.seeds < 1:
            raise PlannerError("--seeds must be at least 1")

        def progress(index: int, total: int, what: str) -> None:
            print(f"[{index}/{total}] {what}", file=sys.stderr, flush=True)

        rows = check(profile, results, args.seeds, progress)
        if args.plot:
            plot_check(rows, args.plot)
    except UsageError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps({"profile": profile.to_json(), "rows": check_json(rows)}, indent=1))
        return 0
    print(render_derived(profile))
    print()
    print(render_check(rows))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
