"""A real node daemon carries out the control plane's `verify` commands with real CRIU (a
checkpoint restored in a sandbox, checked, removed: stasis.daemon.verifying) and reports the
verdict: seen in the API, the CLI and, in a real browser, on the dashboard's Checkpoints page;
a checkpoint whose images were damaged fails with its reason. A node that verifies its new
checkpoints by itself (`verify_new_checkpoints`) reports those verdicts in its heartbeats, no
command asked."""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.conftest import new_daemon, wait_for, workload
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.test_commands import site_nodes
from tests.controlplane.test_dashboard import browser, shot  # noqa: F401 (a fixture)
from tests.controlplane.test_node import node_env

T = TypeVar("T")


def listed(cp: ControlPlane) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in cp.json("checkpoints")}


def damage(store: Path, checkpoint: str) -> None:
    """One byte of the checkpoint's largest pages image flipped, in the store."""
    pages = max(
        (p for p in (store / checkpoint).iterdir() if p.name.startswith("pages")),
        key=lambda p: p.stat().st_size,
    )
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def counted(d: Any, job: str) -> int:
    numbers = d.log_of(job).split()
    return int(numbers[-1]) if numbers else -1


# SQLite only: the verdicts' SQL runs on both databases in test_verify.
@SQLITE_ONLY
def test_a_node_verifies_for_the_control_plane_and_the_dashboard_shows_it(
    site_controlplane: ControlPlane,
    world_tmp: Path,
    site_key: Path,
    browser: WebDriver,
    test_user: pwd.struct_passwd,
) -> None:
    cp, driver = site_controlplane, browser
    with site_nodes(cp, world_tmp, site_key, "node-a", separate=True) as nodes:
        a = nodes["node-a"]
        good_job = a.run(*workload("counter.py"), label="v-good", user=test_user.pw_name)["job"]
        bad_job = a.run(*workload("counter.py"), label="v-bad", user=test_user.pw_name)["job"]
        wait_for(lambda: counted(a, good_job) >= 2 and counted(a, bad_job) >= 2, 30, "the counters")
        good = a.json("dump", "--leave-running", good_job)["checkpoint"]
        bad = a.json("dump", bad_job)["checkpoint"]
        damage(Path(a.store), bad)
        wait_for(lambda: {good, bad} <= set(listed(cp)), 30, "the checkpoints reported")
        assert {listed(cp)[c]["verified"] for c in (good, bad)} == {"not verified"}

        cp.json(
            "policies",
            "add",
            "known-good",
            "--on",
            "webhook",
            "--action",
            "verify",
            "--label",
            "v-*",
        )
        assert cp.json("policies", "run", "known-good") == {"name": "known-good", "queued": 2}
        wait_for(
            lambda: all(listed(cp)[c]["verdict"] for c in (good, bad)),
            120,
            f"both verdicts: {cp.json('actions')}",
        )
        seen = listed(cp)
        assert seen[good]["verified"] == "ok", seen[good]
        assert (seen[good]["verdict"]["node"], seen[good]["verdict"]["processes"]) == (
            "node-a",
            2,
        )  # stasis-init and the counter
        reason = seen[bad]["verdict"]["reason"]
        assert seen[bad]["verified"] == f"failed: {reason}"
        assert bad in reason and "pages" in reason, reason
        # What the node's own catalog holds (signed) is what the control plane shows.
        mine = {c["id"]: c.get("verdict") for c in a.json("checkpoints")}
        assert (mine[good]["ok"], mine[bad]["ok"], mine[bad]["reason"]) == (True, False, reason)
        states = {
            c["args"]["checkpoint"]: (c["state"], c["result"])
            for c in cp.json("actions")
            if c["kind"] == "verify"
        }
        assert states[good][0] == "done" and states[bad][0] == "failed"
        assert states[bad][1]["error"] == f"checkpoint {bad} does not restore: {reason}"
        # The job the good checkpoint came from ran on, untouched, counting.
        before = counted(a, good_job)
        wait_for(lambda: counted(a, good_job) > before + 2, 30, "the job counting on")
        assert a.job(good_job)["state"] == "running"
        # Each label's newest is verified: nothing more to do.
        assert cp.json("policies", "run", "known-good")["queued"] == 0
        # One checkpoint verified by hand: the CLI waits for the verdict; a failed one is one
        # line and exit 1.
        r = cp.cli("verify", good)
        assert r.returncode == 0 and r.stdout.startswith(
            f"checkpoint {good} verified on node node-a: it restores (2 process(es) in "
        ), r
        r = cp.cli("verify", bad)
        assert (r.returncode, r.stderr.strip()) == (
            1,
            f"stasis: error: checkpoint {bad} failed verification on node node-a: {reason}",
        )
        newer = a.json("dump", "--leave-running", good_job)["checkpoint"]
        wait_for(lambda: newer in listed(cp), 30, "the newer checkpoint reported")

        driver.get(cp.url + "/ui/login")
        driver.find_element(By.ID, "token").send_keys(cp.admin)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.current_url.endswith("/ui/"), 10, "the nodes page")
        driver.get(cp.url + "/ui/checkpoints")

        def steady(read: Callable[[], T]) -> T:
            # The live refresh replaces the table every 2 s: an element found a moment ago may
            # be gone by the time it is read; read it again.
            for _ in range(20):
                try:
                    return read()
                except StaleElementReferenceException:
                    continue
            raise AssertionError("the page kept changing under every read")

        def cell(checkpoint: str) -> tuple[str, str]:
            def read() -> tuple[str, str]:
                found = driver.find_elements(
                    By.CSS_SELECTOR, f'#checkpoints tr[data-checkpoint="{checkpoint}"]'
                )
                if not found:
                    return "", ""
                return (
                    str(found[0].get_attribute("data-verified")),
                    found[0].find_element(By.CSS_SELECTOR, "td.verdict").text,
                )

            return steady(read)

        wait_for(lambda: cell(good)[0] == "ok", 30, "the good verdict on the page")
        assert cell(good) == ("ok", "ok")
        assert cell(bad) == ("failed", f"failed: {reason}")
        head = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#checkpoints th")]
        assert head[-2] == "Verified"
        assert cell(newer) == ("none", "not verified")
        for _ in range(5):  # the live refresh may replace the row under the click
            try:
                driver.find_element(
                    By.CSS_SELECTOR, f'#checkpoints tr[data-checkpoint="{newer}"]' " button.verify"
                ).click()
                break
            except StaleElementReferenceException:
                continue
        wait_for(
            lambda: steady(
                lambda: any(
                    f"verify of checkpoint {newer} asked on node node-a" in e.text
                    for e in driver.find_elements(By.CSS_SELECTOR, ".flash")
                )
            ),
            10,
            "the message",
        )
        wait_for(lambda: cell(newer)[0] == "ok", 60, "the new verdict on the page")
        shot(driver, "checkpoints-verified")
        # The Jobs page says whether the running job's last checkpoint is known to restore.
        driver.get(cp.url + "/ui/jobs")
        row = f'#jobs tr[data-job="{good_job}"] span.verdict'
        wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, row), 30, "the job's row")
        assert steady(lambda: driver.find_element(By.CSS_SELECTOR, row).text) == "verified"
        a.cli("kill", good_job)


@SQLITE_ONLY
def test_a_node_reports_its_background_verdicts(
    site_controlplane: ControlPlane, world_tmp: Path, test_user: pwd.struct_passwd
) -> None:
    cp = site_controlplane
    cluster = cp.json("clusters", "add", "hpc", "--kind", "slurm")
    d = new_daemon(
        world_tmp,
        "node-v",
        separate=True,
        env={**node_env(cp, cluster, "node-v"), "STASIS_VERIFY_NEW_CHECKPOINTS": "1"},
    )
    d.start()
    try:
        job = d.run(*workload("counter.py"), label="v-bg", user=test_user.pw_name)["job"]
        wait_for(lambda: counted(d, job) >= 2, 30, "the counter")
        ckpt = d.json("dump", "--leave-running", job)["checkpoint"]
        wait_for(
            lambda: (listed(cp).get(ckpt) or {}).get("verdict"),
            120,
            "the background verdict reported",
        )
        c = listed(cp)[ckpt]
        assert (c["verified"], c["verdict"]["node"]) == ("ok", "node-v"), c
        assert not [a for a in cp.json("actions") if a["kind"] == "verify"]  # none asked
        d.cli("kill", job)
    finally:
        d.kill_all()
        d.stop()
