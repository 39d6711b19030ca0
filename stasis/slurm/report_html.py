"""`stasis slurm report --html FILE`: the report as one self-contained page a manager can read.

Where the hours went, the top users and partitions, and the trend by week, as inline SVG bar
charts drawn here (no script, nothing fetched from the net), then the table per user, account and
partition, the interruption rates and auto's interval per partition, and kept against spent per
account and partition. Every name from sacct goes through Jinja2's autoescaping.

Its pieces (STYLE, `hours`, `seconds`, `bar_chart`, `trend`) draw `stasis slurm poc report
--html` too (stasis.slurm.poc_html), so that both look alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from jinja2 import Environment
from markupsafe import Markup

from stasis.interval import duration
from stasis.slurm.report import Costs, Report, week_of

# (Costs attribute or property, label, colour)
CATEGORIES = (
    ("timeout_node_hours", "Killed at the time limit (TIMEOUT)", "#d1495b"),
    ("resubmit_redone_node_hours", "Redone by resubmissions after a TIMEOUT", "#edae49"),
    ("preempt_redone_node_hours", "Redone after a preemption or requeue", "#8d6a9f"),
    ("mem_blocked_node_hours", "Blocked by memory over-request", "#00798c"),
    ("kept_node_hours", "Kept by stasis restores (not rerun)", "#30a14e"),
    ("spent_node_hours", "Spent checkpointing (frozen)", "#6c757d"),
)
W = TypeVar("W")
_BAR_W = 360
_LABEL_W = 260


@dataclass
class Bar:
    label: str
    value: float
    width: float
    colour: str
    y: float


@dataclass
class Column:
    x: float
    y: float
    height: float
    colour: str
    title: str


def hours(value: float) -> str:
    """Node-hours as a person reads them: few digits, small values still visible."""
    if value == 0:
        return "0"
    if value < 0.01:
        return f"{value:.4f}"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:,.0f}"


# A duration as a person reads it.
seconds = duration


def _bars(items: list[tuple[str, float, str]]) -> list[Bar]:
    top = max((v for _, v, _ in items), default=0.0) or 1.0
    return [
        Bar(label, value, max(1.0 if value else 0.0, _BAR_W * value / top), colour, 24 * i)
        for i, (label, value, colour) in enumerate(items)
    ]


def _weeks(report: Report) -> list[tuple[str, Costs]]:
    """Every week of the period, those without jobs too (a gap is news)."""
    return all_weeks(report.since, report.until, report.weeks, Costs)


def all_weeks(
    since: datetime, until: datetime, found: dict[str, W], empty: Callable[[], W]
) -> list[tuple[str, W]]:
    """Every ISO week of [since, until) with its value in `found` (`empty()` where none), and
    any week of `found` outside it, sorted."""
    out: list[tuple[str, W]] = []
    day = since.date()
    last = (until - timedelta(seconds=1)).date()
    seen: set[str] = set()
    while day <= last:
        w = week_of(day)
        if w not in seen:
            seen.add(w)
            out.append((w, found.get(w) or empty()))
        day += timedelta(days=1)
    for w, c in sorted(found.items()):
        if w not in seen:
            out.append((w, c))
    return sorted(out, key=lambda wc: wc[0])


def _trend(
    weeks: Sequence[tuple[str, Any]],
    categories: Sequence[tuple[str, str, str]] = CATEGORIES,
) -> tuple[list[Column], float, int]:
    """Grouped columns, one group per week, one column per category (an attribute of each
    week's value); the scale's top, the width."""
    top = max((getattr(c, attr) for _, c in weeks for attr, _, _ in categories), default=0.0)
    scale = top or 1.0
    cols: list[Column] = []
    group_w = 14 * len(categories) + 16
    for i, (week, c) in enumerate(weeks):
        for j, (attr, label, colour) in enumerate(categories):
            value = float(getattr(c, attr))
            h = 150 * value / scale
            cols.append(
                Column(
                    x=50 + i * group_w + j * 14,
                    y=170 - h,
                    height=h,
                    colour=colour,
                    title=f"{week}: {label}: {hours(value)}",
                )
            )
    return cols, top, 50 + len(weeks) * group_w + 10


STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 80em; padding: 0 1em; color: #222; }
.wide { overflow-x: auto; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
.cards { display: flex; flex-wrap: wrap; gap: 1em; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: .7em 1em; min-width: 11em; }
.card strong { display: block; font-size: 1.6em; }
table { border-collapse: collapse; font-size: .85em; }
th, td { padding: .25em .45em; border-bottom: 1px solid #eee; text-align: right; }
th:nth-child(-n+3), td:nth-child(-n+3) { text-align: left; }
.note { color: #555; font-size: .9em; max-width: 60em; }
svg text { font-size: 12px; fill: #222; }
table.figures th:nth-child(n+2), table.figures td:nth-child(n+2) { text-align: right; }
.pass { color: #30a14e; font-weight: bold; } .fail { color: #d1495b; font-weight: bold; }
</style>"""

_TREND = """<div class="wide"><svg id="{{ id }}" width="{{ trend_w }}" height="200" role="img" aria-label="{{ label }}">
<line x1="48" y1="170" x2="{{ trend_w - 10 }}" y2="170" stroke="#888"/>
<text x="0" y="24">{{ h(trend_top) }}</text><text x="0" y="170">0</text>
{% for c in trend %}<rect x="{{ c.x }}" y="{{ '%.1f' % c.y }}" width="12" height="{{ '%.1f' % c.height }}" fill="{{ c.colour }}"><title>{{ c.title }}</title></rect>
{% endfor %}{% for w in weeks %}<text x="{{ 50 + loop.index0 * group_w }}" y="188">{{ w }}</text>
{% endfor %}</svg></div>
<p class="note">{% for attr, label, colour in categories %}<span style="color: {{ colour }}">&#9632;</span> {{ label }} &nbsp; {% endfor %}</p>"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>What time limits cost: {{ since }} to {{ until }}</title>
{{ style }}</head><body>
<h1>What time limits cost on Slurm: {{ since }} to {{ until }}</h1>
<p class="note">From Slurm's accounting (sacct), {{ totals.jobs }} jobs that ended in the period.
Node-hours are nodes &times; elapsed hours.</p>
<div class="cards" id="cards">
<div class="card"><strong>{{ h(totals.node_hours) }}</strong>node-hours used</div>
<div class="card"><strong>{{ h(totals.timeout_node_hours) }}</strong>node-hours in {{ totals.timeout_jobs }} job(s) killed at the time limit</div>
<div class="card"><strong>{{ h(totals.resubmit_redone_node_hours) }}</strong>node-hours redone by {{ totals.resubmitted_jobs }} resubmission(s)</div>
<div class="card"><strong>{{ h(totals.preempt_redone_node_hours) }}</strong>node-hours redone after {{ totals.preempted_jobs - totals.protected_jobs }} unprotected preemption(s)</div>
<div class="card"><strong>{{ h(totals.mem_blocked_node_hours) }}</strong>node-hours blocked by {{ totals.mem_overrequest_jobs }} memory over-request(s)</div>
<div class="card"><strong>{{ h(totals.kept_node_hours) }}</strong>node-hours kept by stasis for {{ totals.protected_jobs }} job(s)</div>
<div class="card"><strong>{{ h(totals.spent_node_hours) }}</strong>node-hours spent in {{ totals.checkpoints }} checkpoint(s); net kept {{ h(totals.net_node_hours) }}</div>
</div>

<h2>Where the hours went</h2>
{{ bar_chart(where, "where", "node-hours by cause") }}

<h2>Top users (node-hours lost to time limits and preemptions)</h2>
{{ bar_chart(users, "users", "top users") }}

<h2>Top partitions</h2>
{{ bar_chart(partitions, "partitions", "top partitions") }}

<h2>Trend by week</h2>
{{ trend_chart }}

<h2>Per user, account and partition</h2>
<div class="wide"><table id="groups"><tr><th>User</th><th>Account</th><th>Partition</th><th>Jobs</th><th>Node-hours</th>
<th>TIMEOUT jobs</th><th>TIMEOUT node-h</th><th>TIMEOUT GPU-h</th><th>Resubmitted</th><th>Redone node-h</th>
<th>Mem. over-requests</th><th>Blocked node-h</th><th>Preempted</th><th>Redone node-h</th><th>Kept node-h</th></tr>
{% for g in groups %}<tr><td>{{ g.user }}</td><td>{{ g.account }}</td><td>{{ g.partition }}</td>
<td>{{ g.jobs }}</td><td>{{ h(g.node_hours) }}</td><td>{{ g.timeout_jobs }}</td><td>{{ h(g.timeout_node_hours) }}</td>
<td>{{ h(g.timeout_gpu_hours) }}</td><td>{{ g.resubmitted_jobs }}</td><td>{{ h(g.resubmit_redone_node_hours) }}</td>
<td>{{ g.mem_overrequest_jobs }}</td><td>{{ h(g.mem_blocked_node_hours) }}</td><td>{{ g.preempted_jobs }}</td>
<td>{{ h(g.preempt_redone_node_hours) }}</td><td>{{ h(g.kept_node_hours) }}</td></tr>
{% else %}<tr><td colspan="15">No job ended in this period.</td></tr>{% endfor %}
</table></div>

<h2>Interruptions and STASIS_INTERVAL=auto per partition</h2>
<div class="wide"><table id="partitions-auto"><tr><th>Partition</th><th>Interruptions</th><th>Node-hours</th><th>Per node-hour</th>
<th>Typical nodes</th><th>Checkpoint cost</th><th>Cost from</th><th>auto's interval</th><th>Why</th></tr>
{% for p in partitions_auto %}<tr><td>{{ p.partition }}</td><td>{{ p.interruptions }}</td><td>{{ h(p.node_hours) }}</td>
<td>{{ '%.4g' % p.rate_per_node_hour }}</td><td>{{ p.nodes }}</td><td>{{ s(p.cost_s) }}</td><td>{{ p.cost_source }}</td>
<td>{{ s(p.interval_s) }}</td><td style="text-align: left">{{ p.why }}</td></tr>
{% else %}<tr><td colspan="9">No job ran in this period.</td></tr>{% endfor %}
</table></div>

<h2>Protected jobs: node-hours kept against node-hours spent checkpointing</h2>
<div class="wide"><table id="net"><tr><th>Account</th><th>Partition</th><th>Jobs</th><th>Per node-hour</th><th>auto's interval</th>
<th>Restored jobs</th><th>Kept node-h</th><th>Checkpoints</th><th>Spent node-h</th><th>Net node-h</th></tr>
{% for a, p, c, part in accounts %}<tr><td>{{ a }}</td><td>{{ p }}</td><td>{{ c.jobs }}</td>
<td>{{ '%.4g' % part.rate_per_node_hour if part else '-' }}</td><td>{{ s(part.interval_s) if part else '-' }}</td>
<td>{{ c.protected_jobs }}</td><td>{{ h(c.kept_node_hours) }}</td><td>{{ c.checkpoints }}</td>
<td>{{ h(c.spent_node_hours) }}</td><td>{{ h(c.net_node_hours) }}</td></tr>
{% else %}<tr><td colspan="10">No job ended in this period.</td></tr>{% endfor %}
</table></div>

<h2>How these are counted</h2>
<ul class="note">
<li>Killed at the time limit: jobs whose last record is TIMEOUT; all of their node-hours (a kill
proves the limit was hit, not that all of the work was lost; {{ h(totals.timeout_overshoot_node_hours) }}
node-hours ran past the limit before the kill).</li>
<li>Redone by resubmissions: a later job of the same user, job name and directory starting within
{{ window_h }} h after a TIMEOUT; it redoes at most what the killed job ran.</li>
<li>Memory over-request: a job whose peak memory (sampled) stayed under half of what it
requested; its node-hours times the unused share of its request.</li>
<li>Preemptions and requeues: the earlier attempts of a requeued job. A job stasis does not
protect starts over (redone); a stasis-protected job was restored from its checkpoint, so its
earlier attempts' node-hours are kept.</li>
<li>Interruptions: records that ended PREEMPTED, NODE_FAIL or REQUEUED in the period, per
node-hour run there (a TIMEOUT is none: the time-limit checkpoint covers it). auto's interval is
Young/Daly's from that rate and a checkpoint's cost (the median frozen time measured on this
node for the partition's jobs, else the stated default), within the site's floor and ceiling.</li>
<li>Spent: for each protected job, one checkpoint per interruption and one per auto interval of
its run, each holding its nodes frozen for the cost; an upper bound for jobs that asked for no
periodic checkpoint.</li>
</ul>
<p class="note">Made by <code>stasis slurm report</code> on {{ made }}.</p>
</body></html>
"""

_CHART = """<svg id="{{ id }}" width="{{ width }}" height="{{ 24 * bars|length + 8 }}" role="img" aria-label="{{ label }}">
{% for b in bars %}<text x="0" y="{{ b.y + 16 }}">{{ b.label }}</text>
<rect x="{{ label_w }}" y="{{ b.y + 4 }}" width="{{ '%.1f' % b.width }}" height="16" fill="{{ b.colour }}"><title>{{ b.label }}: {{ h(b.value) }} node-hours</title></rect>
<text x="{{ label_w + b.width + 6 }}" y="{{ b.y + 16 }}">{{ h(b.value) }}</text>
{% else %}<text x="0" y="16">No job ended in this period.</text>{% endfor %}
</svg>"""


def bar_charts(env: Environment) -> Callable[[list[Bar], str, str], Markup]:
    """A function drawing horizontal bars (`_bars`) as an SVG with an id and a label."""
    chart = env.from_string(_CHART)

    def bar_chart(bars: list[Bar], id: str, label: str) -> Markup:
        return Markup(
            chart.render(
                bars=bars,
                id=id,
                label=label,
                h=hours,
                width=_LABEL_W + _BAR_W + 90,
                label_w=_LABEL_W,
            )
        )

    return bar_chart


def trend_chart(
    env: Environment,
    weeks: Sequence[tuple[str, Any]],
    categories: Sequence[tuple[str, str, str]],
    id: str,
    label: str,
) -> Markup:
    """Grouped columns per week (`_trend`) as an SVG, with its legend."""
    cols, top, width = _trend(weeks, categories)
    return Markup(
        env.from_string(_TREND).render(
            id=id,
            label=label,
            trend=cols,
            trend_top=top,
            trend_w=width,
            weeks=[w for w, _ in weeks],
            group_w=14 * len(categories) + 16,
            categories=categories,
            h=hours,
        )
    )


def render(report: Report, now: datetime | None = None) -> str:
    """The page, as text."""
    env = Environment(autoescape=True)
    bar_chart = bar_charts(env)

    totals = report.totals
    where = _bars(
        [(label, float(getattr(totals, attr)), colour) for attr, label, colour in CATEGORIES]
    )
    users = _bars(
        [(u, c.lost_node_hours, "#d1495b") for u, c in report.top("user") if c.lost_node_hours]
    )
    partitions = _bars(
        [(p, c.lost_node_hours, "#8d6a9f") for p, c in report.top("partition") if c.lost_node_hours]
    )
    weeks = _weeks(report)
    data = report.as_dict()
    return env.from_string(_PAGE).render(
        style=Markup(STYLE),
        s=seconds,
        partitions_auto=[p for _, p in sorted(report.partitions.items())],
        accounts=report.accounts(),
        trend_chart=trend_chart(env, weeks, CATEGORIES, "trend", "node-hours by cause per week"),
        since=report.since.isoformat(sep=" ", timespec="minutes"),
        until=report.until.isoformat(sep=" ", timespec="minutes"),
        totals=totals,
        h=hours,
        bar_chart=bar_chart,
        where=where,
        users=users,
        partitions=partitions,
        groups=data["groups"],
        window_h=f"{report.window_s / 3600:g}",
        made=(now or datetime.now()).isoformat(sep=" ", timespec="seconds"),
    )
