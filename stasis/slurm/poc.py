"""The 90-day proof of concept as a site runs it (`stasis slurm poc start|status|report`).

`start` measures a baseline from Slurm's accounting before the start (the opted-in set's jobs
that ended in the `baseline_days` before it) and keeps it, with the opted-in set (users,
accounts or partitions: a job is in the set when its user, account or partition is named) and
the agreed thresholds, in one file (State, JSON): by default <state_dir>/slurm-poc.json, root's,
beside the node daemon's state, mode 644 (it holds no secret; anyone may read the results).
`report` measures the same since the start, for two sets of jobs:

    protected     jobs of the set that stasis protected (`stasis-token=` in their AdminComment)
    unprotected   every other job that ended since the start (the set's unprotected ones and
                  the rest of the cluster: the comparison group)

Measures (Measures), each over the jobs that ended in the period, all of their attempts:
TIMEOUT jobs and their node-hours, preempted or requeued jobs, resubmissions after a TIMEOUT,
node-hours redone (resubmissions and reruns after a preemption), memory over-requests, node-hours
kept by restores and spent checkpointing (stasis.slurm.payoff), exceptions (a last record that
ended FAILED, NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL or DEADLINE), and the medians of completion
time (first submit to last end, requeues included) and queue wait (the sum over a job's attempts
of start - submit: a requeued job waits again).

Thresholds compare the protected jobs with the baseline: median completion time at most
`completion_increase_pct` % longer, median queue wait at most `queue_wait_increase_s` longer,
share of exceptions at most `exceptions_increase_pct` points higher. A threshold without jobs on
either side is not decided ("no data"), never passed.

Pure functions over report.Record, and the state file's reading and writing.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stasis.atomicfile import write_atomically
from stasis.errors import StasisError, UsageError
from stasis.fdio import open_regular
from stasis.slurm import payoff
from stasis.slurm.report import (
    Job,
    Record,
    job_costs,
    jobs,
    parse_sacct,
    query,
    resubmissions,
    week_of,
)

FILE_NAME = "slurm-poc.json"
EXCEPTION_STATES = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
_MAX_BYTES = 1 << 20


class Scope(BaseModel):
    """The opted-in set: a job is in it when its user, account or partition is named."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    users: list[str] = []
    accounts: list[str] = []
    partitions: list[str] = []

    def holds(self, job: Job) -> bool:
        last = job.last
        return (
            last.user in self.users
            or last.account in self.accounts
            or last.partition in self.partitions
        )

    def said(self) -> str:
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (
                ("users", self.users),
                ("accounts", self.accounts),
                ("partitions", self.partitions),
            )
            if names
        ]
        return "; ".join(parts)


class Thresholds(BaseModel):
    """What the site agreed the protected jobs must keep to, against the baseline."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    completion_increase_pct: float = Field(default=10.0, ge=0)
    queue_wait_increase_s: float = Field(default=300.0, ge=0)
    exceptions_increase_pct: float = Field(default=1.0, ge=0)


@dataclass
class Measures:
    """One set of jobs' measures (the module's docstring)."""

    jobs: int = 0
    node_hours: float = 0.0
    timeout_jobs: int = 0
    timeout_node_hours: float = 0.0
    preempted_jobs: int = 0
    resubmitted_jobs: int = 0
    redone_node_hours: float = 0.0
    mem_overrequest_jobs: int = 0
    mem_blocked_node_hours: float = 0.0
    kept_node_hours: float = 0.0
    checkpoints: int = 0
    spent_node_hours: float = 0.0
    exception_jobs: int = 0
    completion_s: list[float] = field(default_factory=list)
    queue_wait_s: list[float] = field(default_factory=list)

    @property
    def median_completion_s(self) -> float | None:
        return statistics.median(self.completion_s) if self.completion_s else None

    @property
    def median_queue_wait_s(self) -> float | None:
        return statistics.median(self.queue_wait_s) if self.queue_wait_s else None

    @property
    def exceptions_pct(self) -> float | None:
        return 100.0 * self.exception_jobs / self.jobs if self.jobs else None

    @property
    def net_node_hours(self) -> float:
        return self.kept_node_hours - self.spent_node_hours

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["completion_s"], out["queue_wait_s"]
        out.update(
            median_completion_s=self.median_completion_s,
            median_queue_wait_s=self.median_queue_wait_s,
            exceptions_pct=self.exceptions_pct,
            net_node_hours=self.net_node_hours,
        )
        return out


class Baseline(BaseModel):
    """A Measures as the state file keeps it (the medians, not every job's value)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    jobs: int
    node_hours: float
    timeout_jobs: int
    timeout_node_hours: float
    preempted_jobs: int
    resubmitted_jobs: int
    redone_node_hours: float
    mem_overrequest_jobs: int
    mem_blocked_node_hours: float
    exception_jobs: int
    median_completion_s: float | None
    median_queue_wait_s: float | None
    exceptions_pct: float | None


class State(BaseModel):
    """The proof of concept under way: what `start` recorded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: int = 1
    started: datetime
    days: int = Field(ge=1, le=3660)
    baseline_since: datetime
    scope: Scope
    thresholds: Thresholds
    window_h: float = Field(gt=0)
    baseline: Baseline
    started_by: str = ""

    @property
    def ends(self) -> datetime:
        return self.started + timedelta(days=self.days)


def _add(m: Measures, job: Job, resubmit_of: Job | None, part: Any) -> None:
    c = job_costs(job, resubmit_of)
    if part is not None:
        c.add(payoff.spent(job, part))
    m.jobs += 1
    m.node_hours += c.node_hours
    m.timeout_jobs += c.timeout_jobs
    m.timeout_node_hours += c.timeout_node_hours
    m.preempted_jobs += c.preempted_jobs
    m.resubmitted_jobs += c.resubmitted_jobs
    m.redone_node_hours += c.resubmit_redone_node_hours + c.preempt_redone_node_hours
    m.mem_overrequest_jobs += c.mem_overrequest_jobs
    m.mem_blocked_node_hours += c.mem_blocked_node_hours
    m.kept_node_hours += c.kept_node_hours
    m.checkpoints += c.checkpoints
    m.spent_node_hours += c.spent_node_hours
    last = job.last
    m.exception_jobs += last.state in EXCEPTION_STATES
    first = job.attempts[0]
    if first.submit is not None and last.end is not None:
        m.completion_s.append((last.end - first.submit).total_seconds())
    waits = [
        (a.start - a.submit).total_seconds()
        for a in job.attempts
        if a.start is not None and a.submit is not None
    ]
    if waits:
        m.queue_wait_s.append(sum(waits))


@dataclass
class Split:
    """The jobs that ended in a period, measured: the set's protected jobs, the others, and
    the same per ISO week."""

    protected: Measures = field(default_factory=Measures)
    unprotected: Measures = field(default_factory=Measures)
    in_scope: Measures = field(default_factory=Measures)  # the set's jobs, protected or not
    weeks: dict[str, tuple[Measures, Measures]] = field(default_factory=dict)
    protected_outside: int = 0  # protected jobs outside the set (counted as protected)


def measure(
    records: Iterable[Record],
    since: datetime,
    until: datetime,
    scope: Scope,
    window_s: int,
    model: payoff.Model,
) -> Split:
    """The jobs whose last record ended in [since, until), measured (`records` may reach back
    `window_s` before `since`: the TIMEOUT jobs a resubmission follows)."""
    recs = list(records)
    parts = payoff.partitions(recs, since, until, model)
    all_jobs = jobs(recs)
    resubmitted = resubmissions(all_jobs, window_s)
    out = Split()
    for job in all_jobs:
        end = job.last.end
        if end is None or not since <= end < until:
            continue
        pair = resubmitted.get(id(job))
        resub = pair[0] if pair else None
        part = parts.get(job.last.partition)
        held = scope.holds(job)
        if held:
            _add(out.in_scope, job, resub, part)
        week = out.weeks.setdefault(week_of(end.date()), (Measures(), Measures()))
        if job.protected:
            out.protected_outside += not held
            _add(out.protected, job, resub, part)
            _add(week[0], job, resub, part)
        else:
            _add(out.unprotected, job, resub, part)
            _add(week[1], job, resub, part)
    return out


def baseline_of(m: Measures) -> Baseline:
    return Baseline.model_validate(m.as_dict())


@dataclass
class Verdict:
    name: str
    limit: str
    baseline: float | None
    protected: float | None
    passed: bool | None  # None: no data on one side
    unit: str = "s"  # "s" or "pct"

    def said(self) -> str:
        return "passed" if self.passed else "no data" if self.passed is None else "FAILED"


def verdicts(state: State, protected: Measures) -> list[Verdict]:
    t, b = state.thresholds, state.baseline
    out: list[Verdict] = []

    def judge(
        name: str, limit: str, base: float | None, now: float | None, most: float, unit: str = "s"
    ) -> None:
        ok = None if base is None or now is None else now <= most
        out.append(Verdict(name, limit, base, now, ok, unit))

    base_c, now_c = b.median_completion_s, protected.median_completion_s
    judge(
        "completion time (median)",
        f"at most {t.completion_increase_pct:g} % over the baseline",
        base_c,
        now_c,
        (base_c or 0) * (1 + t.completion_increase_pct / 100),
    )
    base_q, now_q = b.median_queue_wait_s, protected.median_queue_wait_s
    judge(
        "queue wait (median)",
        f"at most {t.queue_wait_increase_s:g} s over the baseline",
        base_q,
        now_q,
        (base_q or 0) + t.queue_wait_increase_s,
    )
    base_e, now_e = b.exceptions_pct, protected.exceptions_pct
    judge(
        "exceptions (share of jobs)",
        f"at most {t.exceptions_increase_pct:g} points over the baseline",
        base_e,
        now_e,
        (base_e or 0) + t.exceptions_increase_pct,
        "pct",
    )
    return out


def read_records(since: datetime, until: datetime, window_s: int) -> list[Record]:
    return parse_sacct(query(since - timedelta(seconds=window_s), until))


# -- the state file --------------------------------------------------------------------------


def default_path(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


def save(path: Path, state: State, replace: bool) -> None:
    """Written whole (atomically), mode 644; an existing PoC is kept unless `replace`."""
    if not path.parent.is_dir():
        raise UsageError(f"cannot record the PoC in {path}: directory {path.parent} does not exist")
    if not replace:
        refuse_existing(path)
    data = json.dumps(state.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    try:
        write_atomically(path, data.encode(), mode=0o644)
    except PermissionError:
        raise UsageError(
            f"cannot record the PoC in {path}: permission denied (run it as root, "
            "or give --state a file of yours)"
        ) from None
    except OSError as e:
        raise StasisError(f"cannot record the PoC in {path}: {e.strerror}") from e


def refuse_existing(path: Path) -> None:
    if path.exists() or path.is_symlink():
        raise UsageError(
            f"a PoC is already recorded in {path}: `stasis slurm poc report` reads it; "
            "--force starts a new one over it"
        )


def load(path: Path) -> State:
    """The recorded PoC. Root reads only a file of root's (no link followed, not writable by
    others): its numbers decide what a site is told."""
    try:
        fd, st = open_regular(path)
    except FileNotFoundError:
        raise UsageError(
            f"no PoC recorded in {path}: start one with `stasis slurm poc start`"
        ) from None
    except OSError as e:  # NotRegularFile's says "not a regular file"
        raise UsageError(f"cannot read the PoC in {path}: {e.strerror}") from e
    try:
        if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
            raise UsageError(
                f"refusing the PoC in {path}: root reads only a file of root's that no one "
                "else may write; record the PoC as root (`stasis slurm poc start`)"
            )
        raw = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        if len(raw) > _MAX_BYTES:
            raise ValueError("over 1 MiB")
        return State.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"the PoC in {path} is unreadable ({first}): start it again") from None


def days_between(since: datetime, until: datetime) -> float:
    return max(0.0, (until - since).total_seconds() / 86400)


def weeks_sorted(split: Split) -> list[tuple[str, tuple[Measures, Measures]]]:
    return sorted(split.weeks.items())


def shares(m: Measures) -> dict[str, float | None]:
    """Counts per job and node-hours per node-hour used: comparable across periods of
    different lengths."""
    per_job = (lambda n: n / m.jobs) if m.jobs else (lambda n: None)
    per_h = (lambda h: h / m.node_hours) if m.node_hours else (lambda h: None)
    return {
        "timeout_share": per_job(m.timeout_jobs),
        "preempted_share": per_job(m.preempted_jobs),
        "resubmitted_share": per_job(m.resubmitted_jobs),
        "redone_share": per_h(m.redone_node_hours),
    }


def baseline_shares(b: Baseline) -> dict[str, float | None]:
    m = Measures(
        jobs=b.jobs,
        node_hours=b.node_hours,
        timeout_jobs=b.timeout_jobs,
        preempted_jobs=b.preempted_jobs,
        resubmitted_jobs=b.resubmitted_jobs,
        redone_node_hours=b.redone_node_hours,
    )
    return shares(m)


def compare_rows(state: State, split: Split) -> list[dict[str, Any]]:
    """One row per measure: baseline, protected, unprotected."""
    b = state.baseline.model_dump()
    p, u = split.protected.as_dict(), split.unprotected.as_dict()
    names: Sequence[str] = (
        "jobs",
        "node_hours",
        "timeout_jobs",
        "timeout_node_hours",
        "preempted_jobs",
        "resubmitted_jobs",
        "redone_node_hours",
        "mem_overrequest_jobs",
        "mem_blocked_node_hours",
        "exception_jobs",
        "exceptions_pct",
        "median_completion_s",
        "median_queue_wait_s",
    )
    rows = [
        {"measure": n, "baseline": b.get(n), "protected": p[n], "unprotected": u[n]} for n in names
    ]
    bs, ps, us = baseline_shares(state.baseline), shares(split.protected), shares(split.unprotected)
    rows += [
        {"measure": n, "baseline": bs[n], "protected": ps[n], "unprotected": us[n]} for n in bs
    ]
    rows += [
        {"measure": n, "baseline": None, "protected": p[n], "unprotected": u[n]}
        for n in ("kept_node_hours", "checkpoints", "spent_node_hours", "net_node_hours")
    ]
    return rows
