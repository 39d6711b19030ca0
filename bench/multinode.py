"""`python -m bench.multinode`: a job that spans nodes (issue 31), checkpointed by one cut across
its nodes' daemons, against a one-node job of the same memory; and its network against the nodes'.

Nodes: three of their own on this machine (stasis/dev/nodehost.py: each its own network, mount
and UTS namespaces and an address on a private bridge), each with a real `stasis daemon`, all
sharing one store on disk. The nodes share this machine's kernel, CPUs and disk: what a node
does slows the others, unlike real hosts.

1. Coordinated freeze. For RANKS ranks over NODES nodes (every pair but 2 ranks over 3 nodes,
   where a node would hold none), a job network (stasis/daemon/jobnet.py, a VXLAN between the
   nodes) with one part per node, a daemon job run with `job_net` (its own freezer cgroup): a
   launcher that forks the node's ranks, dealt round robin. Each rank holds --rank-mib MiB of
   random bytes and keeps a TCP connection to each neighbour of a ring (2 ranks: one), on which
   it sends a counter every 10 ms. The cut is stasis.slurm.cut.take(leave_running=True): every
   part frozen, then each dumped frozen, then every one thawed; `Cut.frozen_s` from the first
   freeze asked to the last thaw answered. Beside it, each part's own dump in the same cut:
   CRIU's frozen_time (its stats-dump), CRIU's `duration_s` and the daemon's whole answer
   (`elapsed_s`: CRIU, then the checkpoint published, the part still frozen). The baseline, in
   the same run: the same ranks as one job on one node's daemon (connected over 127.0.0.1, no
   job network), dumped `leave_running` by that daemon; its frozen time is CRIU's own
   `frozen_time` (stats-dump, bench/stats.py). Both jobs run through a configuration's runs;
   which is measured first alternates run by run; after each dump every rank must still run. A
   cut or dump that fails is listed and left out of the medians (the work directory, with every
   daemon's and CRIU's logs, is then kept). Target: the cut's frozen time within 1.2x of the
   slowest part's CRIU frozen_time (what its node alone would keep it frozen for); cut / the
   slowest part's whole answer and cut / one-node are reported beside it.
2. Network. Between the namespaces of two parts of a job network on two nodes (job addresses)
   and between the same two nodes' own addresses (outside the job network): TCP ping-pong of
   64-byte messages (median round trip, TCP_NODELAY) and a bulk transfer (MB/s, 10^6 bytes),
   in turns, --net-runs times each. Target: the job network within 10% of the nodes' own.
   The probes are Python on both ends, pinned to one CPU (the same for both networks): its
   per-message cost is in the round trip.

Root only. Results: bench/results/multinode-<stamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Unpack

from bench.dest import available_bytes
from bench.procs import BenchError, LogTail
from bench.stats import read_dump_stats
from stasis import wire
from stasis.client import Client
from stasis.daemon import jobnet
from stasis.dev import nodehost
from stasis.errors import StasisError
from stasis.slurm import cut

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
STASIS = str(Path(sys.executable).parent / "stasis")
# Private networks of nodes: the local Slurm clusters take theirs from 20..219, the tests'
# nodes from 220..251.
NET_IDS = (252, 255)
NODES = 3
CONFIGS = ((2, 2), (4, 2), (8, 2), (2, 3), (4, 3), (8, 3))  # (ranks, nodes)
FREEZE_TARGET = 1.2  # cut frozen / the slowest part's own dump
NET_TARGET = 0.10  # the job network's latency and bandwidth within 10% of the nodes'
RANK_PORT = 7300
PROBE_PORT = 7900
# Both ends of a probe on one CPU, the same for both networks: left to the scheduler (the same CPU
# or two, a vCPU woken or not) the round trip moved between about 28 and 80 us from one probe to
# the next, whichever the network; on one CPU it holds within 1 us, and what is left is what the
# packets cost the kernel (the two ends of a pair of nodes share it here anyway).
_PIN_SERVER = ["taskset", "-c", "0"]
_PIN_CLIENT = ["taskset", "-c", "0"]

# A part: the ranks of one node, forked by this launcher (as an MPI launcher's daemon forks a
# node's ranks). argv[1]: {"addrs": every rank's address, "here": this node's ranks, "mib": M}.
# Each rank: M MiB of random bytes, a listener on its address, RANK_PORT + its rank; a
# connection to each ring neighbour (the lower rank connects); a counter sent on each every
# 10 ms. A broken connection ends the rank and the launcher with it (the job ends: seen).
RANKS = f"""\
import json, os, select, signal, socket, struct, sys, time
spec = json.loads(sys.argv[1])
addrs, here, mib = spec["addrs"], spec["here"], spec["mib"]
R = len(addrs)

def rank(i):
    held = os.urandom(mib << 20)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addrs[i], {RANK_PORT} + i))
    srv.listen(8)
    nbrs = sorted({{(i + 1) % R, (i - 1) % R}} - {{i}})
    conns = []
    for j in nbrs:
        if j > i:
            deadline = time.monotonic() + 60
            while True:
                try:
                    c = socket.create_connection((addrs[j], {RANK_PORT} + j), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            c.sendall(struct.pack("!I", i))
            conns.append(c)
    for _ in [j for j in nbrs if j < i]:
        c, _ = srv.accept()
        c.recv(4, socket.MSG_WAITALL)
        conns.append(c)
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.settimeout(None)
    print(f"ready rank {{i}} {{len(held)}}", flush=True)
    n = 0
    while True:
        n += 1
        for c in conns:
            c.sendall(struct.pack("!Q", n))
        readable, _, _ = select.select(conns, [], [], 0.01)
        for c in readable:
            if not c.recv(65536):
                print(f"error rank {{i}}: a neighbour closed its connection", flush=True)
                os._exit(1)

kids = []
for i in here:
    pid = os.fork()
    if pid == 0:
        try:
            rank(i)
        except BaseException as e:
            print(f"error rank {{i}}: {{e}}", flush=True)
        os._exit(1)
    kids.append(pid)
os.wait()
for pid in kids:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
sys.exit(1)
"""

# The network probe. `serve ADDR PORT`: connections one after another; first byte b"p": echo
# 64-byte messages to EOF; b"b": read to EOF, then answer b"k". `ping ADDR PORT N`: N round
# trips (the first tenth not counted); `bulk ADDR PORT BYTES`: BYTES sent, timed to the answer.
PROBE = """\
import json, socket, statistics, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
MSG = 64
if mode == "serve":
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(4)
    print("listening", flush=True)
    buf = bytearray(1 << 20)
    while True:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = c.recv(1)
        if kind == b"p":
            while True:
                m = c.recv(MSG, socket.MSG_WAITALL)
                if len(m) < MSG:
                    break
                c.sendall(m)
        elif kind == b"b":
            while c.recv_into(buf):
                pass
            c.sendall(b"k")
        c.close()
c = socket.create_connection((addr, port), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if mode == "ping":
    n = int(sys.argv[4])
    c.sendall(b"p")
    msg, rtts = b"x" * MSG, []
    for _ in range(n):
        t = time.perf_counter()
        c.sendall(msg)
        c.recv(MSG, socket.MSG_WAITALL)
        rtts.append(time.perf_counter() - t)
    rtts = rtts[n // 10:]
    print(json.dumps({"rtt_median_us": statistics.median(rtts) * 1e6, "count": len(rtts)}))
else:
    total, chunk = int(sys.argv[4]), memoryview(bytes(1 << 20))
    c.sendall(b"b")
    t = time.perf_counter()
    sent = 0
    while sent < total:
        c.sendall(chunk)
        sent += len(chunk)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    s = time.perf_counter() - t
    print(json.dumps({"mb_s": sent / s / 1e6, "bytes": sent, "seconds": s}))
"""


@dataclass
class Node:
    """A node of its own with its daemon (socket, state on the shared work directory)."""

    host: nodehost.NodeHost
    root: Path
    store: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def socket(self) -> Path:
        return self.root / "stasis.sock"

    @property
    def client(self) -> Client:
        return Client(self.socket)

    @property
    def stats(self) -> Path:
        """CRIU's stats-dump of the daemon's last dump."""
        return self.root / "state" / "criu-logs" / "stats-dump"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("STASIS_")}
        env.update(
            {
                "STASIS_SOCKET": str(self.socket),
                "STASIS_STATE_DIR": str(self.root / "state"),
                "STASIS_STORE": str(self.store),
                "STASIS_KEEP": "0",  # the bench deletes what it made
                "STASIS_CONFIG": "",
            }
        )
        with open(self.root / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.host.prefix(), STASIS, "daemon"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name}'s daemon exited; see {self.root / 'daemon.log'}")
            try:
                self.client.jobs()
                return
            except StasisError:
                time.sleep(0.1)
        raise BenchError(f"{self.name}'s daemon did not answer within 30 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill_all(self) -> None:
        for j in self.client.jobs():
            if j["state"] in ("running", "restored"):
                try:
                    self.client.kill(j["job"], timeout_s=5)
                except StasisError:
                    pass


class Recorded:
    """A part's daemon as the cut sees it (cut.PartDaemon), each call's start and end kept: the
    phases of the cut, and the part's own dump answer."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.times: dict[str, tuple[float, float]] = {}
        self.dumped: wire.DumpAnswer | None = None

    def _timed(self, what: str, call: Callable[[], Any]) -> Any:
        t = time.monotonic()
        answer = call()
        self.times[what] = (t, time.monotonic())
        return answer

    def freeze(self, job_id: str, **request: Unpack[wire.FreezeRequest]) -> wire.FreezeAnswer:
        answer: wire.FreezeAnswer = self._timed(
            "freeze", lambda: self.client.freeze(job_id, **request)
        )
        return answer

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer:
        self.dumped = self._timed("dump", lambda: self.client.dump(job_id, progress, **request))
        assert self.dumped is not None
        return self.dumped

    def thaw(self, job_id: str, **request: Unpack[wire.ThawRequest]) -> wire.ThawAnswer:
        answer: wire.ThawAnswer = self._timed("thaw", lambda: self.client.thaw(job_id, **request))
        return answer

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted:
        return self.client.delete_checkpoint(checkpoint_id)


@dataclass
class Site:
    net: nodehost.Net
    nodes: list[Node] = field(default_factory=list)

    def close(self) -> None:
        for n in self.nodes:
            try:
                if n.proc is not None and n.proc.poll() is None:
                    n.kill_all()
            except StasisError:
                pass
            n.stop()
            n.host.close()
        nodehost.leave_net(self.net)
        nodehost.release_net(self.net)


def _site(work: Path, count: int) -> Site:
    store = work / "store"
    store.mkdir()
    shared = sorted({str(work), str(ROOT), sys.prefix, sys.base_prefix})
    site = Site(nodehost.claim_net(*NET_IDS))
    try:
        for i in range(count):
            name = f"mn{i + 1}"
            root = work / name
            root.mkdir()
            host = nodehost.make_node(site.net, i, name, root, shared)
            site.nodes.append(Node(host, root, store))
            site.nodes[-1].start()
    except BaseException:
        site.close()
        raise
    return site


def _new_net() -> jobnet.JobNet:
    return jobnet.JobNet(
        vni=random.randrange(1000, 1_000_000),
        subnet=ipaddress.IPv4Network(f"10.97.{random.randrange(256)}.0/24"),
    )


@dataclass
class Job:
    """A daemon job and where its output goes."""

    node: Node
    id: str
    log: Path


def _start_ranks(
    node: Node, script: Path, addrs: list[str], here: list[int], mib: int, log: Path, vni: int
) -> Job:
    """A daemon job running ranks `here` on `node`; in job network `vni` (0: none)."""
    spec = json.dumps({"addrs": addrs, "here": here, "mib": mib})
    request = wire.RunRequest(
        command=[sys.executable, "-u", str(script), spec],
        cwd="/",
        log=str(log),
        label=f"bench-mn-{log.stem}",
    )
    if vni:
        request["job_net"] = vni
    answer = node.client.run(**request)
    return Job(node, answer["job"], log)


def _wait_ready(jobs: Sequence[tuple[Job, int]], mib: int) -> None:
    """Every rank of every job connected (each says `ready rank I`)."""
    deadline = time.monotonic() + 60 + mib * sum(c for _, c in jobs) / 32
    for job, count in jobs:
        while True:
            text = job.log.read_text() if job.log.exists() else ""
            errors = [ln for ln in text.splitlines() if ln.startswith("error")]
            if errors:
                raise BenchError(f"a rank of job {job.id} on {job.node.name} failed: {errors[0]}")
            if text.count("ready rank") >= count:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the ranks of job {job.id} on {job.node.name} not ready")
            time.sleep(0.1)


def _alive(jobs: Sequence[Job]) -> None:
    """Every job still running and no rank failed: its connections lived through the dumps."""
    for j in jobs:
        state = j.node.client.job(j.id)["state"]
        errors = [ln for ln in j.log.read_text().splitlines() if ln.startswith("error")]
        if state not in ("running", "restored") or errors:
            raise BenchError(
                f"job {j.id} on {j.node.name} is {state} after a dump: "
                f"{errors[0] if errors else 'see ' + str(j.log)}"
            )


def _cut_once(parts: list[Job]) -> dict[str, Any]:
    recorded = [Recorded(p.node.client) for p in parts]
    refs = [cut.PartRef(p.node.name, r, p.id) for p, r in zip(parts, recorded, strict=True)]
    for p in parts:
        p.node.stats.unlink(missing_ok=True)
    os.sync()
    taken = cut.take(refs, "bench-mn", leave_running=True, timeout_s=120)
    try:
        if taken.unfinished:
            raise BenchError(f"the cut left parts frozen: {taken.unfinished}")
        own: list[dict[str, Any]] = []
        for p, r in zip(parts, recorded, strict=True):
            assert r.dumped is not None
            st = read_dump_stats(p.node.stats)
            own.append(
                {
                    "node": p.node.name,
                    "criu_s": r.dumped["duration_s"],
                    "answer_s": r.dumped["elapsed_s"],
                    "criu_frozen_s": st.frozen_s,
                    "memdump_s": st.memdump_s,
                    "memwrite_s": st.memwrite_s,
                    "size_bytes": r.dumped["size_bytes"],
                    "staged": r.dumped["staged"],
                }
            )

        def phase(what: str) -> float:
            starts = [r.times[what][0] for r in recorded]
            ends = [r.times[what][1] for r in recorded]
            return max(ends) - min(starts)

        return {
            "frozen_s": taken.frozen_s,
            "freeze_phase_s": phase("freeze"),
            "dump_phase_s": phase("dump"),
            "thaw_phase_s": phase("thaw"),
            "slowest_frozen_s": max(o["criu_frozen_s"] for o in own),
            "slowest_criu_s": max(o["criu_s"] for o in own),
            "slowest_answer_s": max(o["answer_s"] for o in own),
            "parts": own,
        }
    finally:
        for p in parts:
            checkpoint = taken.checkpoints.get(p.node.name)
            if checkpoint:
                p.node.client.delete_checkpoint(checkpoint)


def _one_node_once(job: Job) -> dict[str, Any]:
    job.node.stats.unlink(missing_ok=True)
    os.sync()
    t = time.monotonic()
    answer = job.node.client.dump(job.id, leave_running=True, label="bench-mn-one")
    wall = time.monotonic() - t
    try:
        st = read_dump_stats(job.node.stats)
        return {
            "frozen_s": st.frozen_s,
            "criu_s": answer["duration_s"],
            "answer_s": answer["elapsed_s"],
            "wall_s": wall,
            "memdump_s": st.memdump_s,
            "memwrite_s": st.memwrite_s,
            "size_bytes": answer["size_bytes"],
            "staged": answer["staged"],
        }
    finally:
        job.node.client.delete_checkpoint(answer["checkpoint"])


def freeze_config(
    site: Site, script: Path, work: Path, ranks: int, nodes: int, mib: int, runs: int
) -> dict[str, Any]:
    used = site.nodes[:nodes]
    net = _new_net()
    on = {n.name: [i for i in range(ranks) if i % nodes == k] for k, n in enumerate(used)}
    layout = [
        jobnet.Part(net.address(k), ipaddress.IPv4Address(n.host.address))
        for k, n in enumerate(used)
    ]
    addrs = [str(net.address(i % nodes)) for i in range(ranks)]
    logs = work / f"r{ranks}n{nodes}"
    logs.mkdir()
    parts: list[Job] = []
    one: Job | None = None
    rows: list[dict[str, Any]] = []
    try:
        for k, n in enumerate(used):
            jobnet.make_part(net, layout[k], layout, underlay="eth0", on=n.host.prefix())
        for n in used:
            parts.append(
                _start_ranks(n, script, addrs, on[n.name], mib, logs / f"{n.name}.log", net.vni)
            )
        one = _start_ranks(
            used[0], script, ["127.0.0.1"] * ranks, list(range(ranks)), mib, logs / "one.log", 0
        )
        _wait_ready([*((p, len(on[p.node.name])) for p in parts), (one, ranks)], mib)
        for i in range(runs):
            # Each first in turn: neither always meets the machine warmer or colder.
            order = ["cut", "one"] if i % 2 == 0 else ["one", "cut"]
            row: dict[str, Any] = {"run": i}
            for what in order:
                try:
                    row[what] = _cut_once(parts) if what == "cut" else _one_node_once(one)
                except StasisError as e:
                    # Abandoned: every part runs on (cut.take's promise), the next run goes on.
                    row[what] = {"error": str(e)}
                    print(f"{ranks} ranks on {nodes} nodes, run {i}, {what}: {e}", file=sys.stderr)
                _alive([*parts, one])
            rows.append(row)
            c, o = row["cut"], row["one"]
            if "error" not in c and "error" not in o:
                print(
                    f"{ranks} ranks on {nodes} nodes, run {i}: cut frozen {c['frozen_s']:.3f} s "
                    f"(freeze {c['freeze_phase_s']:.3f}, dumps {c['dump_phase_s']:.3f}, thaw "
                    f"{c['thaw_phase_s']:.3f}; slowest part's CRIU frozen "
                    f"{c['slowest_frozen_s']:.3f}, answer {c['slowest_answer_s']:.3f}); one node "
                    f"frozen {o['frozen_s']:.3f} s",
                    file=sys.stderr,
                )
    finally:
        for j in [*parts, *([one] if one else [])]:
            try:
                j.node.client.kill(j.id, timeout_s=5)
            except StasisError:
                pass
        for n in used:
            jobnet.remove_part(net, on=n.host.prefix())
    return _freeze_summary(ranks, nodes, mib, rows)


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _freeze_summary(ranks: int, nodes: int, mib: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    failed = {
        what: [f"run {r['run']}: {r[what]['error']}" for r in rows if "error" in r[what]]
        for what in ("cut", "one")
    }
    out: dict[str, Any] = {
        "ranks": ranks,
        "nodes": nodes,
        "rank_mib": mib,
        "total_mib": ranks * mib,
        "failed_cuts": failed["cut"],
        "failed_one_node": failed["one"],
        "runs": rows,
    }
    cuts = [r["cut"] for r in rows if "error" not in r["cut"]]
    ones = [r["one"] for r in rows if "error" not in r["one"]]
    if not cuts or not ones:
        out["met"] = False
        return out
    cut_s = [c["frozen_s"] for c in cuts]
    slowest = [c["slowest_frozen_s"] for c in cuts]
    answer = [c["slowest_answer_s"] for c in cuts]
    one = [o["frozen_s"] for o in ones]
    # Cut by cut: against its own slowest part (measured in the same cut).
    per_run = [c / s for c, s in zip(cut_s, slowest, strict=True)]
    ratio = _med(per_run)
    out.update(
        {
            "cut_frozen_s": cut_s,
            "cut_frozen_median_s": _med(cut_s),
            "freeze_phase_median_s": _med([c["freeze_phase_s"] for c in cuts]),
            "dump_phase_median_s": _med([c["dump_phase_s"] for c in cuts]),
            "thaw_phase_median_s": _med([c["thaw_phase_s"] for c in cuts]),
            "slowest_part_frozen_s": slowest,
            "slowest_part_frozen_median_s": _med(slowest),
            "slowest_part_criu_median_s": _med([c["slowest_criu_s"] for c in cuts]),
            "slowest_part_answer_median_s": _med(answer),
            "one_node_frozen_s": one,
            "one_node_frozen_median_s": _med(one),
            "one_node_answer_median_s": _med([o["answer_s"] for o in ones]),
            "cut_over_slowest_part": ratio,
            "cut_over_slowest_part_runs": per_run,
            "cut_over_slowest_answer": _med([c / a for c, a in zip(cut_s, answer, strict=True)]),
            "cut_over_one_node": _med(cut_s) / _med(one),
            "met": ratio <= FREEZE_TARGET,
        }
    )
    return out


def _probe(prefix: list[str], script: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [*prefix, *_PIN_CLIENT, sys.executable, "-I", str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode:
        raise BenchError(f"probe {args[0]} failed: {done.stderr.strip()[-300:]}")
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def network(site: Site, probe: Path, work: Path, runs: int, pings: int, bulk_mib: int) -> Any:
    a, b = site.nodes[0], site.nodes[1]
    net = _new_net()
    layout = [
        jobnet.Part(net.address(k), ipaddress.IPv4Address(n.host.address))
        for k, n in enumerate((a, b))
    ]
    ways = {
        # (server's prefix, client's prefix, the server's address)
        "job": (
            [*a.host.prefix(), "nsenter", f"--net={net.netns_path}", "--"],
            [*b.host.prefix(), "nsenter", f"--net={net.netns_path}", "--"],
            str(layout[0].address),
        ),
        "nodes": (a.host.prefix(), b.host.prefix(), a.host.address),
    }
    servers: list[subprocess.Popen[str]] = []
    rows: list[dict[str, Any]] = []
    try:
        for k, n in enumerate((a, b)):
            jobnet.make_part(net, layout[k], layout, underlay="eth0", on=n.host.prefix())
        mtu = {way: _mtu(client) for way, (_, client, _) in ways.items()}
        for way, (server, _, addr) in ways.items():
            log = work / f"probe-{way}.log"
            with open(log, "w") as out:
                servers.append(
                    subprocess.Popen(
                        [
                            *server,
                            *_PIN_SERVER,
                            sys.executable,
                            "-I",
                            str(probe),
                            "serve",
                            addr,
                            str(PROBE_PORT),
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                    )
                )
            LogTail(log).wait_line("listening", 30)
        for i in range(runs):
            for way in ("job", "nodes") if i % 2 == 0 else ("nodes", "job"):
                _, client, addr = ways[way]
                ping = _probe(client, probe, "ping", addr, str(PROBE_PORT), str(pings))
                bulk = _probe(client, probe, "bulk", addr, str(PROBE_PORT), str(bulk_mib << 20))
                rows.append(
                    {"run": i, "way": way, "rtt_us": ping["rtt_median_us"], "mb_s": bulk["mb_s"]}
                )
                print(
                    f"network run {i} {way}: rtt {ping['rtt_median_us']:.1f} us, "
                    f"{bulk['mb_s']:.0f} MB/s",
                    file=sys.stderr,
                )
    finally:
        for s in servers:
            s.kill()
            s.wait()
        for n in (a, b):
            jobnet.remove_part(net, on=n.host.prefix())
    rtt = {w: _med([r["rtt_us"] for r in rows if r["way"] == w]) for w in ways}
    mbs = {w: _med([r["mb_s"] for r in rows if r["way"] == w]) for w in ways}
    rtt_ratio, bw_ratio = rtt["job"] / rtt["nodes"], mbs["job"] / mbs["nodes"]
    return {
        "runs": runs,
        "pings": pings,
        "bulk_mib": bulk_mib,
        "rtt_median_us": rtt,
        "mb_s_median": mbs,
        "rtt_job_over_nodes": rtt_ratio,
        "mb_s_job_over_nodes": bw_ratio,
        "rtt_met": rtt_ratio <= 1 + NET_TARGET,
        "mb_s_met": bw_ratio >= 1 - NET_TARGET,
        "mtu": mtu,
        "rows": rows,
    }


def _mtu(prefix: list[str]) -> int:
    done = subprocess.run(
        [*prefix, "ip", "-j", "link", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    )
    mtu: int = json.loads(done.stdout)[0]["mtu"]
    return mtu


def run(
    configs: list[tuple[int, int]],
    mib: int,
    runs: int,
    net_runs: int,
    pings: int,
    bulk_mib: int,
    out: Path,
) -> Path:
    biggest = max(r for r, _ in configs) if configs else 0
    # The job and the one-node job at once, each dump's pages in the page cache, and margin.
    need = 4 * biggest * (mib << 20) + (1 << 30)
    if available_bytes() < need:
        raise BenchError(f"{biggest} ranks of {mib} MiB need about {need >> 20} MiB available")
    work = Path(tempfile.mkdtemp(prefix="stasis-bench-multinode-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    script, probe = work / "ranks.py", work / "probe.py"
    script.write_text(RANKS)
    probe.write_text(PROBE)
    freeze: list[dict[str, Any]] = []
    skipped: list[str] = []
    started = time.monotonic()
    site = _site(work, max([NODES, *(n for _, n in configs)]))
    kept = False
    try:
        for ranks, nodes in configs:
            if ranks < nodes:
                skipped.append(f"{ranks} ranks on {nodes} nodes: a node would have none")
                continue
            freeze.append(freeze_config(site, script, work, ranks, nodes, mib, runs))
        net = network(site, probe, work, net_runs, pings, bulk_mib) if net_runs else None
        kept = any(f["failed_cuts"] or f["failed_one_node"] for f in freeze)
    except BaseException:
        kept = True
        raise
    finally:
        site.close()
        if kept:
            # The daemons' and CRIU's logs of what failed (the CRIU log each error names).
            shutil.rmtree(work / "store", ignore_errors=True)
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    meta = {
        "rank_mib": mib,
        "runs": runs,
        "freeze_target": FREEZE_TARGET,
        "net_target": NET_TARGET,
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "skipped": skipped,
        "logs_kept": str(work) if kept else None,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    result = {"meta": meta, "freeze": freeze, "network": net}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"multinode-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = out / f"multinode-{stamp}.md"
    md.write_text(markdown(result, stamp))
    return md


def markdown(r: dict[str, Any], stamp: str) -> str:
    m = r["meta"]
    lines = [
        f"# A job across nodes: coordinated freeze and job network ({stamp})",
        "",
        f"Three nodes of their own on one machine ({m['cpus']} CPUs, kernel {m['kernel']}: one "
        "kernel, CPUs and disk for all), a stasis daemon on each, one store on disk. Ranks dealt "
        f"round robin over the nodes, {m['rank_mib']} MiB of random bytes each, a TCP ring "
        "between neighbours in the job network; one part (daemon job) per node. Medians of "
        f"{m['runs']} runs; the cut and the one-node job measured in turns.",
        "",
        "## Coordinated freeze (leave-running cut)",
        "",
        "cut: `stasis.slurm.cut.take`'s frozen time, first freeze asked to last thaw answered, "
        "and its phases (first call to last answer of each). slowest part: the largest CRIU "
        "frozen_time (stats-dump) among the parts' dumps in that cut, what its node alone "
        "would have kept it frozen for; slowest answer: the largest whole dump answer (CRIU, "
        "then the checkpoint published to the store, the part still frozen). one "
        "node: the same ranks as one job on one node, CRIU's frozen_time of its leave-running "
        f"dump by its daemon. Target: cut / slowest part <= {m['freeze_target']:g} (median of "
        "the runs' ratios).",
        "",
        "| ranks | nodes | MiB | cut s (min-max) | freeze / dumps / thaw s | slowest part s "
        "| slowest answer s | one node s | cut / slowest part | cut / slowest answer "
        "| cut / one node | target |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    failures: list[str] = []
    for f in r["freeze"]:
        what = f"{f['ranks']} ranks on {f['nodes']} nodes"
        failures += [f"{what}, cut {e}" for e in f["failed_cuts"]]
        failures += [f"{what}, one node {e}" for e in f["failed_one_node"]]
        if "cut_frozen_s" not in f:
            lines.append(
                f"| {f['ranks']} | {f['nodes']} | {f['total_mib']} | every run failed "
                "| | | | | | | | NOT met |"
            )
            continue
        c = f["cut_frozen_s"]
        lines.append(
            f"| {f['ranks']} | {f['nodes']} | {f['total_mib']} | "
            f"{f['cut_frozen_median_s']:.3f} ({min(c):.3f}-{max(c):.3f}) | "
            f"{f['freeze_phase_median_s']:.3f} / {f['dump_phase_median_s']:.3f} / "
            f"{f['thaw_phase_median_s']:.3f} | {f['slowest_part_frozen_median_s']:.3f} | "
            f"{f['slowest_part_answer_median_s']:.3f} | {f['one_node_frozen_median_s']:.3f} | "
            f"{f['cut_over_slowest_part']:.2f} | {f['cut_over_slowest_answer']:.2f} | "
            f"{f['cut_over_one_node']:.2f} | {'met' if f['met'] else 'NOT met'} |"
        )
    if failures:
        lines += ["", "Failed (not in the medians; each abandoned, every part ran on):"]
        lines += [f"- {e}" for e in failures]
    for s in m["skipped"]:
        lines.append(f"\nSkipped: {s}.")
    n = r["network"]
    if n:
        lines += [
            "",
            "## Job network against the nodes' own",
            "",
            f"Two nodes; Python probes on both ends; medians of {n['runs']} runs each, in turns. "
            f"Round trip: {n['pings']} ping-pongs of 64 bytes (first tenth not counted); "
            f"bandwidth: {n['bulk_mib']} MiB in one TCP stream. MTU {n['mtu']['job']} in "
            f"the job network (VXLAN), {n['mtu']['nodes']} on the nodes'. Target: within "
            f"{r['meta']['net_target']:.0%}.",
            "",
            "| | job network | nodes' own | job / nodes | target |",
            "|---|---:|---:|---:|---|",
            f"| round trip (us) | {n['rtt_median_us']['job']:.1f} | "
            f"{n['rtt_median_us']['nodes']:.1f} | {n['rtt_job_over_nodes']:.2f} | "
            f"{'met' if n['rtt_met'] else 'NOT met'} |",
            f"| bandwidth (MB/s) | {n['mb_s_median']['job']:.0f} | "
            f"{n['mb_s_median']['nodes']:.0f} | {n['mb_s_job_over_nodes']:.2f} | "
            f"{'met' if n['mb_s_met'] else 'NOT met'} |",
        ]
    lines += ["", f"Whole run: {m['elapsed_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        ranks, _, nodes = item.partition("x")
        if not (ranks.isdigit() and nodes.isdigit()):
            raise SystemExit(f"--configs: {item!r} is not RANKSxNODES (e.g. 4x2)")
        out.append((int(ranks), int(nodes)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.multinode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--configs",
        default=",".join(f"{r}x{n}" for r, n in CONFIGS),
        help="RANKSxNODES, comma separated (default: %(default)s)",
    )
    p.add_argument("--rank-mib", type=int, default=64, help="random MiB each rank holds")
    p.add_argument("--runs", type=int, default=5, help="cuts (and one-node dumps) per config")
    p.add_argument("--net-runs", type=int, default=5, help="0: no network measurement")
    p.add_argument("--pings", type=int, default=5000)
    p.add_argument("--bulk-mib", type=int, default=512)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("python -m bench.multinode: root only (nodes, CRIU)")
    try:
        md = run(
            _configs(args.configs),
            args.rank_mib,
            args.runs,
            args.net_runs,
            args.pings,
            args.bulk_mib,
            args.out,
        )
    except BenchError as e:
        raise SystemExit(f"python -m bench.multinode: {e}") from None
    print(md.read_text())
    print(f"results: {md} and {md.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
