"""The daemon's API on the wire: the JSON body of every request and answer, of every route.

Typed dicts, so that the client (`stasis.client`) and everything that reads an answer is checked
by mypy, at little cost when a command starts (~2 ms): this module imports only `typing` (pydantic costs
every `stasis` command ~70 ms here, and typing_extensions, which pydantic needs to validate
typed dicts on Python 3.11, ~11 ms). The daemon builds its answers as these very dicts. What
it receives it validates with pydantic (constraints, defaults, one-line errors): the request
models of stasis.daemon.models, stasis.slurm.models and stasis.k8s.models (each one's
BY_WIRE pairs them with the typed dicts here), which tests/test_wire.py holds to the
request shapes here field by field; a checkpoint is the store's Manifest.

Which route takes and answers which of these is declared in stasis/routes.py, once.

An error, on any route, is {"error": {"type": <a StasisError class>, "message": <one line>}}.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

# `restoring`: recorded before its restored tree resumes (the daemon makes it `restored`).
JobState = Literal["running", "restored", "restoring", "checkpointed", "exited", "failed"]
# What a dump is asked to do with its images; "auto" compresses only memory that shrinks.
CompressionRequest = Literal["none", "zstd", "lz4", "auto"]
# What a stored checkpoint is compressed with (never "auto": that was decided at dump time).
Compression = Literal["none", "zstd", "lz4"]


class WireError(TypedDict):
    type: str
    message: str


# -- jobs ------------------------------------------------------------------------------------


class RunRequest(TypedDict, total=False):
    command: list[str]  # required; every other field may be left out
    label: str | None
    log: str | None  # absolute
    cwd: str  # absolute; required
    env: dict[str, str]
    user: str | None
    # Its own /tmp and /var/tmp, in its checkpoint, gone with it; None: the daemon's setting
    # (private_tmp).
    private_tmp: bool | None
    # A part of a job that spans nodes (root only): the VXLAN id of the job network whose
    # namespace on this node it runs in (made first: stasis/daemon/jobnet.py), in a freezer
    # cgroup of its own, so that it can be frozen with the job's other parts (POST .../freeze).
    job_net: int | None


class RunAnswer(TypedDict):
    job: str
    pid: int
    label: str


class Job(TypedDict):
    job: str
    pid: int | None
    state: JobState
    label: str
    exit_code: int | None
    command: list[str]
    user: str
    uid: int
    cwd: str
    log: str
    checkpoint: str | None  # the checkpoint this job was restored from
    created: str
    private_tmp: bool  # it sees its own /tmp and /var/tmp (stasis run --private-tmp)
    # A part of a job across nodes held frozen by a cut (issue 31): alive, its state unchanged,
    # but not running until the cut thaws or stops it (stasis ps: "running, frozen").
    frozen: bool


class JobInterval(TypedDict):
    """A job's periodic checkpoint interval and why (GET /intervals: each integration's
    `intervals` hook; `stasis ps` shows them)."""

    job: str  # the integration's id: a Slurm job id, a container id
    kind: str  # slurm, container
    label: str
    user: str
    requested: str  # "auto" or the seconds asked ("600")
    interval_s: float  # the interval in force
    why: str  # one line: asked, or auto's cost, rate and bound
    cost_s: float | None  # auto: one checkpoint's cost (seconds the job stands frozen)
    cost_measured: bool  # False: estimated from its memory (no checkpoint measured yet)
    mtbi_s: float | None  # auto: mean seconds between interruptions; None = no rate
    raw_s: float | None  # auto: Young/Daly's value before the floor and ceiling
    bound: str  # "", "floor" or "ceiling": which bound set interval_s
    rate_per_hour: float | None  # auto: the interruption rate used (per node- or pod-hour)


class KillRequest(TypedDict, total=False):
    signal: str | int  # TERM, SIGTERM, term, 15
    timeout_s: float | None  # None: the daemon's kill_timeout_s; 0: SIGKILL at once


class KillAnswer(TypedDict):
    job: str
    state: JobState
    ended_by: str | None  # the signal asked for, or SIGKILL; None: it was not running
    exit_code: int | None
    signal: str
    timeout_s: float


class DumpRequest(TypedDict, total=False):
    leave_running: bool
    label: str | None
    compress: CompressionRequest
    incremental: bool
    encrypt: bool | None  # None: the daemon's setting (encrypt)
    reason: str  # why it is taken, as reported: "asked" unless said
    # The job was frozen (POST /jobs/{job}/freeze) for a checkpoint cut across nodes: dumped
    # as it is, and left frozen, whatever leave_running says.
    frozen: bool
    # With frozen only: the cut's record in the checkpoint's manifest (extra["cut"]): how many
    # checkpoints the cut has, and this part's key among them (stasis.slurm.cut).
    cut_parts: int | None
    cut_key: str | None


class DumpAnswer(TypedDict):
    checkpoint: str
    label: str
    job: str
    size_bytes: int
    duration_s: float  # CRIU's dump
    elapsed_s: float  # the daemon's whole answer
    staged: bool
    notes: list[str]  # every way the dump differs from what was asked, and why


class FreezeRequest(TypedDict, total=False):
    # Thawed by the daemon after this long unless stopped or thawed before (default 60 s).
    timeout_s: float


class FreezeAnswer(TypedDict):
    job: str
    cgroup: str  # its freezer cgroup
    job_net: int | None  # the job network held still while it is frozen
    timeout_s: float


class ThawRequest(TypedDict, total=False):
    # End it at the checkpoint taken while it was frozen (every part dumped), instead of
    # letting it run on (an abandoned cut).
    stop: bool


class ThawAnswer(TypedDict):
    job: str
    state: JobState
    stopped: bool
    checkpoints: list[str]  # taken while it was frozen


class DumpCheckAnswer(TypedDict):
    job: str
    obstacles: list[str]
    notes: list[str]


class RestoreRequest(TypedDict, total=False):
    checkpoint: str | None
    label: str | None
    user: str | None  # whose label (root only)
    lazy: bool | None
    verified: bool  # by label: the newest with an ok verdict of `stasis verify`


class RestoreAnswer(TypedDict):
    job: str
    pid: int
    checkpoint: str
    skipped: list[str]
    lazy: bool
    notes: list[str]
    duration_s: float
    elapsed_s: float


class Progress(TypedDict):
    """One line of a dump's or restore's NDJSON stream, before its result."""

    bytes: int
    total: int


# -- checkpoints -----------------------------------------------------------------------------


class Checkpoint(TypedDict):
    """A checkpoint's manifest, as the store keeps it (stasis.store.manifest.Manifest); the
    fields a client reads (the manifest also lists its files and its signature)."""

    id: str
    label: str
    job: str
    host: str
    created: str
    criu_version: str
    command: list[str]
    cwd: str
    user: str
    uid: int
    gid: int
    log_path: str | None
    size_bytes: int
    stored_size_bytes: int
    compression: Compression


class VerifyVerdict(TypedDict):
    """What `stasis verify` found: the checkpoint restored in a sandbox (its whole tree came
    back, stopped before running an instruction, then removed), or why not. Signed in the
    store's catalog with the site key, like the manifest it speaks of."""

    checkpoint: str
    ok: bool
    reason: str  # "" when ok; else one line: what failed
    node: str  # the host that verified it
    at: str  # UTC, ISO 8601
    duration_s: float
    processes: int  # processes that came back (ok) or were expected


class Deleted(TypedDict):
    deleted: str


# What a restore depends on (stasis.engine.nodefacts): recorded in the manifest at dump time as
# `restore_facts` (stasis.store.manifest.RecordedFacts holds the same shape), compared before
# CRIU restores, and shown by `stasis check --checkpoint ID`.


class OpenFile(TypedDict):
    """A regular file the job had open when it was dumped: CRIU reopens it by path."""

    path: str
    size_bytes: int
    mtime_ns: int
    mode: int  # permission bits (st_mode & 0o7777)
    # "append": only ever open write-only with O_APPEND (CRIU skips its size check);
    # "write": open for writing some other way; "read": only ever open read-only.
    access: Literal["read", "write", "append"]


class RestoreFacts(TypedDict):
    arch: str  # os.uname().machine
    cpu_model: str
    cpu_flags: list[str]  # /proc/cpuinfo's flags (Features on arm64), common to every CPU
    kernel: str  # os.uname().release
    criu_version: str
    stasis_version: str
    user: str
    uid: int
    files: list[OpenFile] | None  # None: they could not be read at dump time


Verdict = Literal["ok", "note", "refuses"]


class CompatFact(TypedDict):
    """One thing a restore depends on: as recorded at dump time, as on this node."""

    what: str  # "architecture", "CPU flags", "CRIU", "user", "file /data/x.bin" ...
    recorded: str  # the checkpoint's value
    here: str  # this node's value
    verdict: Verdict
    why: str  # what the difference means (a note's too), "" when ok


class CheckpointCheck(TypedDict):
    """`stasis check --checkpoint ID`: the checkpoint's recorded facts beside this node's."""

    checkpoint: str
    node: str
    recorded: bool  # False: dumped by a stasis that recorded nothing to compare
    restorable: bool  # no fact refuses
    facts: list[CompatFact]


class GcRequest(TypedDict, total=False):
    # Only what nothing was written to for this long is someone's garbage  (3600)
    idle_s: float


class GcAnswer(TypedDict):
    """What `checkpoints gc` removed from the store (and the index entries it added)."""

    staging: list[str]  # staging directories of dumps that died
    partial: list[str]  # checkpoints without a manifest: publishes cut off
    uploads: list[str]  # unfinished multipart uploads (S3), by key
    expired: list[str]  # checkpoints beyond keep or older than keep_max_age_s
    index_entries_removed: int
    index_entries_added: int


class RekeyAnswer(TypedDict):
    """`checkpoints rekey`: checkpoints whose data key was re-wrapped with the current key file,
    how many were on it already, and how many are wrapped by a key this node has not got."""

    rekeyed: list[str]
    current: int
    unknown_key: int


# -- the node --------------------------------------------------------------------------------


class Problem(TypedDict):
    what: str
    fix: str


class NetworkLock(TypedDict):
    rule: str
    remove_with: str
    checkpoint: str | None
    job: str | None
    release_at: str | None


class CheckReport(TypedDict):
    ok: bool
    criu_path: str | None
    criu_version: str | None
    kernel: str
    features: dict[str, bool]
    notes: list[str]
    problems: list[Problem]
    network_locks: list[NetworkLock]


# -- Slurm (stasis.slurm) ----------------------------------------------------------------------


class Health(TypedDict):
    ok: bool


class RegisterRequest(TypedDict, total=False):
    slurm_job: str  # required
    pid: int  # required: the workload's namespace init
    label: str  # required
    explicit_label: bool
    restored_from: str | None  # the checkpoint the workload was restored from


class Registration(TypedDict):
    slurm_job: str
    pid: int
    pid_start: int | None
    launcher_pid: int
    uid: int
    gid: int
    user: str
    label: str
    explicit_label: bool
    token: str
    stdout: str
    stderr: str
    work_dir: str
    command: list[str]
    state: str  # running | stopping | checkpointed | requeued | requeue-failed
    registered: str
    # Issue 28: what a stop asked for this run, so that its end retires nothing unless it was a
    # genuine success, and a daemon that died mid-stop finishes it (absent: an older daemon).
    stop_asked: NotRequired[bool]  # a stop (preemption, time limit, dump) was asked
    final_failed: NotRequired[bool]  # ...and its checkpoint failed
    stop_checkpoint: NotRequired[str | None]  # the checkpoint that stop is taking
    restarts: NotRequired[int]  # Slurm's Restarts of the job when this run registered
    # The checkpoint this run was restored from (None: started fresh): its checkpoints' parent.
    restored_from: NotRequired[str | None]


class SlurmCheckpointRequest(TypedDict, total=False):
    leave_running: bool
    reason: str  # as reported: "asked" unless said


class SlurmCheckpointAnswer(TypedDict):
    checkpoint: str
    label: str
    slurm_job: str
    size_bytes: int
    duration_s: float
    requeued: bool  # the job will run again (requeued by the daemon, or by Slurm)
    # Slurm requeues it once the batch step ends (a preemption on Slurm >= 24.11): the launcher
    # must exit now, during the grace time, and not requeue it again.
    slurm_requeues: bool


class FinishRequest(TypedDict, total=False):
    exit_code: int | None  # None (or absent): the launcher could not tell: not a success
    stopped: bool  # the launcher was warned or signalled (preemption, time limit, scancel)


class FinishAnswer(TypedDict):
    retired: list[str]


class SlurmIntervalRequest(TypedDict):
    requested: str  # "auto", seconds ("600", "90.5"), or "default" (the node's `interval`)


# One job's periodic checkpoint interval and why (stasis.slurm.intervals builds it: slurm_job,
# user, uid, label, partition, requested, at, interval_s, why, cost_s, ...).
SlurmInterval = dict[str, Any]


# -- Slurm's remote listener (stasis.slurm.remote: TCP, the caller proved by munge) -----------


class SlurmRemoteCheckpointRequest(TypedDict, total=False):
    credential: str  # required: munge's, naming this very request, node and cluster
    leave_running: bool
    reason: str


class SlurmRemoteDrainRequest(TypedDict, total=False):
    credential: str  # required
    reason: str


# A part of a Slurm job on several nodes, started by this node's daemon for the launch agent
# (stasis-rsh: Open MPI's plm_rsh_agent, MPICH Hydra's launcher): stasis.slurm.parts.


class SlurmPartStartRequest(TypedDict, total=False):
    credential: str  # required: the job's user's (or root's), naming this very request
    command: list[str]  # required: run as the Slurm job's user, in the job's network here
    cwd: str  # required, absolute


class SlurmPartOutputRequest(TypedDict, total=False):
    credential: str  # required
    offset: int  # where in the part's output to read from (bytes)


class SlurmPartOutput(TypedDict):
    part: str  # the daemon's job id of the part
    data: str  # base64 of the part's output (stdout and stderr together) from `offset`
    offset: int  # where the next read starts
    state: JobState
    exit_code: int | None  # once it ended


class SlurmPartSignalRequest(TypedDict, total=False):
    credential: str  # required
    signal: Literal["TERM", "HUP", "INT", "KILL"]


class SlurmPartSignalled(TypedDict):
    part: str
    signalled: bool  # False: it was not running


# A cut across nodes, driven by its coordinator as root (stasis.slurm.partclient): the part's
# freeze, its dump as it stands frozen, its thaw or stop, a checkpoint of an abandoned cut.


class SlurmPartFreezeRequest(TypedDict, total=False):
    credential: str  # required: root's
    timeout_s: float


class SlurmPartDumpRequest(TypedDict, total=False):
    credential: str  # required: root's
    label: str  # required: the cut's
    reason: str
    cut_parts: int | None  # the cut's record (DumpRequest)
    cut_key: str | None


class SlurmPartThawRequest(TypedDict, total=False):
    credential: str  # required: root's
    stop: bool


class SlurmPartDeleteRequest(TypedDict, total=False):
    credential: str  # required: root's


class SlurmPartListRequest(TypedDict, total=False):
    credential: str  # required: root's


class SlurmPartRef(TypedDict):
    part: str  # the part's key: its name across moves (its label's end)
    job: str  # the daemon's job of it on that node now
    state: JobState


class SlurmPartList(TypedDict):
    node: str
    parts: list[SlurmPartRef]  # the job's live parts on that node


# A cut restored on requeue by its coordinator (the new batch node's taskinit), as root.


class SlurmPartNetRequest(TypedDict, total=False):
    credential: str  # required: root's
    held: bool  # required: hold the job's network on that node still, or let it go


class SlurmPartNet(TypedDict):
    node: str
    vni: int
    held: bool


class SlurmPartRestoreRequest(TypedDict, total=False):
    credential: str  # required: root's
    checkpoint: str  # required: the part's checkpoint of the cut
    part: str  # required: its key, as the checkpoint records it


class Requeued(TypedDict):
    job: str
    checkpoint: str


class SlurmDrainAnswer(TypedDict):
    """What a node's daemon answers to a drain (stasis.slurm.integration's `_drain`)."""

    slurm_node: str
    requeued: list[Requeued]
    failed: list[str]  # "<job>: <why>", one per protected job not checkpointed


# -- Kubernetes (stasis.k8s: the runtime wrapper, the agent, `stasis k8s`) ----------------------


class ContainerRegisterRequest(TypedDict, total=False):
    runc_root: str  # required
    container_id: str  # required
    bundle: str  # required
    restored_from: str | None


# Why a container is checkpointed. stop: killed once published; interval / manual / cordon /
# annotation: it goes on running.
ContainerCheckpointReason = Literal["stop", "interval", "manual", "cordon", "annotation"]


class ContainerCheckpointRequest(TypedDict, total=False):
    reason: ContainerCheckpointReason
    runc_root: str  # "" = where the container was registered
    timeout_s: float  # 0 = the daemon's k8s_stop_timeout_s


class ContainerIntervalRequest(TypedDict, total=False):
    interval_s: int | None  # 0 = none; None = the container's own STASIS_INTERVAL
    auto: bool  # Young/Daly's from its measured cost (stasis.dev/interval: auto)


class ContainerRestoreRequest(TypedDict, total=False):
    runc_root: str  # required
    container_id: str  # required
    bundle: str  # required


class RestoreDoneRequest(TypedDict, total=False):
    ok: bool  # required
    error: str
    checkpoint: str  # the plan's; "" = the daemon's own plan says which


class ExportRequest(TypedDict, total=False):
    path: str  # required: where the daemon writes the archive


class ImportRequest(TypedDict, total=False):
    path: str  # required
    label: str  # "" = the one in the archive
    namespace: str


class K8sDrainRequest(TypedDict, total=False):
    reason: str


class NodeInfo(TypedDict):
    node: str  # this node's name in the Kubernetes API
    state: str  # Ready, Ready,SchedulingDisabled+DRAIN, ...; "" = the API did not answer
    api: bool  # whether the daemon has a Kubernetes API at all


class ContainerCheckpointAnswer(TypedDict):
    checkpoint: str
    label: str
    container_id: str
    namespace: str
    size_bytes: int
    duration_s: float
    stopped: bool


class RestorePlan(TypedDict):
    checkpoint: str | None  # None: nothing to restore, start fresh
    label: str
    images_dir: str | None
    work_dir: str | None
    notes: list[str]  # what the container's log should say (skipped checkpoints, why fresh)
    # Good checkpoints of the label given up on this node after failed restores: with none
    # left to try, the container starts fresh only if its STASIS_FRESH asks.
    given_up: list[str]


class ContainerInfo(TypedDict):
    container_id: str
    runc_root: str
    bundle: str
    label: str
    namespace: str
    pod: str | None
    interval_s: int  # the one in force (auto: Young/Daly's now, rounded); 0 = none
    interval_auto: bool  # it asked for auto (STASIS_INTERVAL, stasis.dev/interval)
    restored_from: str | None
    last_checkpoint: str | None
    registered: str


class RestoreDone(TypedDict):
    container_id: str
    checkpoint: str | None
    attempts: int  # failed restores of the checkpoint on this node so far
    limit: int  # k8s_restore_attempts (0: never given up)
    log: str  # where the failed restore's log was kept ("" = nowhere)
    record: str  # the file that counts them (removed: its attempts start again)


class Forgotten(TypedDict):
    container_id: str
    forgotten: bool


class ExportAnswer(TypedDict):
    checkpoint: str
    path: str
    digest: str
    size_bytes: int


class EvictedContainer(TypedDict):
    job: str  # the container id
    checkpoint: str
    label: str
    pod: str  # namespace/name


class K8sDrainAnswer(TypedDict):
    k8s_node: str
    requeued: list[EvictedContainer]
    evicted: list[str]  # namespace/name of each pod evicted
    failed: list[str]  # "<container>: <why>"
