"""Whether checkpointing pays, per partition: the interruption rate `stasis slurm report` used,
the interval `STASIS_INTERVAL=auto` would choose for the partition's typical job, and for the
jobs stasis protected the node-hours spent checkpointing them, against the node-hours kept.

- Rates: stasis.slurm.interruptions over the report's period (the records it read).
- A checkpoint's cost: the median of the frozen seconds measured for the partition's jobs
  (`measured`: what the node daemon last measured per running job, `stasis slurm intervals`);
  none measured: a stated default (`--checkpoint-cost-s`). Frozen times of ended jobs are kept
  nowhere the report can read (not in sacct, not in the manifests), so the cost is the same for
  every job of a partition.
- The typical job: the median nodes of the partition's jobs; auto's interval for it is
  stasis.interval.choose within the site's floor and ceiling.
- Spent: per protected job (`stasis-token=` in its AdminComment), one checkpoint per
  interrupted attempt (the one it was restored from) plus the periodic ones auto's interval
  would take in each attempt's run, each costing cost x the attempt's nodes. sacct does not
  say which jobs asked for periodic checkpoints: counting them for every protected job makes
  the spent side an upper bound (a job without STASIS_INTERVAL spends less).

Pure functions over report.Record; `apply` adds the result to a report.Report.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from stasis.interval import choose, mtbi_s
from stasis.slurm import interruptions
from stasis.slurm.report import (
    Costs,
    Job,
    Partition,
    Record,
    Report,
    compute,
    jobs,
    parse_sacct,
    query,
    week_of,
)

# What one checkpoint costs a job (seconds frozen) when none was measured: about 4 s per GB of
# resident memory on this project's machines (notes/slurm.md), for a job of a few GB.
DEFAULT_COST_S = 10.0


@dataclass(frozen=True)
class Model:
    """What the report assumes of checkpoints: measured costs per partition, else the default,
    and the site's floor and ceiling of auto's interval (config interval_min_s, interval_max_s)."""

    floor_s: float = 300.0
    ceiling_s: float = 86400.0
    default_cost_s: float = DEFAULT_COST_S
    measured: Mapping[str, Sequence[float]] = field(default_factory=dict)


def partitions(
    records: Sequence[Record], since: datetime, until: datetime, model: Model
) -> dict[str, Partition]:
    """Per partition with records: its rate over [since, until) and auto's interval for its
    typical job."""
    rates = interruptions.rates(records, since, until)
    sizes: dict[str, list[int]] = defaultdict(list)
    for r in records:
        if r.partition and r.start is not None:
            sizes[r.partition].append(max(1, r.nnodes))
    out: dict[str, Partition] = {}
    for name, rate in sorted(rates.items()):
        costs = [c for c in model.measured.get(name, ()) if c > 0]
        if costs:
            cost = statistics.median(costs)
            source = f"measured: median of {len(costs)} job(s)"
        else:
            cost, source = model.default_cost_s, "default (--checkpoint-cost-s)"
        nodes = int(statistics.median_low(sizes[name])) if sizes[name] else 1
        mtbi = mtbi_s(rate.rate_per_node_hour, nodes)
        choice = choose(cost, mtbi, model.floor_s, model.ceiling_s)
        why = choice.why()
        if rate.interruptions:
            why += (
                f"; {rate.interruptions} interruption(s) in {rate.node_hours:.2f} "
                f"node-hours, a job of {nodes} node(s)"
            )
        out[name] = Partition(
            partition=name,
            interruptions=rate.interruptions,
            node_hours=rate.node_hours,
            rate_per_node_hour=rate.rate_per_node_hour,
            cost_s=cost,
            cost_source=source,
            nodes=nodes,
            mtbi_s=choice.mtbi_s,
            interval_s=choice.interval_s,
            bound=choice.bound,
            why=why,
        )
    return out


def checkpoints_of(job: Job, interval_s: float) -> int:
    """The checkpoints a protected job took, as counted here: one per interrupted attempt (the
    one it resumed from), and one per `interval_s` of each attempt's run."""
    periodic = 0
    if interval_s > 0 and math.isfinite(interval_s):
        periodic = sum(int(a.elapsed_s // interval_s) for a in job.attempts)
    return len(job.interrupted) + periodic


def spent(job: Job, part: Partition) -> Costs:
    """A protected job's checkpoints and the node-hours they held it frozen."""
    if not job.protected:
        return Costs()
    n = checkpoints_of(job, part.interval_s)
    nodes = max(1, job.last.nnodes)
    return Costs(checkpoints=n, spent_node_hours=n * part.cost_s * nodes / 3600)


def apply(report: Report, records: Iterable[Record], model: Model) -> Report:
    """`report` (report.compute of the same records) with its partitions' rates and intervals,
    and the checkpoints its protected jobs spent added to its totals, groups and weeks."""
    recs = list(records)
    report.partitions = partitions(recs, report.since, report.until, model)
    for job in jobs(recs):
        last = job.last
        end = last.end
        if end is None or not report.since <= end < report.until or not job.protected:
            continue
        part = report.partitions.get(last.partition)
        if part is None:
            continue
        c = spent(job, part)
        report.totals.add(c)
        report.groups.setdefault((last.user, last.account, last.partition), Costs()).add(c)
        report.weeks.setdefault(week_of(end.date()), Costs()).add(c)
    return report


def read(since: datetime, until: datetime, window_s: int, model: Model) -> Report:
    """`stasis slurm report`'s numbers: sacct asked once (TIMEOUT jobs up to `window_s` before
    `since` too), summed, and the partitions' rates, intervals and checkpoints spent added."""
    records = parse_sacct(query(since - timedelta(seconds=window_s), until))
    return apply(compute(records, since, until, window_s), records, model)
