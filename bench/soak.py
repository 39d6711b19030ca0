"""`python -m bench.soak`: random faults across two nodes and the control plane, counting work lost.

    python -m bench.soak [--cycles 200] [--seed N] [--jobs 3] [--store s3|local]
                         [--actions a,b] [--faults x,y] [--out DIR]

A site as a real one runs it, every part a real process started here: a SeaweedFS S3 server
(tests/s3server.py) reached through a proxy that can cut it off (tests/faultproxy.py), the
control plane (`stasis controlplane serve`, SQLite) and two node daemons (`stasis daemon`, each
its own state directory, one store and one site key between them, joined to the control plane).
`--jobs` counters (bench/workloads/soak_counter.py: the state is the count) run under labels.

Each cycle: one action on a random label (a leave-running dump, a stopping dump, a restore by
label, a migration through the control plane, a kill of the job) while one fault strikes (the
daemon SIGKILLed at a random moment, or at a random named fault point of stasis/faults.py armed
with STASIS_TEST_FAULT_POINTS; the store cut off mid-transfer or stalled (its server SIGSTOPped);
the control plane SIGKILLed and started again). Then recovery as an operator would do it: what died
is started again, the site is given `--settle` seconds, and a label that no job runs is restored
by label (started afresh only when no checkpoint is listed). Then the invariants, per label:

- nothing runs twice: at most one live job in both nodes' `ps`, and no copy of the counter alive
  outside the tree of the job that runs it;
- nothing is frozen: no process of a live job stands stopped (state T) 10 s after recovery;
- no work lost: the job runs (or a checkpoint is listed, from which recovery restores it), and
  the count it resumed from is not below the one the newest checkpoint holds.

Work lost, in seconds of counting: the newest checkpoint's count (a lower bound: the count seen
just before the dump that made it returned success) minus the count the job resumed from (the
lowest count any of the label's processes printed after the cycle began, minus one). The work a
killed job did after its newest checkpoint is not lost work: a checkpoint cannot keep it.

Writes bench/results/soak-<stamp>.csv (one row per cycle) and soak-<stamp>.md (counts and medians
per fault kind and per action). Root only (CRIU).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.soak_site import COUNTER, Site, fault_points, points_for

RESULTS = Path(__file__).resolve().parent / "results"
ACTIONS = ("dump-leave", "dump-stop", "restore-label", "migrate", "kill-job")
FAULTS = ("daemon-kill", "fault-point", "store-cut", "store-stall", "controlplane-restart")
LIVE = ("running", "restored", "restoring")
# Not a fault of stasis: work lost on purpose, to check that the soak sees each kind of loss.
SABOTAGE = ("lose", "freeze", "stray")


@dataclass
class Label:
    name: str
    floor: int = -1  # the count the newest checkpoint holds at least (-1: none taken)
    last: int = -1  # the count seen at the end of the last cycle
    jobs: set[tuple[str, str]] = field(default_factory=set)  # (node, job) seen under it
    fresh: bool = False  # started afresh this cycle (its loss counted already)


@dataclass
class Cycle:
    cycle: int
    action: str
    fault: str
    detail: str = ""
    label: str = ""
    node: str = ""
    action_ok: bool = False
    fault_hit: bool = False  # the daemon or control plane died of the fault
    action_s: float = 0.0
    recovery_s: float = 0.0
    lost_s: float = 0.0
    lost_labels: int = 0
    twice: int = 0
    frozen: int = 0
    orphans: int = 0
    unusable: int = 0
    manual: int = 0  # labels no job ran after settling, not stopped on purpose: restored by hand
    notes: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "cycle": self.cycle,
            "action": self.action,
            "fault": self.fault,
            "detail": self.detail,
            "label": self.label,
            "node": self.node,
            "action_ok": int(self.action_ok),
            "fault_hit": int(self.fault_hit),
            "action_s": round(self.action_s, 3),
            "recovery_s": round(self.recovery_s, 3),
            "lost_s": round(self.lost_s, 2),
            "lost_labels": self.lost_labels,
            "twice": self.twice,
            "frozen": self.frozen,
            "orphans": self.orphans,
            "unusable": self.unusable,
            "manual": self.manual,
            "notes": " | ".join(self.notes),
        }

    @property
    def lost(self) -> bool:
        return bool(
            self.lost_s > 0
            or self.lost_labels
            or self.twice
            or self.frozen
            or self.orphans
            or self.unusable
        )


class Soak:
    def __init__(
        self,
        site: Site,
        rng: random.Random,
        jobs: int,
        interval: float,
        settle_s: float,
        actions: list[str],
        faults: list[str],
    ) -> None:
        self.site = site
        self.rng = rng
        self.interval = interval
        self.settle_s = settle_s
        self.actions = actions
        self.points = fault_points()
        self.faults = [f for f in faults if f != "fault-point" or self.points]
        if site.proxy is None:  # a local store has no network to cut or stall
            self.faults = [f for f in self.faults if not f.startswith("store-")]
        if not self.faults:
            raise SystemExit(
                "no fault left to inject (fault points: none in stasis/; "
                "store faults: need --store s3)"
            )
        self.marker = site.marker
        self.in_turn = False
        self.sabotaged = 0
        self.strays: list[subprocess.Popen[bytes]] = []
        self.labels = {f"{self.marker}-{i}": Label(f"{self.marker}-{i}") for i in range(jobs)}

    # -- what the site says --------------------------------------------------------------------

    def live(self, label: str) -> list[tuple[str, dict[str, Any]]]:
        found = []
        for name in self.site.nodes:
            for j in self.site.ps(name):
                if j["label"] == label and j["state"] in LIVE:
                    found.append((name, j))
        return found

    def counts(self, node: str, job: str) -> list[tuple[int, float]]:
        out = []
        for line in self.site.logs(node, job).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                try:
                    out.append((int(parts[0]), float(parts[1])))
                except ValueError:
                    continue
        return out

    def value(self, node: str, job: str) -> int:
        c = self.counts(node, job)
        return c[-1][0] if c else -1

    def marker_pids(self, label: str) -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if label.encode() in argv and any(a.endswith(b"soak_counter.py") for a in argv):
                    found.append(int(name))
        return found

    # -- setup ----------------------------------------------------------------------------------

    def start_job(self, label: Label, node: str) -> str:
        job = self.site.run_job(node, label.name, self.interval)
        label.jobs.add((node, job))
        deadline = time.monotonic() + 20
        while self.value(node, job) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return job

    def first_run(self, label: Label, node: str) -> str:
        """Start the label's job and take its first checkpoint (unfaulted): from then on the
        label always has one to lose."""
        job = self.start_job(label, node)
        before = self.value(node, job)
        r = self.site.cli(node, "dump", "--leave-running", "--json", job)
        if r.returncode != 0:
            raise RuntimeError(f"the first checkpoint of {label.name} failed: {r.stderr}")
        label.floor = before
        label.last = self.value(node, job)
        return job

    def setup(self) -> None:
        for i, label in enumerate(self.labels.values()):
            self.first_run(label, list(self.site.nodes)[i % len(self.site.nodes)])

    # -- one cycle --------------------------------------------------------------------------------

    def cycle(self, n: int) -> Cycle:
        if self.in_turn:
            c = Cycle(
                n,
                self.actions[(n - 1) % len(self.actions)],
                self.faults[(n - 1) % len(self.faults)],
            )
        else:
            c = Cycle(n, self.rng.choice(self.actions), self.rng.choice(self.faults))
        label = self.labels[self.rng.choice(sorted(self.labels))]
        c.label = label.name
        t0 = time.time()
        live = self.live(label.name)
        if not live:  # left so by a fault that recovery could not undo: restore it first
            self.restore_label(label, self.rng.choice(list(self.site.nodes)), c)
            live = self.live(label.name)
        if not live:
            c.notes.append("no live job to act on")
            self.recover(c, t0)
            return c
        node, job = live[0][0], live[0][1]["job"]
        c.node = node
        if c.fault == "sabotage":
            return self.sabotage(c, label, node, job, t0)
        others = [x for x in self.site.nodes if x != node]
        before = self.value(node, job)
        # Any checkpoint of the label listed after the action and not before holds >= `before`,
        # whatever the command answered (a daemon killed after publishing answers nothing).
        listed = {ck["id"] for ck in self.site.checkpoints(node, label.name)}
        cmd: list[str]
        on = node  # the process the action runs against (its daemon is the fault's target)
        if c.action == "dump-leave":
            cmd = self.site.cli_argv(node, "dump", "--leave-running", "--json", job)
        elif c.action == "dump-stop":
            cmd = self.site.cli_argv(node, "dump", "--json", job)
        elif c.action == "kill-job":
            cmd = self.site.cli_argv(node, "kill", job)
        elif c.action == "restore-label":
            # A restore by label is of a job that no longer runs: it is stopped first, unfaulted.
            r = self.site.cli(node, "kill", "--timeout", "5", job)
            if r.returncode != 0:
                c.notes.append(f"kill before restore: {r.stderr.strip()[:200]}")
            on = self.rng.choice(list(self.site.nodes))
            cmd = self.site.cli_argv(on, "restore", "--label", label.name, "--json")
        else:  # migrate
            self.site.wait_reported(job, 15)
            on = self.rng.choice([node, *others])  # the source's or the destination's daemon
            cmd = self.site.cp_argv("migrate", job, "--to", others[0], "--wait", "60", "--json")
        c.node = on
        started = time.monotonic()
        with self.fault(c, on), self.site.supervised() as restarted:
            done = subprocess.run(
                cmd,
                env=self.site.cli_env(on) if c.action != "migrate" else self.site.cp_env(),
                capture_output=True,
                text=True,
                timeout=180,
            )
        c.action_s = time.monotonic() - started
        if restarted:
            c.fault_hit = True
            c.notes.append(f"started again while the action ran: {', '.join(restarted)}")
        c.action_ok = done.returncode == 0
        if not c.action_ok:
            c.notes.append(f"{c.action}: {(done.stderr or done.stdout).strip()[:200]}")
        elif c.action in ("dump-leave", "dump-stop", "migrate"):
            label.floor = max(label.floor, before)  # a checkpoint holding at least `before`
        # A job stopped on purpose (its checkpoint taken, or killed) is the operator's to restore.
        self.recover(
            c,
            t0,
            stopped={label.name}
            if c.action_ok and c.action in ("dump-stop", "kill-job")
            else set(),
            new_checkpoint=(label, listed, before),
        )
        return c

    def sabotage(self, c: Cycle, label: Label, node: str, job: str, t0: float) -> Cycle:
        """Lose work on purpose, from outside stasis, in place of the action: the soak's own
        check that each kind of loss is seen and counted (tests/bench/test_soak.py)."""
        kind = SABOTAGE[self.sabotaged % len(SABOTAGE)]
        self.sabotaged += 1
        c.action, c.detail, c.action_ok = "sabotage", kind, True
        stopped: set[str] = set()
        if kind == "lose":  # every checkpoint deleted, the job killed
            for ck in self.site.checkpoints(node, label.name):
                self.site.cli(node, "checkpoints", "rm", ck["id"])
            self.site.cli(node, "kill", "--timeout", "0", job)
            stopped = {label.name}
        elif kind == "freeze":  # the counter SIGSTOPped behind the daemon's back
            for pid in self.marker_pids(label.name):
                os.kill(pid, signal.SIGSTOP)
        else:  # a second copy of the counter, outside any job
            self.strays.append(
                subprocess.Popen(
                    ["python3", "-u", str(COUNTER), str(self.interval), label.name],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        self.recover(c, t0, stopped=stopped)
        for p in self.strays:
            p.poll()  # reaped once recovery killed it
        self.strays = [p for p in self.strays if p.returncode is None]
        return c

    @contextmanager
    def fault(self, c: Cycle, node: str) -> Iterator[None]:
        site = self.site
        if c.fault == "daemon-kill":
            delay = self.rng.uniform(0.0, 0.4)
            c.detail = f"SIGKILL {node}'s daemon after {delay:.2f} s"
            t = threading.Timer(delay, lambda: c.__setattr__("fault_hit", site.kill_daemon(node)))
            t.start()
            try:
                yield
            finally:
                t.join()
        elif c.fault == "fault-point":
            point = self.rng.choice(points_for(c.action, self.points))
            server = self.points[point][0] == "controlplane"
            arm = self.points[point][1]
            # A migration's points are on either node (the checkpoint half's, the restore half's).
            nodes = list(site.nodes) if c.action == "migrate" else [node]
            c.detail = point
            if server:
                site.restart_controlplane(points=arm)
            for n in nodes if not server else []:
                site.restart_daemon(n, points=arm)
            try:
                yield
            finally:
                time.sleep(0.5)  # a point past the command's answer (a late step) has its chance
                if server:
                    c.fault_hit = site.controlplane_died()
                    if c.fault_hit or site.cp_armed:
                        site.restart_controlplane(points=[])
                for n in nodes if not server else []:
                    died = site.daemon_died(n)
                    c.fault_hit = died or c.fault_hit
                    if died or site.nodes[n].env.get("STASIS_TEST_FAULT_POINTS"):
                        site.restart_daemon(n, points=[])
        elif c.fault == "store-cut":
            assert site.proxy is not None
            way = self.rng.choice(("upload", "download"))
            after = self.rng.randrange(0, 2 << 20)
            c.detail = f"cut after {after} bytes of {way}"
            site.proxy.cut_after(**{way: after})
            try:
                yield
            finally:
                c.fault_hit = site.proxy.cut
                site.proxy.heal()
        elif c.fault == "store-stall":
            stall = self.rng.uniform(1.0, 5.0)
            c.detail = f"store stalled {stall:.1f} s"
            site.stall_store(stall)
            c.fault_hit = True
            try:
                yield
            finally:
                site.unstall_store(wait=True)
        else:  # controlplane-restart
            delay = self.rng.uniform(0.0, 1.0)
            c.detail = f"control plane SIGKILLed after {delay:.2f} s"
            t = threading.Timer(delay, lambda: c.__setattr__("fault_hit", site.kill_controlplane()))
            t.start()
            try:
                yield
            finally:
                t.join()

    # -- recovery and the invariants ----------------------------------------------------------

    def restore_label(self, label: Label, node: str, c: Cycle) -> bool:
        listed = self.site.checkpoints(node, label.name)
        if not listed:
            return False
        r = self.site.cli(node, "restore", "--label", label.name, "--json")
        if r.returncode != 0:
            c.unusable += 1
            c.notes.append(f"{label.name}: restore by label failed: {r.stderr.strip()[:200]}")
            return False
        label.jobs.add((node, json.loads(r.stdout)["job"]))
        return True

    def recover(
        self,
        c: Cycle,
        t0: float,
        stopped: set[str] | None = None,
        new_checkpoint: tuple[Label, set[str], int] | None = None,
    ) -> None:
        started = time.monotonic()
        site = self.site
        site.heal()
        # What the site does by itself (a migration's restore half, a journal resolved at start)
        # is given `settle_s`; a label no job runs after it is the operator's to restore.
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            # An operator waits for the control plane's pending commands (a migration's
            # restore half) before restoring by hand: else both would run.
            if all(
                len(self.live(name)) == 1 for name in self.labels if name not in (stopped or set())
            ) or (
                c.action == "migrate"
                and site.pending_commands() == 0
                and all(len(self.live(name)) <= 1 for name in self.labels)
            ):
                break
            time.sleep(0.5)
        if new_checkpoint is not None:
            acted, listed, before = new_checkpoint
            now = {ck["id"] for ck in site.checkpoints(list(site.nodes)[0], acted.name)}
            if now - listed and before > acted.floor:
                acted.floor = before
                if not c.action_ok:
                    c.notes.append(
                        f"{acted.name}: a checkpoint was listed though " f"{c.action} failed"
                    )
        for label in self.labels.values():
            live = self.live(label.name)
            for node, j in live:
                label.jobs.add((node, j["job"]))
            pids = self.marker_pids(label.name)
            tracked: set[int] = set()
            for _, j in live:
                if j.get("pid"):
                    tracked |= set(site.tree(int(j["pid"])))
            stray = [p for p in pids if p not in tracked]
            if len(live) > 1:
                c.twice += 1
                c.notes.append(
                    f"{label.name} runs {len(live)} times: "
                    f"{[(n, j['job'], j['state']) for n, j in live]}"
                )
                keep = max(live, key=lambda nj: self.value(nj[0], nj[1]["job"]))
                for node, j in live:
                    if j is not keep[1]:
                        site.cli(node, "kill", "--timeout", "0", j["job"])
                live = [keep]
            if stray:
                c.orphans += 1
                c.notes.append(f"{label.name}: counter pids {stray} outside any live job")
                for p in stray:
                    site.kill_pid(p)
            frozen = [
                int(j["pid"])
                for _, j in live
                if j.get("pid") and site.wait_unfrozen(int(j["pid"]), 10.0)
            ]
            if frozen:
                c.frozen += 1
                c.notes.append(f"{label.name}: job stopped (state T) 10 s after recovery")
                node, j = live[0]
                site.cli(node, "kill", "--timeout", "0", j["job"])
                live = []
            if not live:
                if label.name not in (stopped or set()):
                    c.manual += 1
                node = self.rng.choice(list(site.nodes))
                if not self.restore_label(label, node, c):
                    if not site.checkpoints(node, label.name):
                        c.lost_labels += 1
                        c.notes.append(f"{label.name}: no job runs and no checkpoint is listed")
                    # All it had counted up to its newest checkpoint is lost with it.
                    c.lost_s += (label.floor + 1) * self.interval
                    label.jobs, label.fresh = set(), True
                    self.first_run(label, node)
        c.recovery_s = time.monotonic() - started
        self.measure(c, t0)

    def measure(self, c: Cycle, t0: float) -> None:
        # Every label's job counts on past recovery before its resume point is read.
        mark = time.time()
        for label in self.labels.values():
            live = self.live(label.name)
            if not live:
                continue
            node, j = live[0]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                counts = self.counts(node, j["job"])
                if counts and counts[-1][1] > mark:
                    break
                time.sleep(0.2)
            # Every count printed since the cycle began, on any node, in the order printed (a
            # log that travelled with a migration repeats the lines it carries: once each).
            printed = sorted(
                {(t, v) for n, job in label.jobs for v, t in self.counts(n, job) if t > t0}
            )
            if not printed:
                c.notes.append(f"{label.name}: no count since the cycle began")
                continue
            prev, resumed = label.last, None
            if label.fresh:
                printed, label.fresh = [], False
            for _, v in printed:
                if v <= prev:  # counting again from v: a process resumed from v - 1
                    resumed = v - 1 if resumed is None or v - 1 < resumed else resumed
                prev = v
            if resumed is not None and resumed < label.floor:
                c.lost_s += (label.floor - resumed) * self.interval
                c.notes.append(
                    f"{label.name}: resumed from {resumed}, newest checkpoint holds "
                    f">= {label.floor}"
                )
            label.last = self.value(node, j["job"])
            # Jobs that ended long ago have nothing more to say: only the live one is read next.
            label.jobs = {(node, j["job"])}


def median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def report(
    cycles: list[Cycle], args: argparse.Namespace, points: list[str], took_s: float, stamp: str
) -> str:
    lines = [
        f"# Soak: {len(cycles)} cycles of random faults, two nodes and the control plane "
        f"({stamp})",
        "",
        f"seed {args.seed}, {args.jobs} counter jobs (a count every {args.interval:g} s), "
        f"store {args.store}, settle {args.settle:g} s; {os.cpu_count()} CPUs; "
        f"{took_s / 60:.1f} min. Fault points in the code: "
        f"{', '.join(points) if points else 'none'}.",
        "",
        "Work lost: seconds of counting below what the newest checkpoint held; a label with "
        "neither job nor checkpoint; a label running twice; a counter alive outside any "
        "job; a job left stopped (T); a listed checkpoint that would not restore. "
        "Target: 0 everywhere. A loss is counted in the cycle whose check finds it, which "
        "may not be the cycle whose fault caused it (a command carried out late). Restored "
        "by hand (not a loss): labels no job ran once the site had settled, though no "
        "action had stopped them (the soak restored them by label).",
        "",
    ]

    def table(key: str, title: str) -> None:
        lines.extend(
            [
                f"| {title} | cycles | fault hit | action ok | cycles losing work | "
                "work lost s | lost labels | twice | orphans | frozen | unusable | "
                "restored by hand | action s (median) | recovery s (median) |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
        )
        groups: dict[str, list[Cycle]] = {}
        for c in cycles:
            groups.setdefault(getattr(c, key), []).append(c)
        for name in sorted(groups) + ["all"]:
            cs = cycles if name == "all" else groups[name]
            lines.append(
                f"| {name} | {len(cs)} | {sum(c.fault_hit for c in cs)} | "
                f"{sum(c.action_ok for c in cs)} | {sum(c.lost for c in cs)} | "
                f"{sum(c.lost_s for c in cs):.1f} | {sum(c.lost_labels for c in cs)} | "
                f"{sum(c.twice for c in cs)} | {sum(c.orphans for c in cs)} | "
                f"{sum(c.frozen for c in cs)} | {sum(c.unusable for c in cs)} | "
                f"{sum(c.manual for c in cs)} | {median([c.action_s for c in cs])} | {median([c.recovery_s for c in cs])} |"
            )
        lines.append("")

    table("fault", "fault")
    table("action", "action")
    losing = [c for c in cycles if c.lost]
    if losing:
        lines.append("Cycles that lost work:")
        lines.append("")
        by_n = {c.cycle: c for c in cycles}
        for c in losing:
            lines.append(
                f"- {c.cycle}: {c.action} + {c.fault} ({c.detail}): " + "; ".join(c.notes)[:600]
            )
            prev = by_n.get(c.cycle - 1)
            if prev is not None:
                lines.append(
                    f"  (cycle {prev.cycle} before it: {prev.action} + {prev.fault} "
                    f"({prev.detail}): " + "; ".join(prev.notes)[:300] + ")"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak")
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    p.add_argument("--jobs", type=int, default=3, help="counter jobs, one label each")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between counts")
    p.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="seconds the site has to put itself right after each cycle",
    )
    p.add_argument("--store", choices=("s3", "local"), default="s3")
    p.add_argument("--actions", default=",".join(ACTIONS))
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="also: sabotage (work lost on purpose, to check the soak counts it)",
    )
    p.add_argument(
        "--in-turn",
        action="store_true",
        help="take --actions and --faults in turn (cycle N: the Nth of each, wrapping) "
        "instead of at random",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench.soak runs the node daemons: root only")
    if args.seed is None:
        args.seed = int(time.time())
    actions = [a for a in args.actions.split(",") if a]
    faults = [f for f in args.faults.split(",") if f]
    for x in [*actions, *faults]:
        if x not in (*ACTIONS, *FAULTS, "sabotage"):
            raise SystemExit(
                f"unknown action or fault {x!r}: actions {', '.join(ACTIONS)}; "
                f"faults {', '.join(FAULTS)}"
            )
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    os.chmod(root, 0o755)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / f"soak-{stamp}.csv"
    cycles: list[Cycle] = []
    began = time.monotonic()
    print(f"soak: seed {args.seed}, {args.cycles} cycles, scratch {root}", flush=True)
    site = Site(root, s3=args.store == "s3", nodes=("node-a", "node-b"))
    points: list[str] = []
    error = ""
    try:
        site.start()
        soak = Soak(site, rng, args.jobs, args.interval, args.settle, actions, faults)
        points = [f"{p} ({where})" for p, (where, _) in soak.points.items()]
        soak.in_turn = args.in_turn
        soak.setup()
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(Cycle(0, "", "").row()))
            w.writeheader()
            for n in range(1, args.cycles + 1):
                c = soak.cycle(n)
                cycles.append(c)
                w.writerow(c.row())
                f.flush()
                print(
                    f"{n:4d} {c.action:13s} {c.fault:20s} {'LOST' if c.lost else 'ok':4s} "
                    f"{c.detail} {'; '.join(c.notes)[:300]}",
                    flush=True,
                )
    except Exception as e:  # the cycles done so far are still reported
        error = f"stopped after {len(cycles)} cycles: {type(e).__name__}: {e}"
        print(f"soak: {error}", file=sys.stderr)
    finally:
        site.stop()
    took = time.monotonic() - began
    text = report(cycles, args, points, took, stamp)
    if error:
        text += f"\n**The soak {error}**\n"
    (args.out / f"soak-{stamp}.md").write_text(text + "\n")
    print(text)
    if not os.environ.get("BENCH_SOAK_KEEP"):
        shutil.rmtree(root, ignore_errors=True)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
