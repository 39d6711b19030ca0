"""The dashboard in a real browser: Debian's headless chromium, driven by Selenium through
Debian's chromium-driver, against a control plane with two real node daemons. Log in with the
token, see the running job, "Checkpoint now", see the checkpoint appear (the page refreshes
itself), migrate the job, see it running on the other node, its count gone on. Screenshots of
the main pages are kept under build/test-artifacts/dashboard/ (STASIS_TEST_ARTIFACTS).

Then the dashboard's defences, over plain HTTP: sessions expire and die with their token, forms
without the session's CSRF token or from another origin are refused, hostile input is shown
escaped, a cluster token sees only its cluster and cannot act."""

from __future__ import annotations

import html.parser
import http.cookiejar
import json
import os
import pwd
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from tests.conftest import wait_for, workload
from tests.controlplane.conftest import SQLITE_ONLY, ControlPlane
from tests.controlplane.test_commands import site_nodes

ARTIFACTS = (
    Path(
        os.environ.get("STASIS_TEST_ARTIFACTS")
        or Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
    )
    / "dashboard"
)


@pytest.fixture
def browser(world_tmp: Path) -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    # Root in a container: no sandbox; the rest keeps chromium off the (closed) network.
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,900",
        f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-', dir=world_tmp)}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def rows(driver: WebDriver, css: str) -> list[dict[str, str]]:
    """The data-* attributes of the rows `css` finds, read again if the page refreshed them."""
    for _ in range(5):
        try:
            return [
                {
                    k: str(e.get_attribute(f"data-{k}") or "")
                    for k in ("job", "node", "label", "checkpoint", "state")
                }
                for e in driver.find_elements(By.CSS_SELECTOR, css)
            ]
        except StaleElementReferenceException:
            continue
    return []


def shown(driver: WebDriver, text: str) -> None:
    """`text` in a message of the page the last click led to (once it has loaded)."""

    def found() -> bool:
        try:
            return any(text in e.text for e in driver.find_elements(By.CSS_SELECTOR, ".flash"))
        except StaleElementReferenceException:
            return False

    wait_for(found, 10, f"the message {text!r}")


def click_in_row(driver: WebDriver, row_css: str, button_css: str) -> None:
    for _ in range(5):
        try:
            driver.find_element(By.CSS_SELECTOR, f"{row_css} {button_css}").click()
            return
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"could not click {button_css} in {row_css}")


# SQLite only: the browser drives the API whose commands test_commands runs on both.
@SQLITE_ONLY
def test_the_dashboard_checkpoints_and_migrates_a_job_from_the_browser(
    controlplane: ControlPlane,
    world_tmp: Path,
    site_key: Path,
    browser: WebDriver,
    test_user: pwd.struct_passwd,
) -> None:
    cp, driver = controlplane, browser
    with site_nodes(cp, world_tmp, site_key, "node-a", "node-b") as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        job = a.run(*workload("counter.py"), label="web", user=test_user.pw_name)["job"]
        driver.get(cp.url + "/ui/jobs")
        assert driver.current_url.endswith("/ui/login")  # not logged in yet
        shot(driver, "login")
        driver.find_element(By.ID, "token").send_keys("stasis_wrong")
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.find_elements(By.ID, "error"), 10, "the log-in's error")
        assert "unknown token" in driver.find_element(By.ID, "error").text
        driver.find_element(By.ID, "token").send_keys(cp.admin)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.current_url.endswith("/ui/"), 10, "the nodes page")
        wait_for(
            lambda: {r["node"] for r in rows(driver, "#nodes tr[data-node]")}
            == {"node-a", "node-b"},
            30,
            "both nodes on the page",
        )
        shot(driver, "nodes")

        driver.get(cp.url + "/ui/jobs")
        mine = f'#jobs tr[data-job="{job}"]'
        wait_for(lambda: rows(driver, mine), 30, "the running job on the jobs page")
        assert rows(driver, mine)[0]["node"] == "node-a"
        shot(driver, "jobs")
        click_in_row(driver, mine, "button.checkpoint")
        shown(driver, f"checkpoint of job {job} on node node-a asked")

        driver.get(cp.url + "/ui/checkpoints")
        ckpts = wait_for(
            lambda: rows(driver, f'#checkpoints tr[data-job="{job}"]'),
            30,
            "the checkpoint to appear (live refresh)",
        )
        assert [c["id"] for c in a.json("checkpoints")] == [ckpts[0]["checkpoint"]]
        assert "dashboard" in driver.find_element(By.ID, "checkpoints").text  # its reason
        shot(driver, "checkpoints")

        driver.get(cp.url + "/ui/jobs")
        wait_for(lambda: rows(driver, mine), 30, "the job again")
        Select(driver.find_element(By.CSS_SELECTOR, f"{mine} select.to")).select_by_value("node-b")
        click_in_row(driver, mine, "button.migrate")
        shown(driver, f"job {job} is being moved from node-a to node-b")
        moved = wait_for(
            lambda: [
                r
                for r in rows(driver, "#jobs tr[data-job]")
                if r["label"] == "web" and r["node"] == "node-b"
            ],
            60,
            "the job running on node-b (live refresh)",
        )
        shot(driver, "jobs-migrated")
        new = moved[0]["job"]
        assert new != job and a.job(job)["state"] == "checkpointed"
        before = [int(x) for x in a.log_of(job).split()]
        wait_for(lambda: len(b.log_of(new).split()) >= len(before) + 2, 30, "the count on B")
        after = [int(x) for x in b.log_of(new).split()]
        assert after[len(before)] == before[-1] + 1  # went on, not from 0

        driver.get(cp.url + "/ui/actions")
        wait_for(
            lambda: sorted(r["state"] for r in rows(driver, "#actions tr[data-command]"))
            == ["done"] * 3,
            30,
            f"the three commands done: {cp.json('actions')}",
        )
        shot(driver, "actions")
        driver.get(cp.url + "/ui/savings")
        wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#chart rect"),
            30,
            "the restore in the savings",
        )
        assert "1 restore(s)" in driver.find_element(By.ID, "total").text
        shot(driver, "savings")
        driver.get(cp.url + "/ui/events")
        text = driver.find_element(By.ID, "events").text
        assert "node-joined" in text and f"restored from checkpoint" in text, text
        shot(driver, "events")
        driver.get(cp.url + "/ui/policies")
        driver.find_element(By.NAME, "name").send_keys("<script>alert(1)</script>")
        driver.find_element(By.CSS_SELECTOR, "#new-policy button").click()
        shown(driver, "bad policy name '<script>alert(1)</script>'")
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in driver.page_source
        driver.find_element(By.NAME, "name").send_keys("hourly")
        driver.find_element(By.CSS_SELECTOR, "#new-policy button").click()
        wait_for(
            lambda: rows(driver, '#policies tr[data-policy="hourly"]')
            or driver.find_elements(By.CSS_SELECTOR, '#policies tr[data-policy="hourly"]'),
            10,
            "the policy listed",
        )
        shot(driver, "policies")
        assert [p["name"] for p in cp.json("policies", "list")] == ["hourly"]
        # Edited in place: its form, filled in; one field changed, the rest kept.
        click_in_row(driver, '#policies tr[data-policy="hourly"]', "a.edit")
        wait_for(lambda: driver.find_elements(By.ID, "edit-policy"), 10, "the edit form")
        every = driver.find_element(By.CSS_SELECTOR, '#edit-policy input[name="every_s"]')
        assert every.get_attribute("value") == "3600"
        every.clear()
        every.send_keys("7200")
        driver.find_element(By.CSS_SELECTOR, '#edit-policy input[name="label"]').send_keys("web*")
        shot(driver, "policy-edit")
        driver.find_element(By.CSS_SELECTOR, "#edit-policy button").click()
        shown(driver, "policy hourly saved")
        (edited,) = cp.json("policies", "list")
        assert (edited["every_s"], edited["filters"], edited["action"]) == (
            7200,
            {"label": "web*"},
            "checkpoint",
        )
        driver.find_element(By.CSS_SELECTOR, ".logout button").click()
        wait_for(lambda: driver.current_url.endswith("/ui/login"), 10, "the log-in page")
        driver.get(cp.url + "/ui/jobs")
        assert driver.current_url.endswith("/ui/login")  # the session is gone


class Browserless:
    """A cookie-keeping HTTP client (what a script or an attacker's page would send)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect()
        )

    def call(
        self,
        method: str,
        path: str,
        form: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, str, str]:
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        req = urllib.request.Request(
            self.cp.url + path, data=data, method=method, headers=headers or {}
        )
        try:
            with self.opener.open(req, timeout=20) as r:
                return r.status, r.headers.get("Location", ""), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Location", ""), e.read().decode()

    def login(self, token: str) -> str:
        status, where, _ = self.call("POST", "/ui/login", {"token": token})
        assert (status, where) == (303, "/ui/"), (status, where)
        status, _, page = self.call("GET", "/ui/")
        assert status == 200
        return page.split('name="csrf" value="')[1].split('"')[0]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def test_dashboard_sessions_csrf_and_scoping(world_tmp: Path) -> None:
    cp = ControlPlane(
        Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)),
        str(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)) / "cp.db"),
    )
    cp.start("--session-ttl", "3s")
    try:
        web = Browserless(cp)
        csrf = web.login(cp.admin)
        cookie = next(c for c in web.jar if c.name == "stasis_session")
        assert cookie.path == "/ui" and cookie.has_nonstandard_attr("HttpOnly")
        status, _, page = web.call("GET", "/ui/jobs")
        assert status == 200 and "No node reports a running job." in page
        # Security headers on every page.
        req = urllib.request.Request(cp.url + "/ui/login")
        with urllib.request.urlopen(req, timeout=20) as r:
            csp = r.headers["Content-Security-Policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert r.headers["X-Frame-Options"] == "DENY"
        # A form without the CSRF token, with a wrong one, or from another origin: refused.
        for form, headers in (
            ({"name": "p1", "every_s": "60", "action": "checkpoint"}, {}),
            ({"name": "p1", "every_s": "60", "action": "checkpoint", "csrf": "x" * 43}, {}),
            (
                {"name": "p1", "every_s": "60", "action": "checkpoint", "csrf": csrf},
                {"Origin": "http://evil.example"},
            ),
        ):
            status, _, body = web.call("POST", "/ui/policies", form, headers)
            assert status == 403, (status, body)
        assert cp.json("policies", "list") == []
        status, where, _ = web.call(
            "POST",
            "/ui/policies",
            {"name": "p1", "every_s": "60", "action": "checkpoint", "csrf": csrf},
        )
        assert (status, where) == (303, "/ui/policies")
        assert [p["name"] for p in cp.json("policies", "list")] == ["p1"]
        # Hostile input in a path and a field: an error shown escaped, nothing done.
        status, _, _ = web.call(
            "POST", "/ui/jobs/%3Cscript%3Ex'%20OR%201=1--/checkpoint", {"csrf": csrf}
        )
        assert status == 303
        status, _, page = web.call("GET", "/ui/jobs")
        assert (
            "job id &#34;&lt;script&gt;x&#39; OR 1=1--&#34; has characters a job id " "cannot have"
        ) in page, page
        assert "<script>x" not in page
        status, _, _ = web.call(
            "POST",
            "/ui/policies",
            {
                "name": "p2",
                "every_s": "1; DROP TABLE policies",
                "action": "checkpoint",
                "csrf": csrf,
            },
        )
        status, _, page = web.call("GET", "/ui/policies")
        assert "every_s: a whole number, not &#39;1; DROP TABLE policies&#39;" in page
        assert [p["name"] for p in cp.json("policies", "list")] == ["p1"]
        # The session expires.
        time.sleep(3.5)
        status, where, _ = web.call("GET", "/ui/jobs")
        assert (status, where) == (303, "/ui/login")
        status, _, _ = web.call("GET", "/ui/jobs", headers={"X-Stasis-Fragment": "1"})
        assert status == 401  # the live refresh sends the page to the log-in
        # A cluster token: its own cluster only, and no actions.
        hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
        cp.json("clusters", "add", "other", "--kind", "kubernetes")
        viewer = Browserless(cp)
        csrf = viewer.login(hpc["token"])
        status, _, page = viewer.call("GET", "/ui/")
        assert "hpc" in page and "other" not in page
        status, _, page = viewer.call("GET", "/ui/policies")
        assert status == 403 and "this needs the admin token" in page
        status, _, _ = viewer.call("POST", "/ui/policies/p1/delete", {"csrf": csrf})
        assert status == 303 and [p["name"] for p in cp.json("policies", "list")] == ["p1"]
        # Revoking the token ends its sessions.
        cp.json(
            "tokens",
            "revoke",
            next(
                t["id"] for t in cp.json("tokens", "list") if t["cluster_id"] == hpc["cluster_id"]
            ),
        )
        status, where, _ = viewer.call("GET", "/ui/")
        assert (status, where) == (303, "/ui/login")
    finally:
        cp.stop()


def test_dashboard_edits_a_policy_in_place(world_tmp: Path) -> None:
    """The edit form: filled in with the policy, refused without the session's CSRF token or
    from another origin, refused below the period floor (nothing changed), hostile values kept
    as text and shown escaped; a webhook policy made by the form shows its hook token once."""
    cp = ControlPlane(
        Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)),
        str(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)) / "cp.db"),
    )
    cp.start("--min-interval", "60")
    try:
        cp.json(
            "policies",
            "add",
            "nightly",
            "--every",
            "1h",
            "--action",
            "checkpoint",
            "--label",
            "train-*",
        )
        web = Browserless(cp)
        csrf = web.login(cp.admin)
        status, _, page = web.call("GET", "/ui/policies")
        assert 'href="/ui/policies/nightly/edit"' in page and "at least 60" in page
        status, _, form = web.call("GET", "/ui/policies/nightly/edit")
        assert status == 200
        assert 'name="every_s" value="3600"' in form and 'name="label" value="train-*"' in form
        assert '<option value="checkpoint" selected>' in form
        assert 'name="enabled" value="1" checked' in form

        def fields(**changes: str | None) -> dict[str, str]:
            base = {
                "trigger": "every",
                "every_s": "3600",
                "action": "checkpoint",
                "label": "train-*",
                "enabled": "1",
                "csrf": csrf,
            }
            return {k: v for k, v in {**base, **changes}.items() if v is not None}

        def listed() -> dict[str, Any]:
            (p,) = cp.json("policies", "list")
            return {k: v for k, v in p.items() if k != "last_run"}

        before = listed()
        for form_fields, headers in (
            (fields(every_s="7200", csrf=""), {}),
            (fields(every_s="7200", csrf="x" * 43), {}),
            (fields(every_s="7200"), {"Origin": "http://evil.example"}),
        ):
            status, _, body = web.call("POST", "/ui/policies/nightly/edit", form_fields, headers)
            assert status == 403, (status, body)
        assert listed() == before
        status, where, _ = web.call(
            "POST",
            "/ui/policies/nightly/edit",
            fields(every_s="7200", user="<script>alert(1)</script>"),
        )
        assert (status, where) == (303, "/ui/policies")
        now = listed()
        assert now["every_s"] == 7200
        assert now["filters"] == {"label": "train-*", "user": "<script>alert(1)</script>"}
        status, _, page = web.call("GET", "/ui/policies")
        assert "policy nightly saved" in page
        assert "user=&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert" not in page

        # Refused: below the floor, a bad number; nothing changed, the reason shown escaped.
        saved = listed()
        for bad, said in (
            (
                {"every_s": "30"},
                "every 30 s is below this control plane&#39;s " "floor of 60 s between runs",
            ),
            (
                {"every_s": "1; DROP TABLE policies"},
                "every_s: a whole number, not &#39;1; DROP TABLE policies&#39;",
            ),
            (
                {"threshold_pct": "<b>9</b>", "trigger": "memory"},
                "threshold_pct: a number, not &#39;&lt;b&gt;9&lt;/b&gt;&#39;",
            ),
        ):
            status, where, _ = web.call("POST", "/ui/policies/nightly/edit", fields(**bad))
            assert (status, where) == (303, "/ui/policies")
            status, _, page = web.call("GET", "/ui/policies")
            assert said in page, page
            assert listed() == saved
        status, _, page = web.call("GET", "/ui/policies/%3Cscript%3Ex/edit")
        assert status == 404 and "no policy &lt;script&gt;x" in page
        # Made a webhook policy (every 0): its hook token, once.
        status, _, _ = web.call(
            "POST", "/ui/policies/nightly/edit", fields(every_s="0", enabled=None)
        )
        status, _, page = web.call("GET", "/ui/policies")
        token = page.split("its hook token (shown once, it runs this policy only): ")[1][:55]
        assert token.startswith("stasis_hook_"), page
        assert "(hook token)" in page and ">disabled<" in page
        assert cp.call("POST", "/api/v1/policies/nightly/run", token) == (
            400,
            {"error": "policy nightly is disabled (`policies edit nightly --enable`)"},
        )
        status, _, page = web.call("GET", "/ui/policies")
        assert token not in page  # shown once
    finally:
        cp.stop()


class _Rows(html.parser.HTMLParser):
    """The jobs table as a browser builds it: each row's job and node, the forms in it (their
    action and fields), and every element id on the page."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self._form: dict[str, Any] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "tr" and "data-job" in a:
            self.rows.append({"job": a["data-job"], "node": a.get("data-node"), "forms": []})
        elif tag == "form" and self.rows:
            self._form = {"action": a.get("action", ""), "fields": {}}
            self.rows[-1]["forms"].append(self._form)
        elif tag == "input" and self._form is not None and a.get("type") == "hidden":
            self._form["fields"][a["name"]] = a.get("value", "")
        elif tag == "option" and self._form is not None:
            self._form["fields"].setdefault("to", a.get("value", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._form = None


def test_a_hostile_job_id_from_a_node_aims_no_dashboard_form_elsewhere(world_tmp: Path) -> None:
    """A node of one cluster reports job ids made to turn the admin's click on its row into an
    action on another cluster's job ("x/../victimjob": the browser resolves the form's URL to
    /ui/jobs/victimjob/checkpoint) or to break out of the page's HTML. The API refuses them; rows
    that still hold them (written before the API checked) get no form, and show as text."""
    from tests.controlplane.fakenode import FakeNode

    cp = ControlPlane(
        Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)),
        str(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)) / "cp.db"),
    )
    cp.start()
    try:
        victims = cp.json("clusters", "add", "victims", "--kind", "slurm")
        attackers = cp.json("clusters", "add", "attackers", "--kind", "slurm")
        victim = FakeNode(cp, victims, "victim-node")
        victim.register()
        victim.heartbeat([{"job": "victimjob"}])
        evil = FakeNode(cp, attackers, "evil-node")
        evil.register()
        evil2 = FakeNode(cp, attackers, "evil-node-2")  # a migration target for its rows
        evil2.register()
        evil2.heartbeat([])
        hostile = [
            "x/../victimjob",
            "..",
            "../victimjob",
            '"><b id="injected">x</b>',
            "a/b",
            "x?y#z",
        ]
        for job in hostile:
            status, answer = cp.call(
                "POST",
                "/api/v1/nodes/evil-node/heartbeat",
                evil.token,
                {"jobs": [{"job": job, "state": "running"}]},
            )
            assert status == 400, (job, status, answer)
        # Rows the API would refuse today, already in the database.
        import sqlite3

        with closing(sqlite3.connect(cp.db)) as db, db:
            db.execute(
                "UPDATE nodes SET job_list = ? WHERE name = 'evil-node'",
                (
                    json.dumps(
                        [{"job": j, "state": "running", "label": "l", "user": "u"} for j in hostile]
                    ),
                ),
            )
        web = Browserless(cp)
        csrf = web.login(cp.admin)
        status, _, page = web.call("GET", "/ui/jobs")
        assert status == 200
        parsed = _Rows()
        parsed.feed(page)
        assert "injected" not in parsed.ids
        assert "&#34;&gt;&lt;b id=&#34;injected&#34;&gt;x&lt;/b&gt;" in page
        rows = {(r["node"], r["job"]): r for r in parsed.rows}
        assert set(rows) == {("victim-node", "victimjob"), *(("evil-node", j) for j in hostile)}
        assert rows["victim-node", "victimjob"]["forms"]  # the honest row keeps its button
        # The admin clicks every button of the attacker's rows, as the browser would send it.
        aimed = []
        for (node, job), row in rows.items():
            if node != "evil-node":
                continue
            for form in row["forms"]:
                target = urllib.parse.urlsplit(
                    urllib.parse.urljoin(cp.url + "/ui/jobs", form["action"])
                )
                aimed.append((job, target.path))
                web.call(
                    "POST",
                    target.path + (f"?{target.query}" if target.query else ""),
                    {**form["fields"], "csrf": csrf},
                )
        assert not [c for c in cp.json("actions") if c["node"] == "victim-node"]
        assert victim.lease() is None  # nothing queued for the victim's node
        for job, path in aimed:
            assert path.startswith("/ui/jobs/" + urllib.parse.quote(job, safe="") + "/"), (
                job,
                path,
            )
    finally:
        cp.stop()


def test_a_node_credential_or_hook_token_logs_in_to_no_dashboard(world_tmp: Path) -> None:
    """A node's credential (or a webhook policy's token) at the log-in: refused in one line,
    no cookie, no session row (before: a node's credential made a session that never
    resolved, kept in the database until it expired)."""
    import sqlite3

    from tests.controlplane.fakenode import FakeNode

    db = str(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)) / "cp.db")
    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), db)
    cp.start()
    try:
        hpc = cp.json("clusters", "add", "hpc", "--kind", "slurm")
        node = FakeNode(cp, hpc, "node-a")
        node.register()
        assert node.token.startswith("stasis_node_")
        hook = cp.json("policies", "add", "hooked", "--on", "webhook", "--action", "checkpoint")
        assert hook["hook_token"].startswith("stasis_hook_")
        for token, what in (
            (node.token, "a node's credential"),
            (hook["hook_token"], "a policy's hook token"),
        ):
            web = Browserless(cp)
            status, where, page = web.call("POST", "/ui/login", {"token": token})
            assert status == 401 and where == "", (status, where)
            said = html.unescape(page.split('id="error">')[1].split("</p>")[0])
            assert said == (
                f"{what} does not log in to the dashboard: log in with the admin "
                "token or a cluster's token"
            ), said
            assert not [c for c in web.jar if c.name == "stasis_session"]
            with closing(sqlite3.connect(db)) as conn:
                assert conn.execute("SELECT count(*) FROM sessions").fetchone() == (0,)
        # The node's credential still works where it belongs.
        node.heartbeat([])
    finally:
        cp.stop()
