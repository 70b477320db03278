"""Command-line conventions shared by every `kvpush` subcommand.

- `Parser`: argparse whose errors are one line on stderr, exit code 2, pointing at the
  `-h` of the command they concern (an unknown flag included); which takes a long flag
  only as written in full (argparse's default would read `kvpush bench hooks --out D`,
  a flag of `bench sweep`, as `--output-len D`); whose namespace carries
  `prog`, the command that ran (`kvpush demo`), for messages; and which takes a value
  starting with '-' for the options that expect one (`kvpush up --vllm-args
  "--enable-prefix-caching"`), where plain argparse would read the value as an unknown
  option and say "expected one argument".
- argparse types that check a number where it is parsed, so the error names the flag and
  the range: `port_number`, `positive`, `non_negative`, `at_least`, and for a
  comma-separated list `positive_numbers` (`positive_list` checks such a list elsewhere).
- `UsageError`: input a command cannot use, its message naming the flag or file to fix.
- `cannot_write`: the one-line description of a path a command could not write.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn


class UsageError(ValueError):
    """Input a command cannot use; the message names the flag or file to fix."""


class Parser(argparse.ArgumentParser):
    """The parser of `kvpush` and, through `add_subparsers`, of every subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.dash_values: set[str] = set()
        self.set_defaults(prog=self.prog)  # the deepest subcommand's wins

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> Any:
        # As argparse's, but an unknown flag is blamed on the subcommand that ran, whose
        # -h lists the flags it has, rather than on `kvpush`.
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.chosen(parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def chosen(self, parsed: Any) -> argparse.ArgumentParser:
        """The parser of the (sub)command that `parsed` came from."""
        parser: argparse.ArgumentParser = self
        while True:
            subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            name = getattr(parsed, subcommands[0].dest, None) if subcommands else None
            if name is None:
                return parser
            parser = subcommands[0].choices[name]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        if args is not None and self.dash_values:
            args = attach_dash_values(args, self.dash_values)
        return super().parse_known_args(args, namespace)


def allow_dash_value(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Let `flags` take a value that starts with '-' (written FLAG VALUE or FLAG=VALUE)."""
    if not isinstance(parser, Parser):
        raise TypeError("allow_dash_value needs a kvpush.args.Parser (kvpush.cli builds one)")
    parser.dash_values.update(flags)


def attach_dash_values(argv: Iterable[str], flags: set[str]) -> list[str]:
    """`FLAG VALUE` -> `FLAG=VALUE` for `flags`, which argparse then reads as one option
    whatever VALUE looks like; arguments after `--` are left alone."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            out.append(token)
            out.extend(tokens)
            break
        value = next(tokens, None) if token in flags else None
        out.append(token if value is None else f"{token}={value}")
    return out


def _number(kind: type[int] | type[float], text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        name = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _checked(
    kind: type[int] | type[float], ok: Callable[[Any], bool], rule: str
) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = _number(kind, text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


def port_number(allow_zero: bool = False) -> Callable[[str], int]:
    """A TCP port, 1-65535; with `allow_zero`, 0 too (any free port, chosen when binding)."""
    low = 0 if allow_zero else 1
    rule = "a port is 1-65535" + (" (or 0: any free port)" if allow_zero else "")
    return _checked(int, lambda v: low <= v <= 65535, rule)


def positive() -> Callable[[str], float]:
    """A number above 0 (seconds, sizes)."""
    return _checked(float, lambda v: v > 0, "must be above 0")


def non_negative() -> Callable[[str], float]:
    """A number of 0 or more (0 meaning off, as the flag's help says)."""
    return _checked(float, lambda v: v >= 0, "must be 0 or more")


def at_least(minimum: int) -> Callable[[str], int]:
    """A whole number of at least `minimum` (counts)."""
    return _checked(int, lambda v: v >= minimum, f"must be at least {minimum}")


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line, such as '{"lease_s": 60}'."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        example = '\'{"lease_s": 60}\''
        raise argparse.ArgumentTypeError(f"expected a JSON object like {example}, got {text!r}")
    return value


def positive_list(kind: type[int] | type[float], flag: str, text: str) -> list[Any]:
    """Comma-separated positive numbers of a flag such as --rates; UsageError names the fix."""
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated numbers (got {text!r})") from None
    if not values or any(not value > 0 or not math.isfinite(value) for value in values):
        raise UsageError(f"{flag} needs positive numbers (got {text!r}), e.g. {flag} 1,2,4,8")
    return values


def positive_numbers(kind: type[int] | type[float], flag: str) -> Callable[[str], list[Any]]:
    """An argparse type for a comma-separated list, checked as `positive_list` checks it."""

    def parse(text: str) -> list[Any]:
        try:
            return positive_list(kind, flag, text)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def cannot_write(exc: OSError, path: Path | str) -> str:
    """'cannot write PATH: REASON' for an OSError met writing `path` (or below it)."""
    return f"cannot write {exc.filename or path}: {exc.strerror or exc}"
