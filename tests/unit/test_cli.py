"""The `kvpush` command line as a user meets it: every -h has an example, every bad input is
one line on stderr with exit code 2 (no traceback), and `--vllm-args "--flag"` works."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.args import attach_dash_values
from kvpush.cli import build_parser, main
from kvpush.testbed.up import vllm_args

PROFILE = Path(__file__).parent.parent / "data" / "plan" / "profile.json"


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from commands(sub)


def test_every_command_has_help_with_an_example() -> None:
    progs = []
    for parser in commands(build_parser()):
        progs.append(parser.prog)
        assert "example" in parser.format_help(), f"{parser.prog} -h has no example"
    named_in_the_issue = {"plan", "plan simulate", "model", "bench", "bench hooks", "bench compare"}
    assert {f"kvpush {name}" for name in named_in_the_issue} <= set(progs)


def one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `kvpush ARGV`, expecting exit code 2, nothing on stdout, one line on stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    assert code == 2, (argv, captured)
    assert captured.out == "", argv
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, (argv, lines)
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "kvpush: error: the following arguments are required: COMMAND (see kvpush -h)"),
        (
            ["proxy", "--mode", "pull", "--unknown"],
            "unrecognized arguments: --unknown (see kvpush proxy -h)",
        ),  # fmt: skip
        (["model", "tiny", "/proc/kvpush/m"], "kvpush model tiny: cannot write /proc/kvpush"),
        (["model", "tiny", "m", "--vocab-size", "10"], "--vocab-size: must be at least 300"),
        (["up", "--connector", "vllm-pull", "--model", "/nonexistent"], "build one with"),
        (["up", "--connector", "vllm-pull", "--model", "m", "--port", "70000"], "1-65535"),
        (["up", "--connector", "vllm-pull", "--model", "m", "--vllm-args", '"x'], "--vllm-args"),
        (
            ["up", "--connector", "kvpush-push", "--model", "m", "--kv-extra-config", "[1]"],
            """--kv-extra-config: expected a JSON object like '{"lease_s": 60}'""",
        ),
        (
            ["up", "--connector", "kvpush-push", "--model", "m", "--kv-extra-config", "lease"],
            "--kv-extra-config: not JSON",
        ),
        (["demo", "--rates", "0"], "--rates needs positive numbers"),
        (["demo", "--workdir", "/proc/kvpush", "--out", "/proc/kvpush/o"], "kvpush demo: cannot"),
        (["bench", "hooks", "--requests", "0"], "--requests: must be at least 1"),
        # a flag of another command is not taken for the start of one of this command's
        (["bench", "hooks", "--out", "d"], "unrecognized arguments: --out d (see kvpush bench"),
        (["bench", "sweep", "--iter", "2"], "unrecognized arguments: --iter 2"),
        (["bench", "compare", "--setups", "nccl"], "kvpush bench compare: --setups: unknown"),
        (["bench", "sweep", "--kv-cache-gib", "-1"], "--kv-cache-gib: must be above 0"),
        (["bench", "plot", "/nonexistent"], "is not a directory of sweep results"),
        (["proxy", "--mode", "pull"], "at least one prefill and one decode backend"),
        (["proxy", "bench", "--streams", "0"], "kvpush proxy bench: stream counts must be"),
        (["plan", "--layers", "x"], "kvpush plan: error: argument --layers"),
        (["plan", "check", "/nonexistent", "--profile", str(PROFILE)], "sweep --out` folder"),
    ],
)
def test_bad_input_is_one_line_on_stderr_with_exit_code_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in one_error_line(argv, capsys)


def test_vllm_args_take_a_flag_as_a_user_types_it() -> None:
    parser = build_parser()
    base = ["up", "--connector", "vllm-pull", "--model", "m"]
    for given, expected in (
        (["--vllm-args", "--enable-prefix-caching", "--eager"], "--enable-prefix-caching"),
        (["--vllm-args", "--max-num-batched-tokens 512 --enable-prefix-caching"], None),
        (["--vllm-args=--enable-prefix-caching"], "--enable-prefix-caching"),
    ):
        args = parser.parse_args([*base, *given])
        assert args.vllm_args == (expected or given[1])
    assert parser.parse_args([*base, "--vllm-args", "-x", "--eager"]).eager
    assert vllm_args("--max-num-batched-tokens 512 --enable-prefix-caching") == [
        "--max-num-batched-tokens",
        "512",
        "--enable-prefix-caching",
    ]
    up = next(p for p in commands(parser) if p.prog == "kvpush up")
    assert "--vllm-args --enable-prefix-caching" in up.format_help()


def test_attaching_a_dash_value_leaves_everything_else_alone() -> None:
    flags = {"--vllm-args"}
    assert attach_dash_values(["--a", "--vllm-args", "-x", "b"], flags) == [
        "--a",
        "--vllm-args=-x",
        "b",
    ]
    assert attach_dash_values(["--", "--vllm-args", "-x"], flags) == ["--", "--vllm-args", "-x"]
    assert attach_dash_values(["--vllm-args"], flags) == ["--vllm-args"]  # argparse says why


def test_the_namespace_names_the_command_that_ran() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo"]).prog == "kvpush demo"
    assert parser.parse_args(["bench", "plot", "d"]).prog == "kvpush bench plot"


SIGTERM_CHILD = """
import sys, time
import kvpush.cli as cli

class Args:
    command = "stand-in"

    @staticmethod
    def func(args):
        try:
            print("ready", flush=True)
            time.sleep(30)  # a command holding servers
        finally:
            print("servers stopped", flush=True)  # what its `with` blocks do on the way out
        return 0

class StandIn:
    def parse_args(self, argv):
        return Args()

cli.build_parser = StandIn
cli.precheck = lambda command: None
sys.exit(cli.main([]))
"""


def test_sigterm_stops_a_command_the_way_ctrl_c_does() -> None:
    """`kill` (or a CI runner's timeout) must unwind a command, so that what it started is
    stopped; before, only the sweep did, and a killed `bench hooks` left its servers."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_CHILD], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert out.strip() == "servers stopped"
    assert proc.returncode == 130


def test_main_leaves_the_callers_sigterm_handler_as_it_was() -> None:
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert signal.getsignal(signal.SIGTERM) is before
