"""argparse, the way every `stasis` command uses it: usage errors are one line and exit 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

from stasis.errors import UsageError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print the whole usage and exit itself; ours is one line (exit code 2).
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def subcommands(
    parser: argparse.ArgumentParser, dest: str = "command", required: bool = True
) -> Any:
    """The sub-command parsers of `parser`, built as `Parser`s too."""
    sub = parser.add_subparsers(dest=dest, metavar="COMMAND", parser_class=Parser)
    sub.required = required
    return sub


def add_json(parser: argparse.ArgumentParser, text: str = "Print one JSON value.") -> None:
    parser.add_argument("--json", action="store_true", help=text)


def int_range(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    return parse
