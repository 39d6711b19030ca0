"""What the daemon reads of a registering workload's /proc files is bounded (its command line is
the user's to make as long as the kernel allows) and never follows a link; the user name a
registration keeps is the account of the kernel's uid."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from stasis.slurm import registrations


@pytest.fixture
def long_argv() -> Iterator[subprocess.Popen[bytes]]:
    # 300 KiB of arguments, each 1 KiB: far past the cap, well within the kernel's limit.
    argv = [sys.executable, "-c", "import time; time.sleep(30)", *(["a" * 1023] * 300)]
    proc = subprocess.Popen(argv)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_long_command_line_is_read_up_to_the_cap(long_argv: subprocess.Popen[bytes]) -> None:
    full = len(b"".join(a.encode() + b"\0" for a in long_argv.args))  # type: ignore[union-attr]
    assert full > 4 * registrations._PROC_READ_MAX
    deadline = time.monotonic() + 10
    data = b""
    while len(data) < registrations._PROC_READ_MAX and time.monotonic() < deadline:
        time.sleep(0.02)  # until its execve is done (before, the parent's command line)
        data = registrations._read_proc(long_argv.pid, "cmdline")
    assert len(data) == registrations._PROC_READ_MAX
    assert data.startswith(sys.executable.encode() + b"\0-c\0")


def test_a_link_is_not_followed() -> None:
    with pytest.raises(OSError):
        registrations._read_proc(os.getpid(), "exe")  # /proc/PID/exe is a link
    assert b"Uid:" in registrations._read_proc(os.getpid(), "status")


def test_the_user_name_is_the_accounts_of_the_uid() -> None:
    assert registrations._user_name(0) == pwd.getpwuid(0).pw_name
    unknown = 2**31 - 7
    assert registrations._user_name(unknown) == str(unknown)
