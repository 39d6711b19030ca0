"""stasis-rsh's command line read as ssh's (stasis/slurm/rsh.py): the options a launcher puts
before HOST skipped, `user@` dropped, the command's words kept as they are. Its work with real
daemons: tests/e2e/test_mpi_rsh.py."""

from __future__ import annotations

import pytest

from stasis.slurm.rsh import parse_args


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["n2", "orted", "-mca", "x"], ("n2", ["orted", "-mca", "x"])),
        # Hydra's ssh launcher: -x first.
        (
            ["-x", "n2", "/usr/bin/hydra_pmi_proxy", "--control-port", "n1:1"],
            ("n2", ["/usr/bin/hydra_pmi_proxy", "--control-port", "n1:1"]),
        ),
        (["-o", "BatchMode=yes", "-p22", "-l", "me", "n2", "true"], ("n2", ["true"])),
        (
            ["-xT", "-oX=1", "me@n2.cluster", "echo", "-n", "a b"],
            ("n2.cluster", ["echo", "-n", "a b"]),
        ),
        (["--", "n2", "-x"], ("n2", ["-x"])),
    ],
)
def test_ssh_command_lines(argv: list[str], expected: tuple[str, list[str]]) -> None:
    assert parse_args(argv) == expected


@pytest.mark.parametrize("argv", [[], ["n2"], ["-x", "n2"], ["-o", "A=1"]])
def test_no_command_is_a_usage_line(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="^usage: stasis-rsh HOST COMMAND"):
        parse_args(argv)
