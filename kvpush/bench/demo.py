"""`kvpush demo` (what `make demo` runs): a small sweep of every setup, its table and plot.

It builds the tiny model if needed, then runs `kvpush bench sweep` with a grid small enough
for about 10 minutes on a 2-core machine: each connector setup as shipped (vLLM's pull and
push, kvpush's push and pull) plus vLLM's pull with NIXL's progress thread paced
(`vllm-pull-nospin`, to separate the spin from the design) and one plain vLLM server on
the pair's cores (`single`, not disaggregating at all), at 256-token prompts, a light
(0.5 req/s) and a heavy (4 req/s) load, `vllm bench serve` with 10 prompts per point and a
30 s deadline per request; then it prints the ratio table and writes the figure. Every
option of `kvpush bench sweep` can change the grid.
Each demo writes to a new results/demo/<time> directory; to resume an interrupted one, give
its directory with --out.

Why this workload (README, "Benchmarking on a small machine"): the tiny model's prefill
takes milliseconds, so what separates the setups is the handoff itself - coordination
steps, engine-loop work and progress threads - not the model's compute, which on two
cores would otherwise swamp it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvpush.bench import cli as bench_cli
from kvpush.testbed.topology import MAIN_SETUPS, SINGLE

DEMO = {
    "setups": ",".join((*MAIN_SETUPS, "vllm-pull-nospin", SINGLE)),
    "rates": "0.5,4",
    "input_lens": "256",
    "output_len": 32,
    "num_prompts": 10,
    "iterations": 1,
    "request_timeout": 30.0,
    "out": Path("results/demo"),
}


EPILOG = """\
examples:
  kvpush demo                                   # about 10 minutes; results/demo/<time>/
  kvpush demo --out results/demo/20261129-101500  # resume an interrupted demo
  kvpush demo --rates 1,2,4 --num-prompts 24    # a larger grid
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a ~10 minute sweep of every connector setup: table + plot (make demo)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_cli.add_sweep_arguments(parser, DEMO)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out == DEMO["out"]:
        args.out = args.out / time.strftime("%Y%m%d-%H%M%S")
        print(f"kvpush demo: results in {args.out} (resume an interrupted demo with --out)")
    return bench_cli.run_sweep(args)
