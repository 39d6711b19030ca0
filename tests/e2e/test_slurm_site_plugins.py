"""A site that already has its own job_submit.lua and cli_filter.lua, on a real cluster:
`stasis slurm install` chains ours with them (the site's scripts still run and their decisions
hold, a rejection included; an opted-in job is still protected: a preemption resumes it), a
second install changes nothing, and `stasis slurm uninstall` gives the site's files back byte
for byte.

On a cluster of its own: the module takes stasis out and installs it again.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from stasis.dev.slurmdirs import NODE
from tests.e2e.conftest import Cluster, close_cluster, new_cluster

# Rejects jobs named forbidden-*, and marks every other one in its Comment (after the site's
# cli_filter, which set the Comment first).
SITE_JOB_SUBMIT = """\
-- The site's own job_submit.lua.
function slurm_job_submit(job_desc, part_list, submit_uid)
  if job_desc.name ~= nil and string.find(job_desc.name, "^forbidden") then
    slurm.log_user("site policy: no job may be named forbidden-*")
    return slurm.ERROR
  end
  job_desc.comment = (job_desc.comment or "") .. "+site-job-submit"
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
"""
SITE_CLI_FILTER = """\
-- The site's own cli_filter.lua.
function slurm_cli_setup_defaults(options, early_pass)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
  options["comment"] = "site-cli-filter"
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end"""  # no newline at the end: given back as it was all the same
SITE_COMMENT = "site-cli-filter+site-job-submit"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install_args(c: Cluster) -> list[str]:
    return [
        "--node-role",
        "controller",
        "--node-role",
        "worker",
        "--slurm-conf",
        str(c.lay.slurm_conf),
        "--lib-dir",
        str(c.lay.lib),
        "--stasis-config",
        str(c.lay.config_of(NODE)),
        "--no-systemd",
    ]


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Cluster, dict[str, str]]]:
    """The cluster with stasis taken out, the site's scripts in place (slurm.conf enabling them),
    stasis installed over them. Yields the cluster and the site files' checksums."""
    c = new_cluster("site-plugins")
    try:
        c.stasis("slurm", "uninstall", "--slurm-conf", str(c.lay.slurm_conf))
        etc = c.lay.etc
        assert not (etc / "job_submit.lua").exists() and not (etc / "cli_filter.lua").exists()
        conf = c.lay.slurm_conf
        conf.write_text(conf.read_text() + "JobSubmitPlugins=lua\nCliFilterPlugins=lua\n")
        (etc / "job_submit.lua").write_text(SITE_JOB_SUBMIT)
        (etc / "cli_filter.lua").write_text(SITE_CLI_FILTER)
        (etc / "cli_filter.lua").chmod(0o640)
        sums = {p.name: sha(p) for p in (conf, etc / "job_submit.lua", etc / "cli_filter.lua")}
        c.run("scontrol", "reconfigure")
        out = c.stasis("slurm", "install", *install_args(c)).stdout
        assert f"updated {etc / 'job_submit.lua'}" in out
        c.run("scontrol", "reconfigure")
        yield c, sums
    finally:
        close_cluster(c)


def test_the_sites_job_submit_still_rejects_an_opted_in_job(
    site: tuple[Cluster, dict[str, str]],
) -> None:
    c, _ = site
    script = c.counter_script("forbidden-job", stop=3)
    result = c.run("sbatch", "--export=STASIS_ENABLE=1", str(script), check=False)
    assert result.returncode != 0
    assert "site policy: no job may be named forbidden-*" in result.stderr
    # Ours still runs on the job it lets through: a multi-node opted-in job is refused by stasis.
    ok = c.run("sbatch", "-N", "2", "--export=STASIS_ENABLE=1", "--wrap=true", check=False)
    assert ok.returncode != 0 and "stasis: this job asks for several nodes" in ok.stderr


def test_both_site_scripts_and_stasis_protection_hold_across_a_preemption(
    site: tuple[Cluster, dict[str, str]],
) -> None:
    c, _ = site
    plain = c.sbatch(c.counter_script("plain", stop=2))
    assert c.job(plain)["Comment"] == SITE_COMMENT
    assert "stasis-token=" not in c.job(plain).get("AdminComment", "")
    victim = c.counter_script("victim", "--export=STASIS_ENABLE=1", stop=25)
    preemptor = c.script(
        "preemptor",
        "echo preemptor; sleep 2",
        "--partition=high",
        "--cpus-per-task=8",
        f"--output={c.work}/preemptor-%j.out",
    )
    v = c.sbatch(victim)
    job = c.job(v)
    assert job["Comment"] == SITE_COMMENT  # the site's cli_filter, then its job_submit
    assert job["Requeue"] == "1" and "stasis-token=" in job["AdminComment"]  # and ours
    c.wait_number(v, 5)
    pre = c.sbatch(preemptor)
    c.wait_state(v, ("COMPLETED", "FAILED", "CANCELLED"), 150)
    out = c.output(v)
    assert c.state(pre) == "COMPLETED"
    assert "stasis: restored checkpoint" in out, out
    head = out[: out.index("stasis: restored checkpoint")]
    tail = out[out.index("stasis: restored checkpoint") :]
    at_dump = [int(n) for n in re.findall(r"^(\d+)$", head, re.M)][-1]
    assert [int(n) for n in re.findall(r"^(\d+)$", tail, re.M)][0] == at_dump + 1
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(25)], out
    job = c.job(v)
    assert job["Restarts"] == "1" and job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0"


def test_reinstall_changes_nothing_and_uninstall_gives_the_site_files_back(
    site: tuple[Cluster, dict[str, str]],
) -> None:
    c, sums = site
    etc = c.lay.etc
    merged = {name: sha(etc / name) for name in ("job_submit.lua", "cli_filter.lua")}
    assert merged != {name: sums[name] for name in merged}
    assert "nothing to change" in c.stasis("slurm", "install", *install_args(c)).stdout
    assert {name: sha(etc / name) for name in merged} == merged
    c.stasis("slurm", "uninstall", "--slurm-conf", str(c.lay.slurm_conf))
    files = (c.lay.slurm_conf, etc / "job_submit.lua", etc / "cli_filter.lua")
    assert {p.name: sha(p) for p in files} == sums
    assert (etc / "cli_filter.lua").stat().st_mode & 0o777 == 0o640
    # The site's scripts alone again, as before stasis.
    c.run("scontrol", "reconfigure")
    j = c.sbatch(c.counter_script("after", "--export=STASIS_ENABLE=1", stop=2))
    assert c.job(j)["Comment"] == SITE_COMMENT
    assert "stasis-token=" not in c.job(j).get("AdminComment", "")
