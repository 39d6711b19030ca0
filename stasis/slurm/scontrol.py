"""What Slurm says, through `scontrol` (and `squeue`) on this node (SLURM_CONF picks the cluster).

Their own words are read here and nowhere else: a job Slurm does not know is a
SlurmJobNotFoundError, any other failure a SlurmError.
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass

from stasis.errors import NotFoundError, SlurmError, SlurmJobNotFoundError, UsageError

_JOB_ID = re.compile(r"^[0-9]{1,10}$")
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
_TOKEN = re.compile(r"stasis-token=([0-9A-Za-z.-]+)")
_USER = re.compile(r"^(.*)\((\d+)\)$")
# What scontrol prints for a job id slurmctld does not know (22.05 and 24.11 alike).
_UNKNOWN_JOB = "Invalid job id"
_TIMEOUT_S = 30


def validate_slurm_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise UsageError(f"{job_id!r} is not a Slurm job id (digits, as in SLURM_JOB_ID)")
    return job_id


def scontrol(*args: str) -> str:
    return _tool("scontrol", *args)


def _tool(tool: str, *args: str) -> str:
    try:
        # errors="replace": a job's name may be any bytes; Slurm prints them as they are.
        result = subprocess.run(
            [tool, *args],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError as e:
        raise SlurmError(f"{tool} is not installed on this node") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{tool} {' '.join(args)} did not answer in {_TIMEOUT_S} s") from e
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()
        why = output.splitlines()[-1] if output else "no output"
        kind = SlurmJobNotFoundError if _UNKNOWN_JOB in output else SlurmError
        raise kind(f"{tool} {' '.join(args)} failed: {why}")
    return result.stdout


def parse_record(text: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` (one `scontrol -o` record); values may hold spaces.

    Lenient (the first of a repeated key wins): only for records whose values no user writes
    (nodes). A job's record is read with parse_job_record."""
    text = text.strip()
    found = list(_KEY.finditer(text))
    fields: dict[str, str] = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        fields.setdefault(m.group(1), text[m.end() : end].strip())
    return fields


def parse_job_record(text: str) -> dict[str, str]:
    """The fields of one `scontrol show job -o` record, or a SlurmError if a value forges some.

    Slurm prints a job's name, comment, working directory and output paths raw, so a job named
    `x UserId=0(root) StdOut=/etc/shadow` would read as root's. Slurm prints each key once, and the
    name is always followed by UserId (after HetJobIdSet in a heterogeneous job; see
    slurm_sprint_job_info): a name holding ` Key=` therefore makes the key after JobName another
    one, or repeats UserId, and a key written into a later value repeats that key when the job has
    it; a line break in a value could start a whole forged record, so the record must be one
    line. Such a record is refused whole, never read in part. A key the job does not have (BatchHost
    while pending) may still be forged in a later value: no identity is taken from this record
    (the daemon takes the kernel's), and what is (paths, token) is only ever used with the
    job owner's rights and among the owner's checkpoints."""
    record = text.strip()
    found = list(_KEY.finditer(record))
    keys = [m.group(1) for m in found]
    job = keys[0] if keys and keys[0] == "JobId" else None
    what = f"scontrol's record of job {_value(record, found, 0)}" if job else "scontrol's record"
    if "\n" in record:
        # A name may hold a line break and a whole record after it (job_info asks for an
        # array's task alone, so that a line per task never comes here).
        raise SlurmError(
            f"{what} spans more than one line (a line break in its name, comment "
            "or a path): the job is refused (resubmit it with a name and paths "
            "without line breaks)"
        )
    repeated = sorted({k[:40] for k in keys if keys.count(k) > 1})[:3]
    if repeated:
        raise SlurmError(
            f"{what} holds {', '.join(repeated)} twice: a value (its name, comment "
            "or a path) writes keys of its own; the job is refused (resubmit it "
            "with a name and paths without ' Key=')"
        )
    if "JobName" not in keys:
        raise SlurmError(f"{what} has no JobName: not a job's record as Slurm prints it")
    at = keys.index("JobName")
    after = keys[at + 1 : at + 3]
    # Only a heterogeneous job's record (HetJobId, before the name) has HetJobIdSet.
    het = "HetJobId" in keys[:at] and after == ["HetJobIdSet", "UserId"]
    if after[:1] != ["UserId"] and not het:
        raise SlurmError(
            f"{what}: its name is followed by "
            f"{after[0][:40] if after else 'nothing'}"
            ", not UserId: the name writes keys of its own; the job is refused "
            "(resubmit it with a name without ' Key=' or line breaks)"
        )
    return {m.group(1): _value(record, found, i) for i, m in enumerate(found)}


def _value(text: str, found: list[re.Match[str]], i: int) -> str:
    end = found[i + 1].start() if i + 1 < len(found) else len(text)
    return text[found[i].end() : end].strip()


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    user: str
    uid: int
    state: str
    restarts: int
    stdout: str
    stderr: str
    token: str  # from AdminComment (set by our job_submit.lua); "" without it
    work_dir: str
    preempted: bool = False  # PreemptTime is set: a preemption's grace time is running
    partition: str = ""
    batch_host: str = ""  # the node its batch step runs on; "" while it runs nowhere
    comment: str = ""  # Comment (the user's, or why stasis held the job)
    reason: str = ""  # Reason: why it is pending (JobHeldAdmin after `requeuehold`)


def job_info(job_id: str) -> JobInfo:
    validate_slurm_job_id(job_id)
    try:
        text = scontrol("show", "job", "-o", job_id)
        if "\n" in text.strip():
            # The task of an array whose job id is the array's own: scontrol prints every task
            # of the array. That task alone, by ARRAY_TASK (one line, or refused below).
            task = _array_task(job_id)
            if task is not None:
                text = scontrol("show", "job", "-o", task)
    except SlurmJobNotFoundError:
        raise SlurmJobNotFoundError(f"no Slurm job {job_id}") from None
    fields = parse_job_record(text)
    if fields.get("JobId") != job_id:
        raise SlurmJobNotFoundError(f"no Slurm job {job_id}")
    m = _USER.match(fields.get("UserId", ""))
    if not m:
        raise SlurmError(f"scontrol show job {job_id}: no UserId")
    token = _TOKEN.search(fields.get("AdminComment", ""))
    restarts = fields.get("Restarts", "0")
    return JobInfo(
        job_id=job_id,
        user=m.group(1),
        uid=int(m.group(2)),
        state=fields.get("JobState", ""),
        restarts=int(restarts) if restarts.isdigit() else 0,
        stdout=fields.get("StdOut", ""),
        stderr=fields.get("StdErr", ""),
        token=token.group(1) if token else "",
        work_dir=fields.get("WorkDir", ""),
        preempted=fields.get("PreemptTime", "None") not in ("", "None", "Unknown"),
        partition=fields.get("Partition", ""),
        batch_host=fields.get("BatchHost", "") if fields.get("BatchHost") != "(null)" else "",
        comment=fields.get("Comment", "") if fields.get("Comment") != "(null)" else "",
        reason=fields.get("Reason", ""),
    )


def release(job_id: str) -> None:
    """Let a held job run again (`scontrol release`)."""
    scontrol("release", validate_slurm_job_id(job_id))


def _array_task(job_id: str) -> str | None:
    """`ARRAY_TASK` of the array task whose job id is `job_id`, or None when it is none. From
    squeue's numeric fields only (job id, array job id, task id): no user writes those."""
    for line in _tool(
        "squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%A %F %K"
    ).splitlines():
        fields = line.split()
        if (
            len(fields) == 3
            and fields[0] == job_id
            and _JOB_ID.match(fields[1])
            and _JOB_ID.match(fields[2])
        ):
            return f"{fields[1]}_{fields[2]}"
    return None


def job_of_pid(pid: int) -> str | None:
    """The Slurm job a process of this node belongs to (`scontrol pidinfo`), or None."""
    try:
        text = scontrol("pidinfo", str(int(pid)))
    except SlurmError:
        return None
    m = re.search(r"(?:JobId=|job id )(\d+)", text)
    return m.group(1) if m else None


@functools.cache
def version() -> tuple[int, int]:
    """(major, minor) of the Slurm on this node (scontrol needs its slurm.conf even for this)."""
    return parse_version(scontrol("--version"))


def parse_version(text: str) -> tuple[int, int]:
    """`scontrol --version` says "slurm 24.11.5" (or "slurm-wlm 22.05.8")."""
    m = re.search(r"(\d+)\.(\d+)", text)
    if not m:
        raise SlurmError(f"no Slurm version in {text.strip()!r}")
    return int(m.group(1)), int(m.group(2))


def requeues_preempted_job_when_it_ends() -> bool:
    """Whether Slurm itself requeues a preempted job (PreemptMode=REQUEUE) that ends during its
    grace time. Seen on 24.11: it does, and a job that requeued itself during the grace time is
    requeued once more when its next run ends (it runs twice). Seen on 22.05: it does not (the job
    ends COMPLETED), so the job must requeue itself. Versions between were not seen: they are
    taken as 22.05 (a job run twice is better than a job never resumed)."""
    return version() >= (24, 11)


def requeue(job_id: str) -> None:
    scontrol("requeue", validate_slurm_job_id(job_id))


def set_comment(job_id: str, comment: str) -> None:
    """The job's Comment, which the user sees in `scontrol show job` and `squeue -o %k`."""
    scontrol("update", f"JobId={validate_slurm_job_id(job_id)}", f"Comment={comment}")


def requeue_held(job_id: str, why: str) -> None:
    """Requeue the job held (it runs again once released: `scontrol release`), saying `why` in
    its Comment first."""
    set_comment(job_id, why)
    scontrol("requeuehold", validate_slurm_job_id(job_id))


_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_node_name(node: str) -> str:
    if not isinstance(node, str) or not _NODE.fullmatch(node):
        raise UsageError(f"{node!r} is not a Slurm node name")
    return node


def drain_node(node: str, reason: str) -> None:
    """Slurm gives `node` no new job (State=DRAIN); the jobs on it go on until they end."""
    if not _NODE.fullmatch(node):
        raise SlurmError(f"bad Slurm node name {node!r}")
    scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={reason[:100] or 'stasis'}")


def node_state(node: str) -> str:
    """Slurm's state of `node` (IDLE, MIXED+DRAIN, ...)."""
    if not _NODE.fullmatch(node):
        raise SlurmError(f"bad Slurm node name {node!r}")
    return parse_record(scontrol("show", "node", "-o", node)).get("State", "")


def hostnames(node_list: str) -> list[str]:
    """The node names of a Slurm host list ("n[1-3]")."""
    return scontrol("show", "hostnames", node_list).split()


def job_node_list(job_id: str) -> list[str]:
    """The nodes of job `job_id`'s allocation, in its NodeList's order ([] while it has none).
    From squeue's numeric job id and node list: no user writes either (a job's name could hold
    " NodeList=..." in `scontrol show job`'s line)."""
    validate_slurm_job_id(job_id)
    for line in _tool("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%A %N").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == job_id and fields[1] not in ("", "(null)"):
            return hostnames(fields[1])
    return []


def node_address(node: str) -> str:
    """Where `node` is reached (its NodeAddr; Slurm says the NodeName when none is set)."""
    validate_node_name(node)
    try:
        text = scontrol("show", "node", "-o", node)
    except SlurmError as e:
        # 22.05 and 24.11 alike: "Node n9 not found" on stderr, exit 1.
        if "not found" in str(e):
            raise NotFoundError(f"no Slurm node {node}") from None
        raise
    fields = parse_record(text.splitlines()[0] if text.strip() else "")
    if fields.get("NodeName") != node:
        raise NotFoundError(f"no Slurm node {node}")
    return fields.get("NodeAddr") or node


def jobs_on_node(node: str) -> list[str]:
    """The jobs Slurm has running or completing on `node` (ids, ascending)."""
    validate_node_name(node)
    text = _tool("squeue", "-h", "-w", node, "-t", "RUNNING,COMPLETING", "-o", "%i")
    return sorted({j for j in text.split() if _JOB_ID.match(j)}, key=int)
