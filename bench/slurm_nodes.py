"""End to end on a three-node local Slurm cluster: what a preemption and a node failure cost a
job, with stasis and with Slurm's requeue from scratch, measured in the same run.

    python -m bench.slurm_nodes [--runs N] [--interval S] [--out DIR]

A counter job (one `progress N` line every PERIOD_S) runs in the preemptable `low` partition.
- Preemption: a job of the `high` partition asks for the whole of the victim's node. Measured:
  seconds from the preemptor's submission (Slurm's preemption starts at once: with stasis the
  batch shell gets its warning signal then) to the node being free of the victim; seconds from
  the requeued job's start on the other node (squeue shows it RUNNING there, polled every 50 ms)
  to its first line of progress; and the progress done again.
- Node failure: with stasis the job takes a checkpoint every --interval seconds; its node is
  killed without warning (`stasis-dev local-cluster kill-node`), Slurm finds it DOWN and
  requeues the job onto another node. Measured: progress lost (done again) and seconds from the
  kill to progress again.
The baseline is the same job without stasis (`--export=NONE`): Slurm requeues it and it runs from
the start. Results: JSON and Markdown in --out (medians over --runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from bench.procs import BenchError
from bench.slurm_e2e import COUNTER, CPUS, PERIOD_S, _progress
from stasis.poll import poll

GRACE_S = 10
VICTIM = """\
#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --partition=low
#SBATCH --exclude=n3
#SBATCH --output={work}/{name}-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
{export}
exec python3 -u {work}/counter.py
"""
PREEMPTOR = f"""\
#!/bin/bash
#SBATCH --job-name=preemptor
#SBATCH --partition=high
#SBATCH --cpus-per-task={CPUS}
#SBATCH --nodelist={{node}}
#SBATCH --output={{work}}/preemptor-%j.out
sleep 60
"""


T = TypeVar("T")


def _wait(what: str, pred: Callable[[], T | None], timeout_s: float, every: float = 0.05) -> T:
    value = poll(pred, timeout_s, interval_s=every)
    if not value:
        raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
    return value


class Cluster:
    def __init__(self, stasis: str, root: Path) -> None:
        self.stasis, self.root, self.work = stasis, root, root / "work"
        self.stasis_dev = str(Path(stasis).with_name("stasis-dev"))  # stasis.dev's harnesses
        self.env: dict[str, str] = {}

    def up(self) -> None:
        done = subprocess.run(
            [
                self.stasis_dev,
                "local-cluster",
                "up",
                "--dir",
                str(self.root),
                "--nodes",
                "3",
                "--cpus",
                str(CPUS),
                "--grace-s",
                str(GRACE_S),
                "--socket-group",
                "root",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "STASIS_CONFIG": ""},
        )
        if done.returncode != 0:
            raise BenchError(f"local-cluster up failed: {(done.stderr or done.stdout)[-400:]}")
        answer = json.loads(done.stdout)
        self.env = {
            **os.environ,
            "SLURM_CONF": answer["slurm_conf"],
            "STASIS_CONFIG": answer["stasis_config"],
        }
        self.env.pop("STASIS_ENABLE", None)
        self.work.mkdir(exist_ok=True)
        (self.work / "counter.py").write_text(COUNTER)

    def down(self) -> None:
        subprocess.run(
            [self.stasis_dev, "local-cluster", "down", "--dir", str(self.root)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=60, cwd=self.work
        )
        if check and done.returncode != 0:
            raise BenchError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
        return done.stdout

    def sbatch(self, name: str, text: str) -> str:
        script = self.work / f"{name}.sh"
        script.write_text(text)
        return self.run("sbatch", "--parsable", str(script)).strip().split(";")[0]

    def where(self, job: str) -> tuple[str, str]:
        """(state, node) of the job as squeue shows it now."""
        out = self.run("squeue", "-h", "-j", job, "-o", "%T %N", check=False).split()
        return (out[0], out[1]) if len(out) == 2 else (out[0] if out else "", "")

    def node_busy_with(self, node: str, job: str) -> bool:
        return job in self.run("squeue", "-h", "-w", node, "-o", "%i", check=False).split()

    def node(self, action: str, node: str) -> None:
        self.run(self.stasis_dev, "local-cluster", action, "--dir", str(self.root), node)

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        _wait(
            f"{node} back",
            lambda: self.run("sinfo", "-h", "-n", node, "-o", "%T").strip().rstrip("*")
            in ("idle", "mixed", "allocated"),
            120,
            0.5,
        )

    def idle(self) -> None:
        for job in self.run("squeue", "-h", "-o", "%i").split():
            self.run("scancel", job, check=False)
        _wait("the cluster to be idle", lambda: not self.run("squeue", "-h").strip(), 90, 0.5)


class Output:
    """A job's output file, each line with the time it was first seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[float] = []

    def lines(self) -> list[str]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        now = time.monotonic()
        self.seen.extend(now for _ in range(len(self.seen), len(lines)))
        return lines

    def progress_after(self, index: int) -> tuple[int, int] | None:
        """(line index, value) of the first progress line after line `index`."""
        lines = self.lines()
        for i in range(index + 1, len(lines)):
            value = _progress(lines[i])
            if value is not None:
                return i, value
        return None

    def last_progress(self) -> tuple[int, int]:
        lines = self.lines()
        for i in range(len(lines) - 1, -1, -1):
            value = _progress(lines[i])
            if value is not None:
                return i, value
        raise BenchError(f"no progress in {self.path}")


def _victim(c: Cluster, name: str, export: str) -> tuple[str, Output, str]:
    job = c.sbatch(name, VICTIM.format(name=name, work=c.work, export=export))
    out = Output(c.work / f"{name}-{job}.out")
    _wait(f"{name} to make progress", lambda: any(_progress(ln) == 12 for ln in out.lines()), 120)
    state, node = c.where(job)
    if state != "RUNNING":
        raise BenchError(f"{name} is {state}")
    return job, out, node


def _started_elsewhere(c: Cluster, job: str, node: str, out: Output) -> tuple[float, str]:
    def running() -> tuple[float, str] | None:
        out.lines()
        state, where = c.where(job)
        return (time.monotonic(), where) if state == "RUNNING" and where != node else None

    return _wait("the requeued job to run on another node", running, 240)


def preemption(c: Cluster, method: str, export: str) -> dict[str, Any]:
    job, out, node = _victim(c, f"pre-{method}", export)
    try:
        cut, before = out.last_progress()
        t0 = time.monotonic()
        c.sbatch("preemptor", PREEMPTOR.format(node=node, work=c.work))
        _wait("the node to be free", lambda: not c.node_busy_with(node, job) or None, 120)
        freed = time.monotonic() - t0
        started, elsewhere = _started_elsewhere(c, job, node, out)

        # The first progress line of the new run: after the restore's line (stasis), or the
        # first one that does not go on from the line before it (from scratch).
        def restarted() -> tuple[int, int] | None:
            lines = out.lines()
            last = before
            for i in range(cut + 1, len(lines)):
                value = _progress(lines[i])
                if value is None:
                    continue
                if value != last + 1 or any("restored" in ln for ln in lines[cut:i]):
                    return i, value
                last = value
            return None

        after = _wait("progress again", restarted, 120)
        before = max(v for ln in out.lines()[: after[0]] if (v := _progress(ln)) is not None)
        return {
            "job": job,
            "from": node,
            "to": elsewhere,
            "node_free_s": round(freed, 3),
            "start_to_work_s": round(out.seen[after[0]] - started, 3),
            "progress_before": before,
            "progress_after": after[1],
            "redone_s": max(0, before + 1 - after[1]) * PERIOD_S,
        }
    finally:
        c.idle()


def node_failure(c: Cluster, method: str, export: str, interval_s: int) -> dict[str, Any]:
    job, out, node = _victim(c, f"fail-{method}", export)
    try:
        # Both jobs have run two intervals and a part of a third (not always the same) when
        # their node dies.
        target = int((2 * interval_s + time.time() % interval_s) / PERIOD_S)
        _wait(f"progress {target}", lambda: any(_progress(ln) == target for ln in out.lines()), 120)
        c.node("kill-node", node)
        t0 = time.monotonic()
        cut, before = out.last_progress()
        _started_elsewhere(c, job, node, out)
        after = _wait("progress again", lambda: out.progress_after(cut), 120)
        return {
            "job": job,
            "from": node,
            "progress_before": before,
            "progress_after": after[1],
            "lost_s": max(0, before + 1 - after[1]) * PERIOD_S,
            "kill_to_work_s": round(out.seen[after[0]] - t0, 3),
        }
    finally:
        c.node("start-node", node)
        c.resume(node)
        c.idle()


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 3) if values else None


def measure(stasis: str, runs: int, interval_s: int) -> dict[str, Any]:
    methods = {
        "stasis": f"#SBATCH --export=STASIS_ENABLE=1,STASIS_INTERVAL={interval_s}",
        "requeue": "#SBATCH --export=NONE",
    }
    root = Path(tempfile.mkdtemp(prefix="stasis-bench-nodes-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    c = Cluster(stasis, root / "cluster")
    result: dict[str, Any] = {
        "period_s": PERIOD_S,
        "interval_s": interval_s,
        "grace_s": GRACE_S,
        "runs": runs,
        "preemption": {},
        "node_failure": {},
    }
    try:
        c.up()
        for method, export in methods.items():
            pre: list[dict[str, Any]] = []
            fail: list[dict[str, Any]] = []
            for _ in range(runs):
                for rows, kind in ((pre, "preemption"), (fail, "node failure")):
                    try:
                        rows.append(
                            preemption(c, method, export)
                            if kind == "preemption"
                            else node_failure(c, method, export, interval_s)
                        )
                    except BenchError as e:
                        rows.append({"error": f"{kind}, {method}: {e}"})
                        c.idle()
            result["preemption"][method] = {
                "runs": pre,
                **{k: _median(pre, k) for k in ("node_free_s", "start_to_work_s", "redone_s")},
            }
            result["node_failure"][method] = {
                "runs": fail,
                **{k: _median(fail, k) for k in ("lost_s", "kill_to_work_s")},
            }
    finally:
        c.down()
        shutil.rmtree(root, ignore_errors=True)
    return result


def markdown(r: dict[str, Any], when: str) -> str:
    p, f = r["preemption"], r["node_failure"]

    def cell(d: dict[str, Any], key: str) -> str:
        v = d.get(key)
        return "n/a" if v is None else f"{v:.2f}"

    lines = [
        f"# Slurm on three local nodes: preemption and node failure ({when})",
        "",
        f"Counter job, one line every {r['period_s']} s; GraceTime {r['grace_s']} s; stasis "
        f"checkpoints every {r['interval_s']} s (STASIS_INTERVAL); medians of {r['runs']} runs; "
        "baseline: the same job without stasis (Slurm requeues it from scratch).",
        "",
        "| preemption | stasis | requeue from scratch |",
        "|---|---|---|",
        f"| preemptor submitted -> node free (s) | {cell(p['stasis'], 'node_free_s')} | "
        f"{cell(p['requeue'], 'node_free_s')} |",
        f"| requeued job started elsewhere -> progress (s) | "
        f"{cell(p['stasis'], 'start_to_work_s')} | {cell(p['requeue'], 'start_to_work_s')} |",
        f"| work done again (s) | {cell(p['stasis'], 'redone_s')} | "
        f"{cell(p['requeue'], 'redone_s')} |",
        "",
        "| node failure (killed without warning) | stasis | requeue from scratch |",
        "|---|---|---|",
        f"| work lost (s) | {cell(f['stasis'], 'lost_s')} | {cell(f['requeue'], 'lost_s')} |",
        f"| kill -> progress again on another node (s) | {cell(f['stasis'], 'kill_to_work_s')} | "
        f"{cell(f['requeue'], 'kill_to_work_s')} |",
        "",
    ]
    errors = [
        row["error"]
        for part in (p, f)
        for m in part.values()
        for row in m["runs"]
        if "error" in row
    ]
    if errors:
        lines += ["Errors:", *(f"- {e}" for e in errors), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slurm_nodes")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--interval",
        type=int,
        default=10,
        help="STASIS_INTERVAL of the stasis job (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--stasis", default=str(Path(sys.executable).parent / "stasis"))
    args = parser.parse_args()
    when = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result = measure(args.stasis, args.runs, args.interval)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"slurm-nodes-{when}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result, when)
    (args.out / f"slurm-nodes-{when}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
