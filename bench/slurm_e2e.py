"""End to end on the local Slurm cluster: progress redone per preemption, stasis vs requeue.

A counter job (one `progress N` line every PERIOD_S) runs in the preemptable `low` partition; a
job asking for the whole node in `high` preempts it (PreemptMode=REQUEUE with a GraceTime). With
stasis (one `#SBATCH --export=STASIS_ENABLE=1,...` line) it is checkpointed at the warning and
restored when it starts again; without, Slurm requeues it and it starts from zero. Progress redone
= (last progress before the preemption + 1 - first progress after the restart) x PERIOD_S; down
time = from the last line before the preemption to the first one after. Driven only through
`stasis-dev local-cluster` and the ordinary sbatch/scontrol/scancel, as a user would.
The output is opened in append mode, else a requeued job's restart truncates what we measure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.procs import BenchError
from stasis.poll import poll

PERIOD_S = 0.5
CPUS = 2
COUNTER = f"""\
import time
for i in range(100000):
    print("progress", i, flush=True)
    time.sleep({PERIOD_S})
"""
VICTIM = """\
#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --partition=low
#SBATCH --output={work}/{name}-%j.out
#SBATCH --open-mode=append
{export}
exec python3 -u {work}/counter.py
"""
PREEMPTOR = f"""\
#!/bin/bash
#SBATCH --job-name=preemptor
#SBATCH --partition=high
#SBATCH --cpus-per-task={CPUS}
#SBATCH --output={{work}}/preemptor-%j.out
sleep 3
"""
METHODS = {
    "stasis": "#SBATCH --export=STASIS_ENABLE=1,STASIS_CHECKPOINT=bench-victim",
    "requeue": "#SBATCH --export=NONE",
}


class _Cluster:
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
                "--cpus",
                str(CPUS),
                "--grace-s",
                "10",
                "--socket-group",
                "root",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=self.root.parent,
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
            cwd=self.root.parent,
        )

    def run(self, *cmd: str) -> str:
        done = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=60, cwd=self.work
        )
        if done.returncode != 0:
            raise BenchError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
        return done.stdout

    def sbatch(self, name: str, text: str) -> str:
        script = self.work / f"{name}.sh"
        script.write_text(text)
        return self.run("sbatch", "--parsable", str(script)).strip().split(";")[0]

    def state(self, job: str) -> str:
        m = re.search(r"JobState=(\S+)", self.run("scontrol", "show", "job", "-o", job))
        return m.group(1) if m else "?"


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


T = TypeVar("T")


def _wait(what: str, pred: Callable[[], T | None], timeout_s: float) -> T:
    value = poll(pred, timeout_s, interval_s=0.1)
    if not value:
        raise BenchError(f"slurm: timed out after {timeout_s:.0f} s waiting for {what}")
    return value


def _progress(line: str) -> int | None:
    m = re.fullmatch(r"progress (\d+)", line.strip())
    return int(m.group(1)) if m else None


def _one(c: _Cluster, method: str) -> dict[str, Any]:
    name = f"victim-{method}"
    job = c.sbatch(name, VICTIM.format(name=name, work=c.work, export=METHODS[method]))
    out = c.work / f"{name}-{job}.out"
    seen: dict[int, float] = {}  # line index -> monotonic time first seen

    def poll() -> list[str]:
        lines = _lines(out)
        now = time.monotonic()
        for i in range(len(seen), len(lines)):
            seen[i] = now
        return lines

    try:
        _wait(
            "the victim to make 20 steps of progress",
            lambda: any(_progress(ln) == 20 for ln in poll()),
            120,
        )
        before = len(poll())
        c.sbatch("preemptor", PREEMPTOR.format(work=c.work))

        def restarted() -> tuple[int, int] | None:
            lines = poll()
            last: int | None = None
            for i in range(before - 1, len(lines)):
                value = _progress(lines[i])
                marker = "restored" in lines[i] and value is None
                if (
                    marker or (value is not None and last is not None and value <= last)
                ) and i >= before:
                    after = next(
                        (j for j in range(i, len(lines)) if _progress(lines[j]) is not None), None
                    )
                    return (i, after) if after is not None else None
                if value is not None:
                    last = value
            return None

        try:
            cut, after = _wait("the victim to run again", restarted, 240)
        except BenchError as e:
            info = c.run("scontrol", "show", "job", "-o", job).strip()
            raise BenchError(f"{e}; job: {info[:600]}; output tail: {poll()[-4:]}") from e
        lines = poll()
        last_before = max(j for j in range(cut) if _progress(lines[j]) is not None)
        p_before, p_after = _progress(lines[last_before]), _progress(lines[after])
        assert p_before is not None and p_after is not None
        return {
            "job": job,
            "progress_before": p_before,
            "progress_after": p_after,
            "redone_s": max(0, p_before + 1 - p_after) * PERIOD_S,
            "down_s": seen[after] - seen[last_before],
            "lines": [ln for ln in lines[max(0, last_before - 2) : after + 2]],
        }
    finally:
        c.run("scancel", job)


def measure(stasis: str) -> dict[str, Any]:
    """Both methods on a fresh local cluster; {"available": False, "why": ...} when impossible."""
    if not Path(stasis).with_name("stasis-dev").exists():
        return {
            "available": False,
            "why": "not available: no `stasis-dev` (the local cluster's command) beside stasis",
        }
    root = Path(tempfile.mkdtemp(prefix="stasis-bench-slurm-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    c = _Cluster(stasis, root / "cluster")
    result: dict[str, Any] = {"available": True, "period_s": PERIOD_S, "methods": {}}
    try:
        c.up()
        for method in METHODS:
            try:
                result["methods"][method] = _one(c, method)
            except BenchError as e:
                result["methods"][method] = {"error": str(e)}
            _wait("the cluster to be idle", lambda: not c.run("squeue", "-h").strip(), 60)
    except BenchError as e:
        result.update(available=False, why=str(e))
    finally:
        c.down()
        shutil.rmtree(root, ignore_errors=True)
    return result
