"""stasis-rsh's command line read as ssh's (stasis/slurm/rsh.py): the options a launcher puts
before HOST skipped, `user@` dropped, the command's words kept as they are; where a restored
agent finds its part (the node at its host's place in the NodeList now), by its key. Its work
with real daemons: tests/e2e/test_mpi_rsh.py, tests/e2e/test_mpi_cut.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from stasis.slurm.partnames import part_label, part_of
from stasis.slurm.rsh import _Signals, moved_to, parse_args


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


@pytest.mark.parametrize(
    ("host", "started_on", "now", "expected"),
    [
        ("n2", ["n1", "n2"], ["n1", "n3"], "n3"),  # the second node's part is on n3 now
        ("n2.cluster", ["n1", "n2"], ["n3", "n1"], "n1"),  # another order: by place
        ("n1", ["n1", "n2"], ["n1", "n2"], "n1"),  # requeued onto the same nodes
        ("n2", ["n1", "n2"], ["n3", "n4", "n5"], "n4"),  # more nodes now: the same place
        ("n2", ["n1", "n2"], [], "n2"),  # not running: cannot tell
        ("n9", ["n1", "n2"], ["n3", "n4"], "n9"),  # not one of the job's: as it was
    ],
)
def test_a_restored_agent_follows_its_host_s_place(
    host: str, started_on: list[str], now: list[str], expected: str
) -> None:
    assert moved_to(host, started_on, now) == expected


def test_a_part_is_named_by_its_slurm_job_and_key() -> None:
    assert part_of(part_label("12", "0a1b2c3d")) == ("12", "0a1b2c3d")
    for label in ("slurm-12-part", "slurm-12-part-0A1B2C3D", "slurm-x-part-0a1b2c3d", "12"):
        assert part_of(label) is None, label


@pytest.fixture
def agent_signals() -> Iterator[_Signals]:
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield _Signals()
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def test_a_signal_ends_the_wait_between_polls(agent_signals: _Signals) -> None:
    """The agent polls less often while its part is quiet; a signal must not wait for the next
    poll (an MPI launcher's SIGTERM reaches the part at once)."""
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    start = time.monotonic()
    timer.start()
    agent_signals.wait(30.0)
    waited = time.monotonic() - start
    timer.join()
    assert agent_signals.pending == ["TERM"]
    assert 0.2 <= waited < 5.0, waited
    start = time.monotonic()
    agent_signals.wait(10.0)  # a signal not yet passed on: no wait at all
    assert time.monotonic() - start < 0.01
