"""The docs say what the code does: every setting and flag has its entry, every documented
command exists, every link leads somewhere, and the README stays short. Fast: no daemon, only
the parsers, the Settings and the files."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from stasis import configdoc
from stasis.cli import reference
from stasis.cli.main import parser
from stasis.config import Settings, env_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 220


def markdown_files() -> list[Path]:
    """The docs, and the other markdown files they lead to."""
    return [
        README,
        *sorted(DOCS.glob("*.md")),
        ROOT / "SECURITY.md",
        ROOT / "bench/README.md",
        ROOT / "stasis/slurm/README.md",
    ]


# -- (a) settings ------------------------------------------------------------------------------


def config_rows(text: str) -> dict[str, tuple[set[str], str]]:
    """setting -> (its environment variables, its default cell), from every table of
    docs/configuration.md whose header is `| setting | environment | default | ...`."""
    rows: dict[str, tuple[set[str], str]] = {}
    in_table = False
    for line in text.splitlines():
        if line.startswith("| setting | environment | default |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if not in_table or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
        assert key, f"docs/configuration.md: a row whose setting is not one `key`: {line[:80]}"
        assert key.group(1) not in rows, f"docs/configuration.md: {key.group(1)} twice"
        rows[key.group(1)] = (set(re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[1])), cells[2])
    return rows


def check_settings(text: str) -> list[str]:
    """What docs/configuration.md gets wrong about stasis/config.py, one line each."""
    rows = config_rows(text)
    wrong: list[str] = []
    env_of = {key: set(env_names(key)) for key in Settings._fields}
    defaults = Settings._field_defaults
    for key in Settings._fields:
        if key not in rows:
            wrong.append(f"setting {key} has no row in docs/configuration.md")
            continue
        envs, default_cell = rows[key]
        if envs != env_of.get(key, set()):
            wrong.append(
                f"setting {key}: docs/configuration.md names the variables "
                f"{sorted(envs)}, stasis/config.py reads {sorted(env_of.get(key, ()))}"
            )
        default = defaults[key]
        if isinstance(default, bool | int | float):
            shown = re.match(r"`([^`]*)`", default_cell)
            said = shown.group(1) if shown else default_cell
            ok = (
                said == str(default).lower()
                if isinstance(default, bool)
                else re.fullmatch(r"[0-9.]+", said) is not None and float(said) == default
            )
            if not ok:
                wrong.append(
                    f"setting {key}: docs/configuration.md says the default is "
                    f"{said!r}, stasis/config.py has {default!r}"
                )
    for key in rows:
        if key not in defaults:
            wrong.append(f"docs/configuration.md documents {key}, which is no setting")
    return wrong


def test_every_setting_has_its_row_and_every_row_its_setting() -> None:
    assert check_settings((DOCS / "configuration.md").read_text()) == []


def test_the_configuration_page_is_what_the_declarations_say() -> None:
    assert (
        (DOCS / "configuration.md").read_text() == configdoc.render()
    ), "docs/configuration.md is stale: run `make docs` (python -m stasis.configdoc)"


def test_the_settings_check_fails_when_it_should() -> None:
    text = (DOCS / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `keep` |"))
    assert any("keep has no row" in w for w in check_settings(text.replace(row + "\n", "")))
    assert any(
        "no setting" in w
        for w in check_settings(
            text.replace(row, row + "\n" + row.replace("`keep`", "`keep_forever`", 1))
        )
    )
    assert any(
        "default is '7'" in w
        for w in check_settings(text.replace(row, row.replace("| `5` |", "| `7` |")))
    )
    assert any(
        "names the variables" in w
        for w in check_settings(text.replace(row, row.replace("`STASIS_KEEP`", "`STASIS_KEPT`")))
    )


# -- (b) the CLI reference ---------------------------------------------------------------------


def test_the_cli_reference_is_what_the_parsers_say() -> None:
    assert (
        DOCS / "cli.md"
    ).read_text() == reference.render(), "docs/cli.md is stale: run `make docs`"


def test_every_flag_has_help_that_says_what_it_does() -> None:
    missing = [
        f"{' '.join(path)} {a.option_strings[0]}"
        for path, p, _ in reference.commands()
        for a in p._actions
        if a.option_strings
        and not isinstance(a, argparse._HelpAction)
        and not says_something(reference.expand(a, p.prog))
    ]
    assert missing == []
    assert not says_something("(default: none)") and says_something("Keep it (default: 1).")


def says_something(help_text: str) -> bool:
    """More than a default: `(default: X)` alone says nothing of what the flag does."""
    return bool(re.sub(r"\(?default:[^)]*\)?", "", help_text).strip(" .;:()"))


def test_the_reference_names_the_flags_the_issue_found_undocumented() -> None:
    text = (DOCS / "cli.md").read_text()
    for command, flag in [
        ("stasis dump", "--no-encrypt"),
        ("stasis restore", "--no-lazy"),
        ("stasis slurm install", "--warn-s"),
        ("stasis controlplane join", "--cluster-id"),
    ]:
        section = text.split(f"`{command}`\n", 1)[1].split("\n#", 1)[0]
        assert flag in section, f"{flag} is not in the reference of {command}"


# -- (c) documented commands exist ---------------------------------------------------------------

_PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_/.\-=]*|\.\.\.|<.*>|\$.*|\(.*|.*\.\.\.)$")


def _choices(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return None


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def check_command(words: list[str], top: argparse.ArgumentParser) -> str | None:
    """Why `stasis WORDS` (as a doc writes it: placeholders, [optional] parts, a|b choices)
    names a command, subcommand or flag that does not exist; None when it does not."""
    level = [top]
    path = ["stasis"]
    tokens: list[str] = []
    for raw in words:
        pieces = raw.split("|")
        flags = [p for p in pieces if p.strip("[](){}").startswith("-")]
        # `[--stop|--no-stop]`: two flags; `[--warn-s 60|--drop]`: a value, then a flag
        tokens += flags if flags and len(pieces) > 1 else [raw]
    takes_value = False
    for raw in tokens:
        if raw == "--":
            return None  # what follows is the job's
        word = raw.strip("[](){}")
        if takes_value and not word.startswith("-"):
            takes_value = False
            continue  # the value of the flag before
        takes_value = False
        if not word or word in ("|", "...", "·"):
            continue
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            found = [o[flag] for o in map(_options, level) if flag in o]
            if not found:
                return f"`{' '.join(path)}` has no flag {flag}"
            takes_value = "=" not in word and found[0].nargs != 0
            continue
        subs = [c for c in map(_choices, level) if c is not None]
        if not subs:
            continue  # an argument of a command that has no subcommands
        if _PLACEHOLDER.match(word):
            return None  # a placeholder where a subcommand goes: nothing more to check
        names = word.split("|")
        known = {n: c[n] for c in subs for n in names if n in c}
        unknown = [n for n in names if n not in known]
        if unknown:
            required = any(
                a.required
                for p in level
                for a in p._actions
                if isinstance(a, argparse._SubParsersAction)
            )
            if required or not known:
                return f"`{' '.join(path)}` has no subcommand {unknown[0]}"
        level = list(known.values())
        path.append(word)
    return None


def documented_commands(text: str) -> list[list[str]]:
    """Every `stasis ...` command in the code blocks and code spans of a markdown text, as
    words: a command at the start of a line or after `;`, `&&`, `|`, `(`, `$(` or `sudo`."""
    blocks: list[str] = []
    prose: list[str] = []
    for i, part in enumerate(re.split(r"^```[a-z]*\n", text, flags=re.M)):
        (blocks if i % 2 else prose).append(part)
    lines: list[str] = []
    for block in blocks:
        joined = re.sub(r"\\\n", " ", block)
        lines += [re.sub(r"(^|\s)#.*$", "", line) for line in joined.splitlines()]
    for part in prose:
        lines += re.findall(r"`(stasis [^`]+)`", " ".join(part.split()))
    commands = []
    for line in lines:
        for segment in re.split(r";|&&|\|\||\$\(|\(|\|\s", line):
            words = segment.split()
            while words and (
                words[0] in ("sudo", "env", "exec")
                or "=" in words[0]
                and not words[0].startswith("-")
            ):
                words = words[1:]
            if words and (words[0] == "stasis" or words[0].endswith("/stasis")):
                commands.append(words[1:])
    return commands


def test_every_documented_command_exists() -> None:
    top = parser()
    wrong = []
    count = 0
    for path in markdown_files():
        for words in documented_commands(path.read_text()):
            count += 1
            why = check_command(words, top)
            if why:
                wrong.append(f"{path.relative_to(ROOT)}: stasis {' '.join(words)}: {why}")
    assert wrong == []
    assert count > 100  # the docs' commands were found at all


def test_the_command_check_fails_when_it_should() -> None:
    top = parser()
    text = (
        "```sh\nstasis controlplane tokens lists\n(cd x; stasis dump --no-such-flag 1)\n"
        "stasis slurm install --node-role worker [--warn-s 60|--drop]\n```\n"
        "and `stasis checkpoint ID` in prose\n"
    )
    found = [check_command(w, top) for w in documented_commands(text)]
    assert found == [
        "`stasis controlplane tokens` has no subcommand lists",
        "`stasis dump` has no flag --no-such-flag",
        "`stasis slurm install` has no flag --drop",
        "`stasis` has no subcommand checkpoint",
    ]
    ok = (
        "```sh\n.venv/bin/stasis controlplane nodes|jobs --json  # a comment\n"
        "stasis checkpoints --label train rm CHECKPOINT\nstasis run -- stasis nothing\n```\n"
    )
    assert [check_command(w, top) for w in documented_commands(ok)] == [None, None, None]


# -- (d) every subcommand in its parent's --help -------------------------------------------------


def hidden_subcommands(top: argparse.ArgumentParser) -> list[str]:
    hidden = []
    for path, p, _ in reference.commands(top):
        choices = _choices(p)
        if not choices:
            continue
        shown = p.format_help()
        for name in choices:
            if not re.search(rf"^\s+{re.escape(name)}(\s|$)", shown, re.M):
                hidden.append(f"{' '.join(path)} {name}")
    return hidden


def test_every_subcommand_shows_in_its_parents_help() -> None:
    assert hidden_subcommands(parser()) == []


def test_the_help_check_fails_when_it_should() -> None:
    top = parser()
    controlplane = _choices(top)["controlplane"]  # type: ignore[index]
    tokens = _choices(controlplane)["tokens"]  # type: ignore[index]
    sub = next(a for a in tokens._actions if isinstance(a, argparse._SubParsersAction))
    sub.add_parser("forget")  # no help=: argparse leaves it out of --help
    assert hidden_subcommands(top) == ["stasis controlplane tokens forget"]


# -- (e) links ---------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.relative_to(root)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{path.relative_to(root)}: {target}: no such heading")
    return broken


def test_every_relative_link_leads_somewhere() -> None:
    assert [b for path in markdown_files() for b in broken_links(path)] == []


def test_the_link_check_fails_when_it_should(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading: `here`\n")
    page.write_text(
        "[a](there.md#a-heading-here) [b](gone.md) [c](there.md#nowhere) "
        "[d](https://example.org/x)\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md: gone.md: no such file",
        "page.md: there.md#nowhere: no such heading",
    ]


# -- (f) a README an admin reads -------------------------------------------------------------------


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize(
    "section",
    [
        "## The two commands",
        "## Status",
        "## Requirements",
        "GPU",
        "multi-node",
        "x86-64",
        "Debian 12",
        "Debian 13",
    ],
)
def test_the_readme_says_what_works_and_what_does_not(section: str) -> None:
    assert section.lower() in README.read_text().lower()
