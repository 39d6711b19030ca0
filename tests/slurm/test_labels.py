"""Which checkpoints a Slurm job may resume from (the rule that keeps users and reused job ids
apart), and reading `scontrol -o` records."""

from __future__ import annotations

from pathlib import Path

import pytest

from stasis.errors import UsageError
from stasis.slurm.labels import candidates, resolve_label, slurm_extra
from stasis.slurm.scontrol import parse_record
from stasis.store import Store
from tests.store.helpers import SMALL_FILES, make_info, stage


def publish(
    store: Store, label: str, minutes: int, uid: int, job: str, token: str, explicit: bool
) -> str:
    info = make_info(
        label,
        minutes=minutes,
        uid=uid,
        job=job,
        extra=slurm_extra(job, token, explicit, "/o", "/o"),
    )
    stage(store, info, SMALL_FILES)
    return store.publish(info).id


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "store"), staging_root=tmp_path / "staging", keep=0)


def test_default_label_needs_the_same_job_and_token(store: Store) -> None:
    old = publish(store, "7", 0, 1000, "7", "100-1", explicit=False)
    mine = publish(store, "7", 1, 1000, "7", "200-2", explicit=False)
    assert [m.id for m in candidates(store, "7", False, 1000, "7", "200-2")] == [mine]
    # A job that reuses id 7 after a clean slurmctld start has another token: nothing.
    assert candidates(store, "7", False, 1000, "7", "300-3") == []
    assert [m.id for m in candidates(store, "7", False, 1000, "7", "100-1")] == [old]


def test_explicit_label_resumes_across_job_ids_but_never_another_users(store: Store) -> None:
    a = publish(store, "victim", 0, 1000, "3", "1-1", explicit=True)
    b = publish(store, "victim", 1, 1000, "4", "2-2", explicit=True)
    publish(store, "victim", 2, 1001, "5", "3-3", explicit=True)  # someone else's
    assert [m.id for m in candidates(store, "victim", True, 1000, "9", "9-9")] == [b, a]
    assert len(candidates(store, "victim", True, 1001, "9", "9-9")) == 1
    assert candidates(store, "victim", True, 0, "9", "9-9") == []


def test_checkpoints_not_taken_from_slurm_jobs_do_not_count(store: Store) -> None:
    info = make_info("victim", uid=1000)
    stage(store, info, SMALL_FILES)
    store.publish(info)
    assert candidates(store, "victim", True, 1000, "1", "") == []


def test_labels() -> None:
    assert resolve_label("", "42") == ("42", False)
    assert resolve_label("victim", "42") == ("victim", True)
    with pytest.raises(UsageError):
        resolve_label("../etc", "42")


def test_parse_record_with_spaces_and_the_token() -> None:
    text = (
        "JobId=12 JobName=my job UserId=alice(1000) GroupId=alice(1000) "
        "AdminComment=site note stasis-token=1795999072-8401 Restarts=2 "
        "StdOut=/home/alice/out 12.txt Power="
    )
    fields = parse_record(text)
    assert fields["JobId"] == "12" and fields["JobName"] == "my job"
    assert fields["AdminComment"] == "site note stasis-token=1795999072-8401"
    assert fields["StdOut"] == "/home/alice/out 12.txt" and fields["Power"] == ""
    assert fields["Restarts"] == "2"
