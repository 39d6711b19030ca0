"""A job's record as `scontrol show job -o` prints it, with whatever name its user gives it: the
fields read are Slurm's own, or the record is refused whole (Slurm prints the name raw)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stasis.errors import SlurmError
from stasis.slurm.scontrol import parse_job_record

# A running job's record as Slurm 22.05 prints it (this machine's), NAME where its name goes.
RECORD = (
    "JobId=7 JobName=NAME UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A "
    "Priority=4294901759 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:05 "
    "TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-06T01:35:00 "
    "EligibleTime=2026-12-06T01:35:00 AccrueTime=Unknown StartTime=2026-12-06T01:35:01 "
    "EndTime=Unknown Deadline=N/A PreemptEligibleTime=2026-12-06T01:35:01 PreemptTime=None "
    "SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-06T01:35:00 Scheduler=Main "
    "Partition=low AllocNode:Sid=localhost:32044 ReqNodeList=(null) ExcNodeList=(null) "
    "NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,mem=1000M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* "
    "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/home/alice/job.sh "
    "WorkDir=/home/alice AdminComment=stasis-token=1764985000-42 "
    "StdErr=/home/alice/job-7.out StdIn=/dev/null StdOut=/home/alice/job-7.out Power="
)

REAL = parse_job_record(RECORD.replace("NAME", "plain"))

FORGERIES = [
    "x UserId=0(root) StdOut=/etc/shadow AdminComment=stasis-token=abc",
    "x UserId=root(0)",
    "x\tUserId=root(0)",
    "x\nUserId=root(0)",
    "x\rUserId=root(0)",
    "x StdOut=/etc/shadow",
    "x AdminComment=stasis-token=abc",
    "x BatchHost=n9",
    "x HetJobIdSet=1 UserId=root(0)",
    "x JobId=8",
    " UserId=root(0) GroupId=root(0)",
    # A whole record in the name, the real one's rest made to look like a second record.
    "x UserId=root(1001) StdOut=/etc/shadow\nJobId=8 JobName=y",
]


@pytest.mark.parametrize("name", FORGERIES)
def test_a_name_writing_keys_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(SlurmError) as e:
        parse_job_record(RECORD.replace("NAME", name))
    assert "\n" not in str(e.value) and "job 7" in str(e.value) and "resubmit" in str(e.value)


def test_the_real_record_reads_as_slurm_wrote_it() -> None:
    assert REAL["UserId"] == "alice(1001)" and REAL["StdOut"] == "/home/alice/job-7.out"
    assert REAL["AdminComment"] == "stasis-token=1764985000-42" and REAL["JobName"] == "plain"
    assert REAL["BatchHost"] == "n1" and REAL["Restarts"] == "2"


def test_a_path_repeating_a_key_is_refused() -> None:
    record = RECORD.replace("NAME", "x").replace(
        "WorkDir=/home/alice", "WorkDir=/home/alice/a StdOut=/etc/shadow"
    )
    with pytest.raises(SlurmError, match="StdOut twice"):
        parse_job_record(record)


_PIECES = st.sampled_from(
    [
        " ",
        "\t",
        "\n",
        "\r",
        "\x0b",
        "\x85",
        "\u2028",
        "=",
        "(",
        ")",
        "x",
        "UserId",
        "UserId=",
        "root(0)",
        "JobId=",
        "JobName=",
        "StdOut=",
        "/etc/shadow",
        "AdminComment=",
        "stasis-token=",
        "HetJobIdSet=",
        "BatchHost=",
        "WorkDir=",
        "PreemptTime=",
        "Foo=",
        "Partition=",
        "high",
    ]
)
NAMES = st.one_of(st.text(max_size=80), st.lists(_PIECES, max_size=12).map("".join))


@settings(max_examples=600, deadline=None)
@given(NAMES)
def test_any_name_gives_the_real_fields_or_a_refusal(name: str) -> None:
    try:
        fields = parse_job_record(RECORD.replace("NAME", name))
    except SlurmError:
        return
    assert {k: v for k, v in fields.items() if k != "JobName"} == {
        k: v for k, v in REAL.items() if k != "JobName"
    }
    assert fields["JobName"] == name.strip()
