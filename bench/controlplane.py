"""`python -m bench.controlplane`: N simulated node agents against one control plane on PostgreSQL.

    python -m bench.controlplane [--agents 200] [--heartbeat 10,2] [--seconds 60] [--jobs 4]

Starts a real PostgreSQL (Debian's, private directory, loopback; tests/pgserver.py) and `stasis
controlplane serve` on it, registers `--agents` nodes of one cluster, then runs every agent as a
node daemon does: a heartbeat every `--heartbeat` seconds (its `--jobs` live jobs, and on one
heartbeat in five a checkpoint report), each followed by a lease call for commands. The agents'
start times are spread over the first period. Measured per heartbeat period, over `--seconds`:
heartbeat and lease latency (p50, p99, max), requests per second, and the control plane's CPU
(user + system of its process over the window, in % of one core). Baseline in the same run: the
latency of GET /api/v1/health (no database) probed every 0.5 s under the same load.

Writes bench/results/controlplane-<stamp>.{json,md}. The agents run in this process (asyncio +
aiohttp) on the same 2 cores as the control plane: the figures are those of a loaded machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from bench.stasis_driver import STASIS
from tests.pgserver import PostgresServer
from tests.s3server import free_ports

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(ms: list[float]) -> dict[str, float]:
    return {
        "n": len(ms),
        "p50_ms": round(_pct(ms, 0.50), 2),
        "p99_ms": round(_pct(ms, 0.99), 2),
        "max_ms": round(max(ms), 2) if ms else float("nan"),
        "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan"),
    }


class Agent:
    def __init__(self, name: str, jobs: int) -> None:
        self.name = name
        self.jobs = [
            {
                "job": secrets.token_hex(6),
                "label": f"train-{i}",
                "user": "alice",
                "state": "running",
                "restored_from": None,
            }
            for i in range(jobs)
        ]
        self.beats = 0

    def heartbeat(self) -> dict[str, Any]:
        self.beats += 1
        activity = []
        if self.beats % 5 == 0:
            job = self.jobs[0]
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            activity.append(
                {
                    "kind": "checkpoint",
                    "checkpoint": f"{stamp}-{secrets.token_hex(3)}",
                    "label": job["label"],
                    "job": job["job"],
                    "user": "alice",
                    "size_bytes": 256 << 20,
                    "stored_size_bytes": 256 << 20,
                    "work_s": 60.0 * self.beats,
                    "duration_s": 0.4,
                    "frozen_s": 0.4,
                    "leave_running": True,
                    "store": "s3://bucket/ckpt",
                    "reason": "periodic",
                    "at": time.time(),
                }
            )
        return {"jobs": self.jobs, "activity": activity}


async def _run_period(
    url: str, token: str, agents: list[Agent], period_s: float, seconds: float, pid: int
) -> dict[str, Any]:
    beats: list[float] = []
    leases: list[float] = []
    health: list[float] = []
    errors: list[str] = []
    headers = {"Authorization": f"Bearer {token}"}
    stop = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as http:

        async def timed(
            method: str, path: str, body: Any, into: list[float], auth: bool = True
        ) -> None:
            t = time.perf_counter()
            try:
                async with http.request(
                    method, url + path, json=body, headers=headers if auth else None
                ) as r:
                    await r.read()
                    if r.status != 200:
                        errors.append(f"{path}: HTTP {r.status}")
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                errors.append(f"{path}: {type(e).__name__}")
                return
            into.append((time.perf_counter() - t) * 1000)

        async def agent(a: Agent, offset: float) -> None:
            await asyncio.sleep(offset)
            while time.monotonic() < stop:
                began = time.monotonic()
                await timed("POST", f"/api/v1/nodes/{a.name}/heartbeat", a.heartbeat(), beats)
                await timed("POST", f"/api/v1/nodes/{a.name}/commands/lease", {}, leases)
                await asyncio.sleep(max(0.0, period_s - (time.monotonic() - began)))

        async def probe() -> None:
            while time.monotonic() < stop:
                await timed("GET", "/api/v1/health", None, health, auth=False)
                await asyncio.sleep(0.5)

        cpu0, wall0 = _cpu_s(pid), time.monotonic()
        await asyncio.gather(
            probe(), *(agent(a, period_s * i / len(agents)) for i, a in enumerate(agents))
        )
        cpu1, wall1 = _cpu_s(pid), time.monotonic()
    wall = wall1 - wall0
    return {
        "heartbeat_s": period_s,
        "seconds": round(wall, 1),
        "requests_per_s": round((len(beats) + len(leases)) / wall, 1),
        "heartbeat": _summary(beats),
        "lease": _summary(leases),
        "health_baseline": _summary(health),
        "controlplane_cpu_pct": round(100 * (cpu1 - cpu0) / wall, 1),
        "errors": len(errors),
        "first_errors": errors[:5],
    }


def _call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    import urllib.request

    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode() if body else None,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.controlplane")
    p.add_argument("--agents", type=int, default=200)
    p.add_argument(
        "--heartbeat",
        default="10,2",
        help="seconds between an agent's heartbeats; " "a list runs one period each",
    )
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--jobs", type=int, default=4, help="live jobs each agent reports")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    periods = [float(x) for x in args.heartbeat.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-cp-"))
    os.chmod(root, 0o755)  # PostgreSQL runs as its own user beneath it
    pg = PostgresServer(root / "pg")
    pg.start()
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    token_file = root / "admin.token"
    log = (root / "controlplane.log").open("wb")
    cp = subprocess.Popen(
        [
            STASIS,
            "controlplane",
            "serve",
            "--db",
            pg.new_database(),
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-token-file",
            str(token_file),
            "--lost-after",
            "120",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "STASIS_CONFIG": "", "STASIS_STATE_DIR": str(root)},
    )
    try:
        deadline = time.monotonic() + 60
        while not token_file.exists() or not token_file.read_text().strip():
            if cp.poll() is not None or time.monotonic() > deadline:
                said = (root / "controlplane.log").read_text()
                raise SystemExit(f"the control plane did not start: {said}")
            time.sleep(0.2)
        admin = token_file.read_text().strip()
        while True:
            try:
                _call(url, admin, "GET", "/api/v1/health")
                break
            except OSError:
                time.sleep(0.2)
        cluster = _call(url, admin, "POST", "/api/v1/clusters", {"name": "bench", "kind": "slurm"})
        agents = [Agent(f"node-{i:03d}", args.jobs) for i in range(args.agents)]
        for a in agents:
            _call(
                url,
                cluster["token"],
                "POST",
                "/api/v1/nodes/register",
                {
                    "name": a.name,
                    "host": a.name,
                    "stasis_version": "bench",
                    "criu_version": "4.2",
                    "slurm_version": "22.05",
                    "check_ok": True,
                    "jobs": args.jobs,
                },
            )
        runs = [
            asyncio.run(_run_period(url, cluster["token"], agents, period, args.seconds, cp.pid))
            for period in periods
        ]
    finally:
        cp.terminate()
        cp.wait(timeout=30)
        pg.stop()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "stamp": stamp,
        "agents": args.agents,
        "jobs_per_agent": args.jobs,
        "database": "postgresql",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"controlplane-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Control plane under {args.agents} simulated node agents ({stamp})",
        "",
        f"PostgreSQL; {args.jobs} jobs per agent, a checkpoint report every 5th heartbeat; "
        f"{os.cpu_count()} CPUs shared by the control plane, PostgreSQL and the agents.",
        "",
        "| heartbeat every | req/s | heartbeat p50 / p99 ms | lease p50 / p99 ms | "
        "health (baseline) p50 / p99 ms | control plane CPU | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['heartbeat_s']:g} s | {r['requests_per_s']} | "
            f"{r['heartbeat']['p50_ms']} / {r['heartbeat']['p99_ms']} | "
            f"{r['lease']['p50_ms']} / {r['lease']['p99_ms']} | "
            f"{r['health_baseline']['p50_ms']} / {r['health_baseline']['p99_ms']} | "
            f"{r['controlplane_cpu_pct']}% | {r['errors']} |"
        )
    (args.out / f"controlplane-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
