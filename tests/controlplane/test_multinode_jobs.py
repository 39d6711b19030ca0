"""A Slurm job on several nodes is one job in the control plane (issue 31): its batch node
reports the Slurm job, each of its nodes the parts it runs (daemon jobs labelled
`slurm-<job>-part-<key>`); `stasis controlplane jobs`, GET /api/v1/jobs and the dashboard's
Jobs page (headless Chromium) show one row with its parts per node, offer no migration of it,
and keep every other job as it was.

Nodes node-a and node-b are real daemons, their parts real jobs under the part labels the
launch agent gives (stasis.slurm.partnames). The batch node is spoken by the test
(tests/controlplane/fakenode.py): its Slurm registration needs a Slurm job on it
(tests/e2e/test_mpi_cut.py runs one for real)."""

from __future__ import annotations

import pwd
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from stasis.controlplane import jobgroups
from stasis.slurm import partnames
from tests.conftest import Daemon, new_daemon, wait_for, workload
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.fakenode import FakeNode
from tests.controlplane.test_dashboard import browser, shot  # noqa: F401 (a fixture)
from tests.controlplane.test_node import node_env

KEY_A, KEY_B, KEY_BATCH = "0000aaaa", "0000bbbb", "0000cccc"


@contextmanager
def cluster_nodes(
    cp: ControlPlane, world_tmp: Path, site_key: Path
) -> Iterator[tuple[dict[str, str], dict[str, Daemon]]]:
    """Cluster hpc and its real nodes node-a and node-b (a store they share, one site key)."""
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    store = Path(tempfile.mkdtemp(prefix="shared-store-", dir=world_tmp))
    daemons = {
        n: new_daemon(
            world_tmp,
            n,
            store=str(store),
            env={**node_env(cp, cluster, n), "STASIS_SITE_KEY": str(site_key)},
        )
        for n in ("node-a", "node-b")
    }
    started = []
    try:
        for d in daemons.values():
            d.start()
            started.append(d)
        yield cluster, daemons
    finally:
        for d in started:
            d.kill_all()
            d.stop()


def grouped_row(cp: ControlPlane, job: str) -> dict[str, Any] | None:
    rows = [j for j in cp.json("jobs") if j["job"] == job and j.get("parts")]
    return rows[0] if len(rows) == 1 else None


def test_the_part_pattern_is_partnames() -> None:
    label = partnames.part_label("12", "0a1b2c3d")
    assert jobgroups.PART_LABEL.fullmatch(label)
    assert partnames.part_of(label) == ("12", "0a1b2c3d")
    for other in ("slurm-12-part-0A1B2C3D", "slurm-12-part-0a1b2c3", "slurm-x-part-0a1b2c3d"):
        assert partnames.part_of(other) is None and not jobgroups.PART_LABEL.fullmatch(other)


@SQLITE_ONLY
def test_a_slurm_job_on_three_nodes_is_one_job(
    controlplane: ControlPlane,
    world_tmp: Path,
    site_key: Path,
    browser: WebDriver,  # noqa: F811 (the fixture)
    test_user: pwd.struct_passwd,
) -> None:
    cp, driver, user = controlplane, browser, test_user.pw_name
    with cluster_nodes(cp, world_tmp, site_key) as (cluster, nodes):
        a, b = nodes["node-a"], nodes["node-b"]
        part_a = a.run(*workload("counter.py"), label=partnames.part_label("12", KEY_A), user=user)
        part_b = b.run(*workload("counter.py"), label=partnames.part_label("12", KEY_B), user=user)
        web = a.run(*workload("counter.py"), label="web", user=user)["job"]
        # Slurm job 13: parts on node-a and node-b, and no node reporting its batch step.
        orphan_a = a.run(
            *workload("counter.py"), label=partnames.part_label("13", KEY_B), user=user
        )
        orphan_b = b.run(
            *workload("counter.py"), label=partnames.part_label("13", KEY_A), user=user
        )
        # The batch node n1: the Slurm job's registration (its batch tree) and its own part.
        batch = FakeNode(cp, cluster, "n1")
        batch.register()

        def beat() -> bool:
            batch.heartbeat(
                [
                    {
                        "job": "12",
                        "kind": "slurm",
                        "label": "mpi-12",
                        "partition": "debug",
                        "rss_bytes": 1000,
                    },
                    {"job": "d7", "label": partnames.part_label("12", KEY_BATCH), "rss_bytes": 10},
                ]
            )
            # (every node's report in: job 12's three parts, job 13's two)
            listed = cp.json("jobs")
            return len(listed) == 3 and sorted(len(j.get("parts", [])) for j in listed) == [0, 2, 3]

        wait_for(beat, 30, f"one row for Slurm job 12: {cp.json('jobs')}")
        listed = cp.json("jobs")
        assert sorted((j["job"], j["node"]) for j in listed) == sorted(
            [("12", "n1"), (web, "node-a"), ("13", "node-a")]
        )
        whole = next(j for j in listed if j["job"] == "12")
        assert (whole["kind"], whole["label"], whole["partition"]) == ("slurm", "mpi-12", "debug")
        assert whole["batch_node"] == "n1" and whole["nodes"] == ["n1", "node-a", "node-b"]
        assert [(p["node"], p["key"], p["job"], p["state"]) for p in whole["parts"]] == [
            ("n1", KEY_BATCH, "d7", "running"),
            ("node-a", KEY_A, part_a["job"], "running"),
            ("node-b", KEY_B, part_b["job"], "running"),
        ]
        assert whole["rss_bytes"] >= 1010 + 2 * 1024 * 1024  # the parts' memory counted in
        headless = next(j for j in listed if j["job"] == "13")
        assert headless["batch_node"] is None and headless["kind"] == "slurm"
        assert [(p["node"], p["key"], p["job"]) for p in headless["parts"]] == [
            ("node-a", KEY_B, orphan_a["job"]),
            ("node-b", KEY_A, orphan_b["job"]),
        ]
        assert headless["nodes"] == ["node-a", "node-b"] and headless["user"] == user
        plain = next(j for j in listed if j["job"] == web)
        assert "parts" not in plain and plain["label"] == "web"

        # The admin CLI's table: one line for job 12, its parts as NODE:KEY.
        lines = cp.cli("jobs").stdout.splitlines()
        header = lines[0].split("\t")
        (line,) = [x.split("\t") for x in lines[1:] if x.split("\t")[2] == "12"]
        row = dict(zip(header, line))
        assert row["node"] == "n1"
        assert row["parts"] == f"n1:{KEY_BATCH},node-a:{KEY_A},node-b:{KEY_B}"
        assert not any(partnames.part_of(x.split("\t")[3]) for x in lines[1:])

        # The dashboard: one row, its nodes and parts; no migration of it, the others' as ever.
        driver.get(cp.url + "/ui/login")
        driver.find_element(By.ID, "token").send_keys(cp.admin)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.current_url.endswith("/ui/"), 10, "the nodes page")
        driver.get(cp.url + "/ui/jobs")
        wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, '#jobs tr[data-job="12"]'),
            30,
            "Slurm job 12 on the jobs page",
        )
        shot(driver, "jobs-multinode")
        (tr,) = driver.find_elements(By.CSS_SELECTOR, '#jobs tr[data-job="12"]')
        assert tr.get_attribute("data-node") == "n1"
        assert tr.get_attribute("data-nodes") == "n1,node-a,node-b"
        items = tr.find_elements(By.CSS_SELECTOR, "ul.parts li")
        assert [i.get_attribute("data-part-node") for i in items] == ["n1", "node-a", "node-b"]
        assert re.search(rf"n1 \(batch\): part {KEY_BATCH} \(running\)", items[0].text)
        assert [
            s.get_attribute("data-part-job") for s in tr.find_elements(By.CSS_SELECTOR, ".part")
        ] == ["d7", part_a["job"], part_b["job"]]
        assert tr.find_elements(By.CSS_SELECTOR, "button.checkpoint")
        assert not tr.find_elements(By.CSS_SELECTOR, "select.to, button.migrate")
        (tr13,) = driver.find_elements(By.CSS_SELECTOR, '#jobs tr[data-job="13"]')
        assert not tr13.find_elements(By.CSS_SELECTOR, "button")
        assert "no node reports this Slurm job's batch step" in tr13.text
        assert tr13.find_elements(By.TAG_NAME, "td")[5].text == "-"  # its label: none known
        (tr_web,) = driver.find_elements(By.CSS_SELECTOR, f'#jobs tr[data-job="{web}"]')
        assert tr_web.find_elements(By.CSS_SELECTOR, "select.to")
        # No part of a Slurm job shown as a job of its own.
        shown = [
            e.get_attribute("data-label") or ""
            for e in driver.find_elements(By.CSS_SELECTOR, "#jobs tr[data-job]")
        ]
        assert not any(partnames.part_of(label) for label in shown), shown

        # A part ending on node-b: the job's row loses it there, and stays one row.
        b.cli("kill", part_b["job"])
        wait_for(
            lambda: (w := grouped_row(cp, "12")) is not None
            and [p["node"] for p in w["parts"]] == ["n1", "node-a"]
            and w["nodes"] == ["n1", "node-a"],
            30,
            "node-b's part gone from job 12",
        )
