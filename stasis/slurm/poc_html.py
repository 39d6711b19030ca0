"""`stasis slurm poc report --html FILE`: the proof of concept's results as one self-contained page,
drawn with `stasis slurm report`'s pieces (stasis.slurm.report_html: its style, its SVG charts;
no script, nothing fetched from the net). Every name goes through Jinja2's autoescaping."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from stasis.slurm import report_html
from stasis.slurm.poc import Measures, Split, State, Verdict, compare_rows

CATEGORIES = (
    ("unprotected_lost", "Unprotected: lost (TIMEOUT, redone)", "#d1495b"),
    ("protected_lost", "Protected: lost (TIMEOUT, redone)", "#edae49"),
    ("kept", "Protected: kept by restores", "#30a14e"),
    ("spent", "Protected: spent checkpointing", "#6c757d"),
)


@dataclass
class Week:
    unprotected_lost: float = 0.0
    protected_lost: float = 0.0
    kept: float = 0.0
    spent: float = 0.0


def _lost(m: Measures) -> float:
    return m.timeout_node_hours + m.redone_node_hours


def cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name.endswith("_s"):
        return report_html.seconds(float(value))
    if name.endswith("_share"):
        return f"{100 * float(value):.1f} %"
    if name.endswith("_pct"):
        return f"{float(value):.1f} %"
    if isinstance(value, float):
        return report_html.hours(value)
    return str(value)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Checkpointing proof of concept: {{ started }} to {{ until }}</title>
{{ style }}</head><body>
<h1>Checkpointing proof of concept on Slurm: day {{ day }} of {{ state.days }}</h1>
<p class="note">Started {{ started }} for {{ state.scope.said() }}; baseline: the same set's jobs
that ended {{ baseline_since }} to {{ started }}. From Slurm's accounting (sacct), up to {{ until }}.</p>
<div class="cards" id="cards">
<div class="card"><strong>{{ p.jobs }}</strong>protected jobs ended</div>
<div class="card"><strong>{{ u.jobs }}</strong>unprotected jobs ended</div>
<div class="card"><strong>{{ h(p.kept_node_hours) }}</strong>node-hours kept by restores</div>
<div class="card"><strong>{{ h(p.spent_node_hours) }}</strong>node-hours spent in {{ p.checkpoints }} checkpoint(s)</div>
<div class="card"><strong>{{ h(p.net_node_hours) }}</strong>node-hours net</div>
<div class="card"><strong>{{ passed }} / {{ verdicts|length }}</strong>thresholds passed</div>
</div>

<h2>Thresholds agreed</h2>
<div class="wide"><table id="thresholds" class="figures"><tr><th>Measure</th><th>Limit</th><th>Baseline</th><th>Protected</th><th>Result</th></tr>
{% for v in verdicts %}<tr><td style="text-align: left">{{ v.name }}</td><td style="text-align: left">{{ v.limit }}</td>
<td>{{ cell('v_' + v.unit, v.baseline) }}</td><td>{{ cell('v_' + v.unit, v.protected) }}</td>
<td class="{{ 'pass' if v.passed else 'fail' if v.passed is false else '' }}">{{ v.said() }}</td></tr>
{% endfor %}</table></div>

<h2>Node-hours per week since the start</h2>
{{ trend_chart }}

<h2>Measures: baseline, protected, unprotected</h2>
<div class="wide"><table id="measures" class="figures"><tr><th>Measure</th><th>Baseline</th><th>Protected</th><th>Unprotected</th></tr>
{% for r in rows %}<tr><td style="text-align: left">{{ r.measure }}</td><td>{{ cell(r.measure, r.baseline) }}</td>
<td>{{ cell(r.measure, r.protected) }}</td><td>{{ cell(r.measure, r.unprotected) }}</td></tr>
{% endfor %}</table></div>

<h2>How these are counted</h2>
<ul class="note">
<li>Protected: jobs of the opted-in set that stasis protected{% if outside %} ({{ outside }} protected job(s) outside the set are counted too){% endif %};
unprotected: every other job that ended since the start (the comparison group).</li>
<li>Completion time: from a job's first submission to its last end, requeues included; queue
wait: the sum of its attempts' waits. Exceptions: jobs that ended FAILED, NODE_FAIL,
OUT_OF_MEMORY, BOOT_FAIL or DEADLINE.</li>
<li>Redone: node-hours run again by resubmissions after a TIMEOUT and by reruns after a
preemption; kept: the node-hours of protected jobs' interrupted attempts (restored, not rerun);
spent: their checkpoints' frozen time &times; nodes, as in <code>stasis slurm report</code>.</li>
<li>Shares are per job (counts) or per node-hour used (node-hours), so that periods of
different lengths compare.</li>
</ul>
<p class="note">Made by <code>stasis slurm poc report</code> on {{ made }}.</p>
</body></html>
"""


def render(
    state: State,
    split: Split,
    verdicts: list[Verdict],
    until: datetime,
    now: datetime | None = None,
) -> str:
    env = Environment(autoescape=True)
    weeks: dict[str, Week] = {
        w: Week(_lost(u), _lost(p), p.kept_node_hours, p.spent_node_hours)
        for w, (p, u) in split.weeks.items()
    }
    listed = report_html.all_weeks(state.started, until, weeks, Week)
    day = int((until - state.started).total_seconds() // 86400) + 1
    return env.from_string(_PAGE).render(
        style=Markup(report_html.STYLE),
        state=state,
        started=state.started.isoformat(sep=" ", timespec="minutes"),
        baseline_since=state.baseline_since.isoformat(sep=" ", timespec="minutes"),
        until=until.isoformat(sep=" ", timespec="minutes"),
        day=day,
        p=split.protected,
        u=split.unprotected,
        h=report_html.hours,
        cell=cell,
        verdicts=verdicts,
        passed=sum(1 for v in verdicts if v.passed),
        rows=compare_rows(state, split),
        outside=split.protected_outside,
        trend_chart=report_html.trend_chart(
            env, listed, CATEGORIES, "weekly", "node-hours lost, kept and spent per week"
        ),
        made=(now or datetime.now()).isoformat(sep=" ", timespec="seconds"),
    )
