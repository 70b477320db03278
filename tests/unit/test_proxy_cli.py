"""`kvpush proxy`'s command line: every number checked where it is parsed, one-line errors
naming the flag, per-role policies and their spellings."""

from __future__ import annotations

import pytest

from kvpush.cli import build_parser, main
from kvpush.proxy.cli import config_from_args

BACKENDS = ["--mode", "pull", "--prefill", "http://h:1", "--decode", "http://h:2"]


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--port", "99999", "a port is 1-65535 (or 0: any free port), got 99999"),
        ("--port", "-1", "a port is 1-65535"),
        ("--max-body-mb", "-1", "must be above 0, got -1"),
        ("--max-body-mb", "nan", "expected a finite number"),
        ("--request-timeout", "0", "must be above 0"),
        ("--connect-timeout", "x", "expected a number, got 'x'"),
        ("--health-interval", "0", "must be above 0"),
        ("--health-timeout", "-2", "must be above 0"),
        ("--scrape-interval", "-1", "must be 0 or more"),
        ("--retries", "-1", "must be at least 0"),
        ("--retries", "1.5", "expected a whole number"),
        ("--eject-after", "0", "must be at least 1"),
        ("--return-after", "0", "must be at least 1"),
        ("--policy", "random", "policy must be one of least_loaded, round_robin"),
        ("--decode-policy", "fastest", "policy must be one of least_loaded, round_robin"),
    ],
)
def test_a_bad_number_is_one_line_on_stderr_naming_the_flag(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["proxy", *BACKENDS, flag, value])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvpush proxy: error: argument {flag}")
    assert says in lines[0] and lines[0].endswith("(see kvpush proxy -h)")


def test_port_0_is_any_free_port_and_sizes_are_converted() -> None:
    args = build_parser().parse_args(["proxy", *BACKENDS, "--port", "0", "--max-body-mb", "0.5"])
    assert args.port == 0
    assert config_from_args(args).max_body_bytes == 512 * 1024


def test_policy_sets_both_roles_and_each_role_can_have_its_own() -> None:
    def policies(*flags: str) -> dict[str, str]:
        config = config_from_args(build_parser().parse_args(["proxy", *BACKENDS, *flags]))
        return dict(config.policies)

    assert policies() == {"prefill": "least_loaded", "decode": "least_loaded"}
    assert policies("--policy", "round-robin") == {  # the old spelling still works
        "prefill": "round_robin",
        "decode": "round_robin",
    }
    assert policies("--policy", "round_robin", "--decode-policy", "least_loaded") == {
        "prefill": "round_robin",
        "decode": "least_loaded",
    }


def test_a_missing_mode_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["proxy", "--prefill", "http://h:1", "--decode", "http://h:2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "kvpush proxy: --mode push or --mode pull is required (see kvpush proxy -h)\n"
    )
