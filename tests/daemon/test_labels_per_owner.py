"""Labels belong to their owner: lookup, listing and retention are per (owner, label), with root
and a real ordinary user sharing one label on one daemon."""

from __future__ import annotations

import pwd
import secrets
from pathlib import Path
from typing import Any

from tests.conftest import TEST_USER, Daemon, wait_for, workload
from tests.daemon.test_bad_input import one_line_error
from tests.daemon.test_restore_state import last_number, numbers


def _label() -> str:
    return f"shared-{secrets.token_hex(3)}"


def _counter(d: Daemon, label: str, user: str | None = None) -> Any:
    job = d.json("run", "--label", label, "--", *workload("counter.py"), user=user)
    wait_for(lambda: last_number(d, job["job"]) >= 2, what="counting")
    return job


def _dump(d: Daemon, job: Any, user: str | None = None) -> str:
    # Leave-running: one job makes several checkpoints of its label.
    at = last_number(d, job["job"])
    cp: str = d.json("dump", job["job"], "--leave-running", user=user)["checkpoint"]
    wait_for(lambda: last_number(d, job["job"]) > at, what="counting after the dump")
    return cp


def _ids(d: Daemon, *args: str, user: str | None = None) -> list[str]:
    return [c["id"] for c in d.json("checkpoints", *args, user=user)]


def _resumes(
    d: Daemon, original: Any, before: list[int], restored: Any, user: str | None = None
) -> None:
    """`restored` continues `original`'s counter (which had printed `before` when it was
    killed) in `original`'s own log, as its owner."""
    wait_for(lambda: len(numbers(d.log_of(restored["job"]))) > len(before) + 2, what="more")
    after = numbers(d.log_of(restored["job"]))
    assert after[: len(before)] == before  # the original's own log goes on
    # The restored counter starts again from a value the original had reached, not from 0.
    assert 2 <= after[len(before)] <= before[-1] + 1
    uid = pwd.getpwnam(user or "root").pw_uid
    assert Path(f"/proc/{restored['pid']}").stat().st_uid == uid


def test_another_users_dumps_never_retire_roots_checkpoint(daemon: Daemon) -> None:
    # The module daemon keeps 3 per label. Before: the user's dumps counted against root's.
    label = _label()
    mine = _counter(daemon, label)
    root_cp = _dump(daemon, mine)
    theirs = _counter(daemon, label, TEST_USER)
    their_cps = [_dump(daemon, theirs, TEST_USER) for _ in range(4)]
    assert _ids(daemon, "--label", label) == [root_cp]
    assert _ids(daemon, "--label", label, user=TEST_USER) == their_cps[:0:-1]  # newest 3
    daemon.cli("kill", theirs["job"], user=TEST_USER)
    daemon.cli("kill", mine["job"])
    before = numbers(daemon.log_of(mine["job"]))
    restored = daemon.json("restore", "--label", label)
    assert restored["checkpoint"] == root_cp
    _resumes(daemon, mine, before, restored)
    daemon.cli("kill", restored["job"])


def test_a_label_squatted_by_another_user_does_not_stop_the_owner(daemon: Daemon) -> None:
    # Before: root's newer checkpoint of the label made the user's restore "permission denied".
    label = _label()
    theirs = _counter(daemon, label, TEST_USER)
    their_cp = _dump(daemon, theirs, TEST_USER)
    squatter = _counter(daemon, label)
    _dump(daemon, squatter)
    daemon.cli("kill", squatter["job"])
    daemon.cli("kill", theirs["job"], user=TEST_USER)
    assert _ids(daemon, "--label", label, user=TEST_USER) == [their_cp]
    before = numbers(daemon.log_of(theirs["job"]))
    restored = daemon.json("restore", "--label", label, user=TEST_USER)
    assert restored["checkpoint"] == their_cp
    _resumes(daemon, theirs, before, restored, TEST_USER)
    daemon.cli("kill", restored["job"], user=TEST_USER)


def test_root_restores_its_own_label_unless_it_names_the_user(
    daemon: Daemon, test_user: pwd.struct_passwd
) -> None:
    # Before: root's `restore --label L` took the newest of anyone's, here the user's process.
    label = _label()
    mine = _counter(daemon, label)
    root_cp = _dump(daemon, mine)
    theirs = _counter(daemon, label, TEST_USER)
    their_cp = _dump(daemon, theirs, TEST_USER)  # the newest of the label
    daemon.cli("kill", mine["job"])
    daemon.cli("kill", theirs["job"], user=TEST_USER)

    before = numbers(daemon.log_of(mine["job"]))
    restored = daemon.json("restore", "--label", label)
    assert restored["checkpoint"] == root_cp
    _resumes(daemon, mine, before, restored)
    daemon.cli("kill", restored["job"])

    # Root acting on the user's label says whose, by name or uid.
    assert _ids(daemon, "--label", label, "--user", TEST_USER) == [their_cp]
    assert _ids(daemon, "--label", label, "--user", str(test_user.pw_uid)) == [their_cp]
    before = numbers(daemon.log_of(theirs["job"]))
    as_theirs = daemon.json("restore", "--label", label, "--user", TEST_USER)
    assert as_theirs["checkpoint"] == their_cp
    _resumes(daemon, theirs, before, as_theirs, TEST_USER)
    daemon.cli("kill", as_theirs["job"])

    # The user may not name root, neither to restore nor to look.
    one_line_error(
        daemon.cli("restore", "--label", label, "--user", "root", user=TEST_USER, check=False),
        2,
        "permission denied",
        "--user root",
    )
    one_line_error(
        daemon.cli("checkpoints", "--user", "0", user=TEST_USER, check=False),
        2,
        "permission denied",
    )
    # Root's listing without a label still shows every owner's; the user's only their own.
    everyone = _ids(daemon)
    assert root_cp in everyone and their_cp in everyone
    assert root_cp not in _ids(daemon, user=TEST_USER)


def test_root_is_told_whose_label_it_is(daemon: Daemon) -> None:
    label = _label()
    theirs = _counter(daemon, label, TEST_USER)
    _dump(daemon, theirs, TEST_USER)
    daemon.cli("kill", theirs["job"], user=TEST_USER)
    err = one_line_error(
        daemon.cli("restore", "--label", label, check=False),
        2,
        f"no checkpoint with label {label}",
        f"--user {TEST_USER}",
    )
    assert "restored" not in err
    # The user is never told about root's labels.
    mine = _counter(daemon, label + "-root")
    _dump(daemon, mine)
    daemon.cli("kill", mine["job"])
    err = one_line_error(
        daemon.cli("restore", "--label", label + "-root", user=TEST_USER, check=False),
        2,
        "no checkpoint with label",
    )
    assert "root" not in err.replace(label + "-root", "")
