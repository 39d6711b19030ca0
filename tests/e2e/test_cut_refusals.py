"""A job across nodes one of whose parts holds what no checkpoint can carry is refused by the
cut that would checkpoint it (issue 31), at the part's freeze (before CRIU runs anywhere):
`stasis.slurm.cut.take` raises CheckpointError in one line naming the part's node, the process
and what it holds; no checkpoint of the cut is listed on any node; every part is thawed and runs
on (the counter passed over TCP between them goes on, nothing lost or repeated). Two nodes of
their own (tests/nodes.py), each with a real daemon, sharing one store and one site key; the
parts are those of tests/e2e/test_jobnet_daemon.py, one of them with tests/workloads/holdfd.c
started beside its counter. The io_uring is real; the RDMA device is a stand-in (no adapter
here: a file at /dev/infiniband/uverbs0 in the holder's own mount namespace, as
tests/daemon/test_obstacles_refused.py does)."""

from __future__ import annotations

import os
import re
import shlex
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.client import Client
from stasis.daemon import jobnet, partcgroup
from stasis.errors import CheckpointError, StasisError
from stasis.slurm import cut
from tests.conftest import WORKLOADS, Daemon, new_daemon, wait_for
from tests.e2e.test_jobnet_daemon import _PORT, Job, _counted

# In the holder's own mount namespace, so that the node's /dev is left alone.
_STAND_IN = (
    "unshare --mount --propagation private sh -c 'mount -t tmpfs stand-in /dev && "
    "mkdir /dev/infiniband && : >/dev/infiniband/uverbs0 && exec \"$0\" "
    "/dev/infiniband/uverbs0' {holdfd}"
)


@pytest.fixture(scope="module")
def daemons(
    world_tmp: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Daemon, Daemon]]:
    # pytest's base directory made before the nodes: a node shares only what exists when it is
    # made, and the parts' logs are under it.
    tmp_path_factory.getbasetemp()
    key = world_tmp / f"cutrefusal-site-{os.urandom(4).hex()}.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    store = world_tmp / f"cutrefusal-store-{os.urandom(4).hex()}"
    store.mkdir()
    made: list[Daemon] = []
    try:
        for name in ("cr1", "cr2"):
            d = new_daemon(
                world_tmp, name, store=str(store), separate=True, env={"STASIS_SITE_KEY": str(key)}
            )
            d.start()
            made.append(d)
        yield made[0], made[1]
    finally:
        for d in made:
            d.kill_all()
            d.stop()
        key.unlink(missing_ok=True)


def _start(job: Job, server_holds: str, client_holds: str) -> tuple[str, str]:
    """The job's parts started as `Job.start` starts them, each part's counter with `holds` (a
    shell command, '' none) started beside it in its tree, its output in the logs' folder."""
    for d, part in ((job.a, job.server), (job.b, job.client)):
        assert d.node is not None
        jobnet.make_part(job.net, part, job.parts, underlay="eth0", on=d.node.prefix())
    script = shlex.quote(str(WORKLOADS / "jobcounter.py"))

    def run(d: Daemon, mode: str, holds: str, log: Path) -> str:
        beside = f"{holds} >{shlex.quote(str(log.with_suffix('.hold')))} 2>&1 & " if holds else ""
        answer = Client(d.socket).run(
            command=[
                "sh",
                "-c",
                f"{beside}exec python3 -u {script} {mode} {job.server.address} {_PORT}",
            ],
            cwd="/",
            log=str(log),
            label=f"cr-{mode}-{job.tag}",
            job_net=job.net.vni,
        )
        return answer["job"]

    server = run(job.a, "serve", server_holds, job.server_log)
    wait_for(lambda: "listening" in job.server_log.read_text(), 30, "the server listening")
    client = run(job.b, "count", client_holds, job.client_log)
    wait_for(lambda: len(_counted(job.client_log)) >= 20, 30, "the counter passed 20 times")
    return server, client


def _ticks(log: Path) -> int:
    return len(re.findall(r"^tick \d+$", log.read_text(), re.M))


def _holding(log: Path) -> None:
    wait_for(lambda: "holding fd 3" in log.read_text() and _ticks(log) >= 2, 30, "holdfd holding")


def _refused(job: Job, parts: list[cut.PartRef], holder: str, hold_log: Path) -> str:
    """The cut's one-line refusal, after which nothing of it is listed and every part runs on,
    thawed; `holder` the holding part's node."""
    label = f"cr-{job.tag}"
    cut_id = cut.new_cut_id()
    with pytest.raises(CheckpointError) as refused:
        cut.take(parts, label, timeout_s=30, cut_id=cut_id)
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith(f"no checkpoint of {label} taken: "), said
    assert f"its part on {holder} " in said and said.endswith("every part runs on"), said
    # Nothing of the cut listed, on either node.
    for p in parts:
        assert isinstance(p.client, Client)
        assert p.client.checkpoints(label=cut.cut_label(label, cut_id)) == []
        assert [m for m in p.client.checkpoints() if m["label"].startswith(label)] == []
    # Every part thawed, running on: the counter goes on, nothing lost or repeated, and the
    # holder holds on.
    for p in parts:
        assert isinstance(p.client, Client)
        assert not partcgroup.is_frozen(partcgroup.path_for(p.job))
        listed = p.client.job(p.job)
        assert listed["state"] == "running" and listed["frozen"] is False, listed
        with pytest.raises(StasisError, match=f"job {p.job} is not frozen"):
            p.client.thaw(p.job)
    before = _counted(job.client_log)
    wait_for(lambda: len(_counted(job.client_log)) >= len(before) + 20, 30, "the counter going on")
    numbers = [n for n, _ in _counted(job.client_log)]
    assert numbers == list(range(2, 2 + len(numbers)))
    ticks = _ticks(hold_log)
    wait_for(lambda: _ticks(hold_log) > ticks + 2, 10, "holdfd ticking on")
    # The holding part's daemon says the same before any freeze (`dump --check`); the other
    # part's sees nothing in the way.
    for p in parts:
        assert isinstance(p.client, Client)
        check = p.client.dump_check(p.job)
        if p.node == holder:
            assert len(check["obstacles"]) == 1 and check["obstacles"][0] in said, check
        else:
            assert check["obstacles"] == [], check
    return said


def _clean(job: Job) -> None:
    """Thaw the parts (a failed test may leave them frozen), end the holders (the daemon's kill
    ends a part's init, not what it started in the background), then the parts."""
    for j in (j["job"] for d in job.nodes for j in d.json("ps")):
        cgroup = partcgroup.path_for(j)
        if partcgroup.exists(cgroup):
            partcgroup.set_frozen(cgroup, False)
            for pid in partcgroup.tasks(cgroup):
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "holdfd":
                        os.kill(pid, signal.SIGKILL)
                except (FileNotFoundError, ProcessLookupError):
                    pass
    for d in job.nodes:
        d.kill_all()
    job.remove(*job.nodes)


def test_a_cut_with_a_part_holding_an_io_uring_is_refused(
    daemons: tuple[Daemon, Daemon], holdfd: Path, tmp_path: Path
) -> None:
    n1, n2 = daemons
    job = Job(n1, n2, tmp_path)
    try:
        server, client = _start(job, "", f"{shlex.quote(str(holdfd))} io_uring")
        hold_log = job.client_log.with_suffix(".hold")
        _holding(hold_log)
        parts = [
            cut.PartRef("cr1", Client(n1.socket), server),
            cut.PartRef("cr2", Client(n2.socket), client),
        ]
        said = _refused(job, parts, "cr2", hold_log)
        assert re.search(
            rf"its part on cr2 could not be frozen \(job {client} not frozen, it runs on: pid \d+ "
            r"\(holdfd io_uring\) holds an io_uring \(fd 3\), which CRIU cannot checkpoint",
            said,
        ), said
        assert "run it without io_uring" in said
    finally:
        _clean(job)


def test_a_cut_with_a_part_holding_an_rdma_device_is_refused(
    daemons: tuple[Daemon, Daemon], holdfd: Path, tmp_path: Path
) -> None:
    n1, n2 = daemons
    job = Job(n1, n2, tmp_path)
    try:
        server, client = _start(job, _STAND_IN.format(holdfd=shlex.quote(str(holdfd))), "")
        hold_log = job.server_log.with_suffix(".hold")
        _holding(hold_log)
        parts = [
            cut.PartRef("cr1", Client(n1.socket), server),
            cut.PartRef("cr2", Client(n2.socket), client),
        ]
        said = _refused(job, parts, "cr1", hold_log)
        assert re.search(
            rf"its part on cr1 could not be frozen \(job {server} not frozen, it runs on: pid \d+ "
            r"\(holdfd /dev/infiniband/uverbs0\) holds the RDMA device /dev/infiniband/uverbs0 \(fd 3\), which CRIU cannot checkpoint",
            said,
        ), said
        assert "run it over TCP" in said
    finally:
        _clean(job)
