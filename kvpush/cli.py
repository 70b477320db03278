"""The `kvpush` command line: one entry point, one subcommand per tool.

Each tool module exposes `register(subparsers)` which adds its parser and sets `func`
(a callable taking the parsed namespace and returning an exit code). Tool modules are
imported here, but keep their heavy imports (torch, vLLM, NIXL) inside functions so that
`kvpush --help` stays fast. Every parser is a `kvpush.args.Parser`: a wrong flag is one line
on stderr and exit code 2. A command that misses an optional dependency prints one line
naming the extra to install (`kvpush.extras`), not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence

from kvpush import __version__
from kvpush.args import Parser
from kvpush.extras import missing_module_hint, precheck
from kvpush.vllm.preflight import SUPPORTED_VLLM, EnvironmentProblem

TOOLS = (
    "kvpush.testbed.model_cli",
    "kvpush.testbed.up",
    "kvpush.bench.demo",
    "kvpush.proxy.cli",
    "kvpush.plan.cli",
    "kvpush.bench.cli",
)


EXAMPLES = """\
examples (each command has -h with more):
  kvpush model tiny models/tiny
  kvpush up --connector kvpush-push --model models/tiny --eager
  kvpush proxy --mode pull --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
  kvpush plan --preset articles
  kvpush demo
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvpush",
        description="KV-cache handoff tools for prefill/decode disaggregated vLLM serving.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvpush {__version__} (supports vLLM {SUPPORTED_VLLM})",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in TOOLS:
        importlib.import_module(name).register(subparsers)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops a command the way Ctrl-C does


def main(argv: Sequence[str] | None = None) -> int:
    # A command that starts servers (bench, demo, plan measure) stops them on the way out
    # of its `with` blocks; SIGTERM (kill, timeout, a CI runner) must take that way too,
    # not end the process and leave the servers running. Tools with their own handling
    # (`up`, `proxy`) install theirs over this one.
    # SIGINT likewise, however the command was started: a shell without job control (a
    # script) starts a background command with SIGINT ignored, and Python keeps that, so
    # `kill -INT` or Ctrl-C in the script's terminal did nothing and `kvpush up` kept its
    # servers running.
    in_main_thread = threading.current_thread() is threading.main_thread()
    before = (
        (signal.signal(signal.SIGTERM, _interrupt),
         signal.signal(signal.SIGINT, signal.default_int_handler))
        if in_main_thread else None
    )  # fmt: skip
    try:
        return _run(argv)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before[0])
            signal.signal(signal.SIGINT, before[1])


def _run(argv: Sequence[str] | None) -> int:
    command: str | None = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        hint = precheck(command)
        if hint is not None:
            print(hint, file=sys.stderr)
            return 1
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        hint = missing_module_hint(command, exc)
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return 1
    except EnvironmentProblem as exc:
        print(f"kvpush {command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
