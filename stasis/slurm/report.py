"""What wall-time limits, memory over-requests and preemptions cost, from Slurm's accounting.

`stasis slurm report` asks sacct (slurmdbd) for the period's job records and sums, per user,
account and partition and per ISO week:

- TIMEOUT: jobs whose last record ended in TIMEOUT; their node-hours (NNodes x ElapsedRaw / 3600),
  GPU-hours (AllocTRES gres/gpu x ElapsedRaw / 3600), and the overshoot past the limit apart.
- Resubmitted after a TIMEOUT: a later job of the same (User, JobName, WorkDir) starting at or
  after the TIMEOUT job ended, within a window (default 24 h); it redoes min(its own node-hours,
  the timed-out job's). Start, not Submit, is compared: dependency chains submit early.
- Memory: per record, the request (ReqMem) against the peak used (the largest TRESUsageInTot mem
  over its steps, else MaxRSS). A record whose peak is under half its request over-requests; its
  node-hours times the unused share of the request are node-hours blocked by over-request.
- Preempted or requeued: `sacct -D` shows one record per attempt of a requeued job; earlier
  attempts end PREEMPTED, REQUEUED or NODE_FAIL. For a job stasis does not protect, their
  node-hours are work redone (the job starts over). For a stasis-protected job (`stasis-token=` in
  its AdminComment, set by stasis' job_submit.lua) they are node-hours kept: the job was restored
  from its checkpoint instead of rerun. A job ending PREEMPTED (PreemptMode=CANCEL) counts as
  preempted; its hours are not counted as redone (no rerun is known).

A job belongs to the period when its last record ended in it (still running: not yet counted);
all of its attempts count, also those before the period. A step record is attached to the job
record printed just before it (sacct prints a record's steps right after it, also under -D).
Parsing and sums are pure functions over sacct's text (tested on recorded output); only `query`
runs sacct.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import date, datetime, timedelta

from stasis.errors import SlurmError, UsageError

FIELDS = (
    "JobIDRaw",
    "User",
    "Account",
    "Partition",
    "JobName",
    "WorkDir",
    "State",
    "Submit",
    "Start",
    "End",
    "ElapsedRaw",
    "TimelimitRaw",
    "NNodes",
    "AllocTRES",
    "ReqMem",
    "MaxRSS",
    "TRESUsageInTot",
    "AdminComment",
)
# A separator no job name or path holds in practice (`|`, sacct's own, may appear in both).
SEP = "\x1f"
# Earlier attempts of a requeued job end in one of these (`sacct -D`).
REQUEUE_STATES = frozenset({"PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "NODE_FAIL"})
OVER_REQUEST_FACTOR = 2.0
PROTECTED_MARK = "stasis-token="
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGTP]?)([nc]?)$")
_TIMEOUT_S = 300


@dataclass
class Record:
    """One job record of sacct (one attempt of a job), with its steps' peak memory."""

    job_id: str
    user: str
    account: str
    partition: str
    name: str
    workdir: str
    state: str
    submit: datetime | None
    start: datetime | None
    end: datetime | None
    elapsed_s: int
    timelimit_min: int | None
    nnodes: int
    gpus: int
    req_mem_bytes: int | None
    peak_mem_bytes: int | None
    protected: bool

    @property
    def node_hours(self) -> float:
        return self.nnodes * self.elapsed_s / 3600

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.elapsed_s / 3600


@dataclass
class Job:
    """Every attempt of one job, oldest first; the last is how it ended."""

    attempts: list[Record]

    @property
    def last(self) -> Record:
        return self.attempts[-1]

    @property
    def interrupted(self) -> list[Record]:
        return [a for a in self.attempts[:-1] if a.state in REQUEUE_STATES]

    @property
    def protected(self) -> bool:
        return any(a.protected for a in self.attempts)

    @property
    def node_hours(self) -> float:
        return sum(a.node_hours for a in self.attempts)


@dataclass
class Costs:
    """The sums of one group (user, account, partition), one week, or the whole period."""

    jobs: int = 0
    node_hours: float = 0.0
    gpu_hours: float = 0.0
    timeout_jobs: int = 0
    timeout_node_hours: float = 0.0
    timeout_gpu_hours: float = 0.0
    timeout_overshoot_node_hours: float = 0.0
    resubmitted_jobs: int = 0
    resubmit_redone_node_hours: float = 0.0
    mem_measured_jobs: int = 0
    mem_requested_bytes: int = 0
    mem_peak_bytes: int = 0
    mem_overrequest_jobs: int = 0
    mem_blocked_node_hours: float = 0.0
    preempted_jobs: int = 0
    preempt_redone_node_hours: float = 0.0
    protected_jobs: int = 0
    kept_node_hours: float = 0.0
    # What protecting them cost (stasis.slurm.payoff): checkpoints of protected jobs (one per
    # interruption, plus the periodic ones at auto's interval), x frozen seconds x nodes.
    checkpoints: int = 0
    spent_node_hours: float = 0.0

    @property
    def lost_node_hours(self) -> float:
        """Hours of killed work: ended in TIMEOUT, or run again after a preemption."""
        return self.timeout_node_hours + self.preempt_redone_node_hours

    @property
    def net_node_hours(self) -> float:
        """Kept by restores less spent checkpointing."""
        return self.kept_node_hours - self.spent_node_hours

    def add(self, other: "Costs") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, float | int]:
        return {
            **asdict(self),
            "lost_node_hours": self.lost_node_hours,
            "net_node_hours": self.net_node_hours,
        }


GROUP_COLUMNS = ("user", "account", "partition", *Costs().as_dict())


@dataclass
class Partition:
    """A partition's interruption rate over the period and the interval `STASIS_INTERVAL=auto`
    would choose for its typical job (stasis.slurm.payoff fills it)."""

    partition: str
    interruptions: int
    node_hours: float
    rate_per_node_hour: float
    cost_s: float  # one checkpoint's frozen seconds used
    cost_source: str  # "measured: median of N jobs" or "default (--checkpoint-cost-s)"
    nodes: int  # the typical job's nodes (median over the partition's jobs)
    mtbi_s: float | None
    interval_s: float
    bound: str
    why: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Report:
    since: datetime
    until: datetime
    window_s: int
    totals: Costs = field(default_factory=Costs)
    groups: dict[tuple[str, str, str], Costs] = field(default_factory=dict)
    weeks: dict[str, Costs] = field(default_factory=dict)
    partitions: dict[str, Partition] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "since": self.since.isoformat(timespec="seconds"),
            "until": self.until.isoformat(timespec="seconds"),
            "window_h": self.window_s / 3600,
            "totals": self.totals.as_dict(),
            "groups": self.group_rows(),
            "weeks": [{"week": w, **c.as_dict()} for w, c in sorted(self.weeks.items())],
            "partitions": [p.as_dict() for _, p in sorted(self.partitions.items())],
            "accounts": self.account_rows(),
        }

    def accounts(self) -> list[tuple[str, str, Costs, Partition | None]]:
        """Per (account, partition), sorted: its sums and its partition's rate and interval."""
        merged: dict[tuple[str, str], Costs] = defaultdict(Costs)
        for (_, a, p), c in self.groups.items():
            merged[(a, p)].add(c)
        return [(a, p, c, self.partitions.get(p)) for (a, p), c in sorted(merged.items())]

    def account_rows(self) -> list[dict[str, object]]:
        """Per (account, partition): its partition's rate and auto's interval, and for its
        protected jobs node-hours kept against node-hours spent checkpointing, on one line."""
        return [
            {
                "account": a,
                "partition": p,
                "jobs": c.jobs,
                "interruptions": part.interruptions if part else 0,
                "rate_per_node_hour": part.rate_per_node_hour if part else 0.0,
                "cost_s": part.cost_s if part else None,
                "interval_s": part.interval_s if part else None,
                "protected_jobs": c.protected_jobs,
                "kept_node_hours": c.kept_node_hours,
                "checkpoints": c.checkpoints,
                "spent_node_hours": c.spent_node_hours,
                "net_node_hours": c.net_node_hours,
            }
            for a, p, c, part in self.accounts()
        ]

    def group_rows(self) -> list[dict[str, str | float | int]]:
        """One flat row per (user, account, partition), sorted: GROUP_COLUMNS."""
        return [
            {"user": u, "account": a, "partition": p, **c.as_dict()}
            for (u, a, p), c in sorted(self.groups.items())
        ]

    def top(self, key: str, n: int = 10) -> list[tuple[str, Costs]]:
        """Users or partitions (`key`), by lost node-hours, then node-hours."""
        index = {"user": 0, "account": 1, "partition": 2}[key]
        merged: dict[str, Costs] = defaultdict(Costs)
        for k, c in self.groups.items():
            merged[k[index]].add(c)
        ranked = sorted(
            merged.items(), key=lambda kv: (-kv[1].lost_node_hours, -kv[1].node_hours, kv[0])
        )
        return ranked[:n]


# -- dates -----------------------------------------------------------------------------------


def parse_date(text: str, what: str) -> datetime:
    """YYYY-MM-DD (midnight) or an ISO datetime; one with a zone becomes local time, as sacct
    prints and reads times in the local zone."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"{what} {text!r} is not a date (YYYY-MM-DD or an ISO datetime such "
            "as 2024-05-01T08:00)"
        ) from None
    if value.tzinfo is not None:
        value = value.astimezone().replace(tzinfo=None)
    return value


def period(
    since: str | None, until: str | None, now: datetime | None = None, default_days: int = 30
) -> tuple[datetime, datetime]:
    """The report's [since, until): by default the last `default_days` days up to now."""
    now = (now or datetime.now()).replace(microsecond=0)
    end = parse_date(until, "--until") if until else now
    start = (
        parse_date(since, "--since")
        if since
        else datetime.combine((end - timedelta(days=default_days)).date(), datetime.min.time())
    )
    if end <= start:
        raise UsageError(
            f"--until {end.isoformat(sep=' ')} is not after --since " f"{start.isoformat(sep=' ')}"
        )
    return start, end


def week_of(day: date) -> str:
    year, week, _ = day.isocalendar()
    return f"{year}-W{week:02d}"


# -- parsing ---------------------------------------------------------------------------------


def _time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None  # Unknown, None: not started or not ended


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def size_bytes(text: str, ncpus: int = 1, nnodes: int = 1) -> int | None:
    """A Slurm size (`--noconvert`: bytes, or with a K/M/G/T unit; ReqMem of older releases
    ends in n (per node) or c (per CPU)); None when empty or unreadable."""
    m = _SIZE.match(text.strip())
    if not m:
        return None
    value = float(m.group(1)) * _UNITS[m.group(2)]
    per = {"n": nnodes, "c": ncpus}.get(m.group(3), 1)
    return int(value * per)


def tres(text: str) -> dict[str, str]:
    """`cpu=4,mem=400M,gres/gpu=2` as a dict."""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def parse_sacct(text: str) -> list[Record]:
    """sacct's `-n -P --noconvert --delimiter=SEP -o FIELDS` output as job records (steps folded
    into the record before them)."""
    records: list[Record] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(SEP)
        if len(parts) < len(FIELDS):
            raise SlurmError(
                f"sacct printed a line with {len(parts)} fields, expected "
                f"{len(FIELDS)}: {line[:200]!r}"
            )
        # The last field (AdminComment) may hold the separator itself: join what is left.
        row = dict(zip(FIELDS, parts[: len(FIELDS) - 1]))
        row[FIELDS[-1]] = SEP.join(parts[len(FIELDS) - 1 :])
        job_id = row["JobIDRaw"]
        if "." in job_id:
            if records and job_id.split(".", 1)[0] == records[-1].job_id:
                _fold_step(records[-1], row)
            continue
        alloc = tres(row["AllocTRES"])
        nnodes = _int(row["NNodes"], 1)
        ncpus = _int(alloc.get("cpu", "1"), 1)
        req = size_bytes(row["ReqMem"], ncpus, nnodes)
        if req is None and "mem" in alloc:
            req = size_bytes(alloc["mem"])
        limit = row["TimelimitRaw"]
        records.append(
            Record(
                job_id=job_id,
                user=row["User"],
                account=row["Account"],
                partition=row["Partition"],
                name=row["JobName"],
                workdir=row["WorkDir"],
                state=(row["State"].split() or [""])[0],
                submit=_time(row["Submit"]),
                start=_time(row["Start"]),
                end=_time(row["End"]),
                elapsed_s=_int(row["ElapsedRaw"]),
                timelimit_min=int(limit) if limit.isdigit() else None,
                nnodes=nnodes,
                gpus=_int(alloc.get("gres/gpu", "0")),
                req_mem_bytes=req or None,
                peak_mem_bytes=None,
                protected=PROTECTED_MARK in row["AdminComment"],
            )
        )
    return records


def _fold_step(record: Record, row: dict[str, str]) -> None:
    peak = size_bytes(tres(row["TRESUsageInTot"]).get("mem", ""))
    if peak is None:
        peak = size_bytes(row["MaxRSS"])
    if peak:
        record.peak_mem_bytes = max(record.peak_mem_bytes or 0, peak)


def jobs(records: Iterable[Record]) -> list[Job]:
    """Records grouped into jobs: a record continues the one before it with the same job id,
    user and name when that one ended in a requeue state (else the id was reused: job ids
    restart when slurmctld starts clean)."""
    by_id: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_id[r.job_id].append(r)
    out: list[Job] = []
    for recs in by_id.values():
        recs.sort(key=lambda r: (r.submit or datetime.min, r.start or datetime.min))
        current: Job | None = None
        for r in recs:
            prev = current.last if current else None
            if (
                current
                and prev
                and prev.state in REQUEUE_STATES
                and (prev.user, prev.name) == (r.user, r.name)
            ):
                current.attempts.append(r)
            else:
                current = Job([r])
                out.append(current)
    return out


# -- sums ------------------------------------------------------------------------------------


def resubmissions(all_jobs: Sequence[Job], window_s: int) -> dict[int, tuple[Job, Job]]:
    """{id(resubmission): (timed-out job, resubmission)}: each TIMEOUT job's first later job of
    the same (User, JobName, WorkDir) that started within `window_s` of its end."""
    groups: dict[tuple[str, str, str], list[Job]] = defaultdict(list)
    for j in all_jobs:
        if j.attempts[0].start is not None:
            groups[(j.last.user, j.last.name, j.last.workdir)].append(j)
    found: dict[int, tuple[Job, Job]] = {}
    for members in groups.values():
        members.sort(key=lambda j: j.attempts[0].start or datetime.min)
        for t in members:
            if t.last.state != "TIMEOUT" or t.last.end is None:
                continue
            ended = t.last.end
            for later in members:
                began = later.attempts[0].start
                if later is t or id(later) in found or began is None:
                    continue
                if ended <= began <= ended + timedelta(seconds=window_s):
                    found[id(later)] = (t, later)
                    break
    return found


def job_costs(job: Job, resubmit_of: Job | None) -> Costs:
    """One job's contribution."""
    c = Costs(jobs=1)
    last = job.last
    for a in job.attempts:
        c.node_hours += a.node_hours
        c.gpu_hours += a.gpu_hours
    if last.state == "TIMEOUT":
        c.timeout_jobs = 1
        c.timeout_node_hours = last.node_hours
        c.timeout_gpu_hours = last.gpu_hours
        if last.timelimit_min is not None:
            over_s = max(0, last.elapsed_s - 60 * last.timelimit_min)
            c.timeout_overshoot_node_hours = last.nnodes * over_s / 3600
    if resubmit_of is not None:
        c.resubmitted_jobs = 1
        c.resubmit_redone_node_hours = min(job.node_hours, resubmit_of.last.node_hours)
    measured = [a for a in job.attempts if a.req_mem_bytes and a.peak_mem_bytes]
    if measured:
        c.mem_measured_jobs = 1
        over = False
        for a in measured:
            req, peak = a.req_mem_bytes or 0, a.peak_mem_bytes or 0
            c.mem_requested_bytes += req
            c.mem_peak_bytes += peak
            if peak * OVER_REQUEST_FACTOR < req:
                over = True
                c.mem_blocked_node_hours += a.node_hours * (req - peak) / req
        c.mem_overrequest_jobs = int(over)
    interrupted = job.interrupted
    if interrupted or last.state == "PREEMPTED":
        c.preempted_jobs = 1
    if interrupted:
        hours = sum(a.node_hours for a in interrupted)
        if job.protected:
            c.protected_jobs = 1
            c.kept_node_hours = hours
        else:
            c.preempt_redone_node_hours = hours
    return c


def compute(
    records: Iterable[Record], since: datetime, until: datetime, window_s: int = 24 * 3600
) -> Report:
    """The report of the jobs whose last record ended in [since, until). `records` may reach
    back before `since` (the TIMEOUT jobs a resubmission in the period follows)."""
    report = Report(since=since, until=until, window_s=window_s)
    all_jobs = jobs(records)
    resubmitted = resubmissions(all_jobs, window_s)
    for job in all_jobs:
        end = job.last.end
        if end is None or not since <= end < until:
            continue
        pair = resubmitted.get(id(job))
        c = job_costs(job, pair[0] if pair else None)
        last = job.last
        report.totals.add(c)
        report.groups.setdefault((last.user, last.account, last.partition), Costs()).add(c)
        report.weeks.setdefault(week_of(end.date()), Costs()).add(c)
    return report


# -- sacct -----------------------------------------------------------------------------------


def sacct_args(since: datetime, until: datetime) -> list[str]:
    fmt = "%Y-%m-%dT%H:%M:%S"
    return [
        "sacct",
        "-a",
        "-D",
        "-n",
        "-P",
        "--noconvert",
        f"--delimiter={SEP}",
        "-S",
        since.strftime(fmt),
        "-E",
        until.strftime(fmt),
        "-o",
        ",".join(FIELDS),
    ]


def query(since: datetime, until: datetime) -> str:
    """sacct's records of [since, until) (SLURM_CONF picks the cluster)."""
    args = sacct_args(since, until)
    try:
        result = subprocess.run(
            args, capture_output=True, text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as e:
        raise SlurmError("sacct is not installed (Slurm's client tools)") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(
            f"sacct did not answer in {_TIMEOUT_S} s (slurmdbd busy or " "unreachable?)"
        ) from e
    if result.returncode != 0:
        lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {result.returncode}"
        why = re.sub(r"^sacct: (error: |fatal: )?", "", why)
        raise SlurmError(f"cannot read Slurm's accounting (sacct): {why}")
    return result.stdout


def report(since: datetime, until: datetime, window_s: int = 24 * 3600) -> Report:
    """Ask sacct and sum; TIMEOUT jobs up to `window_s` before `since` are read too."""
    text = query(since - timedelta(seconds=window_s), until)
    return compute(parse_sacct(text), since, until, window_s)
