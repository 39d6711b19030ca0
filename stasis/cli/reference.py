"""The CLI reference (docs/cli.md), generated from the `stasis` parsers themselves:
`python -m stasis.cli.reference > docs/cli.md` (`make docs`); tests/test_docs.py fails when the
file differs from what this prints, so a flag cannot exist without its entry.

Never imported by `stasis` itself (it builds every sub-parser, which a command must not pay
for). Rendered from the parsers' actions, not from argparse's --help text, whose layout changes
between Python versions and with the terminal's width.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from stasis.cli.main import parser

HEADER = """\
# CLI reference

Generated from the parsers by `python -m stasis.cli.reference` (`make docs`); do not edit by
hand: `tests/test_docs.py` fails when this file and the parsers differ. Every command also
answers `--help`. Exit codes: 0 ok, 1 the operation failed, 2 bad usage or unknown id.
"""


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction | None:  # type: ignore[type-arg]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def commands(
    p: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ("stasis",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command, depth first in the order they were added: (its words, its parser, the
    one line its parent's --help shows for it; "" for the top and for a hidden one)."""
    p = parser() if p is None else p
    if len(path) == 1:
        yield path, p, ""
    sub = _subparsers(p)
    if sub is None:
        return
    shown = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, child in sub.choices.items():
        yield path + (name,), child, shown.get(name, "")
        yield from commands(child, path + (name,))


def expand(action: argparse.Action, prog: str) -> str:
    """The action's help with its %(default)s etc. filled in, as argparse does."""
    text = action.help or ""
    # Older Pythons append this to BooleanOptionalAction's help by themselves; newer do not.
    text = (
        text.removesuffix(" (default: %(default)s)")
        if isinstance(action, argparse.BooleanOptionalAction)
        else text
    )
    params = dict(vars(action), prog=prog)
    for name in list(params):
        if params[name] is argparse.SUPPRESS:
            del params[name]
        elif hasattr(params[name], "__name__"):
            params[name] = params[name].__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return " ".join((text % params).split())


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if isinstance(action.metavar, str):
        name = action.metavar
    elif action.choices is not None:
        name = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        name = action.dest if not action.option_strings else action.dest.upper()
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs in ("*", "+"):
        return f"{name} ..."
    if action.nargs == argparse.REMAINDER:
        return name if "..." in name else f"{name} ..."
    return name


def _argument(action: argparse.Action) -> str:
    metavar = _metavar(action)
    if not action.option_strings:
        return metavar
    flags = ", ".join(action.option_strings)
    return f"{flags} {metavar}" if metavar else flags


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    out = [HEADER]
    for path, p, line in commands():
        if len(path) > 1:
            out.append(f"\n{'#' * min(len(path), 4)} `{' '.join(path)}`\n")
        description = " ".join((p.description or "").split())
        if line and not description.startswith(line):
            out.append(f"\n{line}\n")
        if description:
            out.append(f"\n{description}\n")
        sub = _subparsers(p)
        rows = [
            a
            for a in p._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        ]
        if rows:
            out.append("\n| argument | what it does |\n|---|---|\n")
            for action in rows:
                required = " (required)" if action.required and action.option_strings else ""
                out.append(
                    f"| `{_cell(_argument(action))}`{required} | "
                    f"{_cell(expand(action, p.prog) or 'see above')} |\n"
                )
        if sub is not None:
            names = ", ".join(f"`{n}`" for n in sub.choices)
            optional = "" if sub.required else " (optional)"
            out.append(f"\nSubcommands{optional}: {names}.\n")
    return "".join(out)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
