"""`stasis slurm install/uninstall` on a slurm.conf that already has other plugins: minimal
edits, a dry run that prints the exact diff and changes nothing, idempotence, byte-for-byte
uninstall, merged lua scripts, the pipeable install.sh."""

from __future__ import annotations

import difflib
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from stasis.errors import UsageError
from stasis.slurm import install as inst
from tests.conftest import STASIS

ROOT = Path(__file__).resolve().parents[2]

SLURM_CONF = """\
# site config
ClusterName=site
JobSubmitPlugins=all_partitions   # partition defaults
CliFilterPlugins=user_defaults
SlurmctldParameters=enable_configless
TaskPlugin=task/affinity,task/cgroup
PlugStackConfig={etc}/plugstack.conf
"""
SITE_JOB_SUBMIT = """\
function slurm_job_submit(job_desc, part_list, submit_uid)
  job_desc.comment = "site"
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end
"""
SITE_PLUGSTACK = "required /usr/lib/site/other.so arg=1\n"


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def site(tmp_path: Path) -> Path:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text(SLURM_CONF.format(etc=etc))
    (etc / "job_submit.lua").write_text(SITE_JOB_SUBMIT)
    (etc / "plugstack.conf").write_text(SITE_PLUGSTACK)
    os.chmod(etc / "job_submit.lua", 0o640)
    return tmp_path


def cli(site: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    etc = site / "etc"
    extra = ["--slurm-conf", str(etc / "slurm.conf")]
    if args[0] == "install":
        extra += [
            "--lib-dir",
            str(site / "lib"),
            "--systemd-dir",
            str(site / "systemd"),
            "--stasis-config",
            str(site / "stasis.toml"),
        ]
    result = subprocess.run(
        [STASIS, "slurm", *args, *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "STASIS_CONFIG": ""},
    )
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


def test_dry_run_prints_the_exact_diff_and_changes_nothing(site: Path) -> None:
    before = snapshot(site)
    out = cli(
        site, "install", "--node-role", "controller", "--node-role", "worker", "--dry-run"
    ).stdout
    assert snapshot(site) == before
    assert "-JobSubmitPlugins=all_partitions   # partition defaults" in out
    assert "+JobSubmitPlugins=all_partitions,lua   # partition defaults" in out
    assert "+CliFilterPlugins=user_defaults,lua" in out
    assert "+SlurmctldParameters=enable_configless,preempt_send_user_signal" in out
    assert f"+optional {site}/lib/stasis_spank.so " in out
    assert "would build" in out
    # The dry run's diff is exactly what install then does, file by file.
    originals = {p: p.read_text() for p in (site / "etc").iterdir()}
    cli(site, "install", "--node-role", "controller", "--node-role", "worker")
    for path, text in originals.items():
        expected = "".join(
            difflib.unified_diff(
                text.splitlines(keepends=True),
                path.read_text().splitlines(keepends=True),
                fromfile=str(path),
                tofile=str(path),
            )
        )
        assert expected in out, path
    created = site / "etc" / "cli_filter.lua"
    assert f"--- /dev/null\n+++ {created}\n" in out


def test_install_keeps_existing_plugins_and_merges_lua(site: Path) -> None:
    out = cli(
        site,
        "install",
        "--node-role",
        "controller",
        "--node-role",
        "worker",
        "--node-role",
        "login",
    ).stdout
    assert "scontrol reconfigure" in out
    etc = site / "etc"
    conf = (etc / "slurm.conf").read_text()
    assert "JobSubmitPlugins=all_partitions,lua   # partition defaults\n" in conf
    assert "CliFilterPlugins=user_defaults,lua\n" in conf
    assert "SlurmctldParameters=enable_configless,preempt_send_user_signal\n" in conf
    assert "TaskPlugin=task/affinity,task/cgroup\n" in conf  # untouched
    job_submit = (etc / "job_submit.lua").read_text()
    assert job_submit.startswith(SITE_JOB_SUBMIT)  # the site's function is still there
    assert "local stasis_site_job_submit = slurm_job_submit" in job_submit
    assert oct((etc / "job_submit.lua").stat().st_mode & 0o777) == "0o640"
    plugstack = (etc / "plugstack.conf").read_text().splitlines()
    assert plugstack[0] == SITE_PLUGSTACK.strip()
    assert plugstack[1].startswith(f"optional {site}/lib/stasis_spank.so python=")
    assert f"conf={site}/stasis.toml" in plugstack[1]
    assert "B:URG@" in (etc / "cli_filter.lua").read_text()
    so = site / "lib" / "stasis_spank.so"
    assert so.read_bytes()[:4] == b"\x7fELF"
    assert os.access(site / "lib" / "stasis-slurm-launch", os.X_OK)
    # Our srun, alone in its directory (the launcher puts that first on a job's PATH).
    # Our srun and the launch agent of jobs on several nodes (stasis.slurm.rsh).
    assert sorted(p.name for p in (site / "lib" / "bin").iterdir()) == ["srun", "stasis-rsh"]
    assert os.access(site / "lib" / "bin" / "srun", os.X_OK)
    unit = (site / "systemd" / "stasis.service").read_text()
    assert "KillMode=process" in unit and f"STASIS_CONFIG={site}/stasis.toml" in unit


def test_install_twice_changes_nothing(site: Path) -> None:
    cli(site, "install", "--node-role", "controller", "--node-role", "worker")
    first = snapshot(site)
    out = cli(site, "install", "--node-role", "controller", "--node-role", "worker").stdout
    assert "nothing to change" in out
    assert snapshot(site) == first
    dry = cli(
        site, "install", "--node-role", "controller", "--node-role", "worker", "--dry-run"
    ).stdout
    assert "nothing to change" in dry and "+++" not in dry


def test_uninstall_restores_every_file_byte_for_byte(site: Path) -> None:
    before = snapshot(site)
    modes = {p: p.stat().st_mode for p in site.rglob("*") if p.is_file()}
    cli(
        site,
        "install",
        "--node-role",
        "controller",
        "--node-role",
        "worker",
        "--node-role",
        "login",
    )
    cli(site, "install", "--node-role", "worker")
    assert snapshot(site) != before
    cli(site, "uninstall")
    after = {k: v for k, v in snapshot(site).items()}
    assert after == before
    assert not (site / "lib" / "bin").exists()  # the directory made for our srun went too
    assert {p: p.stat().st_mode for p in site.rglob("*") if p.is_file()} == modes
    assert "nothing to uninstall" in cli(site, "uninstall").stdout


def test_uninstall_after_a_later_edit_takes_out_only_our_edits(site: Path) -> None:
    cli(site, "install", "--node-role", "controller", "--node-role", "worker")
    conf = site / "etc" / "slurm.conf"
    conf.write_text(conf.read_text() + "# edited later by the admin\n")
    out = cli(site, "uninstall").stdout
    assert "changed since install" in out
    assert conf.read_text() == SLURM_CONF.format(etc=site / "etc") + "# edited later by the admin\n"
    assert (site / "etc" / "job_submit.lua").read_text() == SITE_JOB_SUBMIT


def test_our_srun_outside_a_protected_job_is_slurms_srun(site: Path, tmp_path: Path) -> None:
    """Installed, it runs; outside an opted-in job's tree it execs the next srun on PATH (here
    a stand-in that prints its arguments) with the arguments untouched, and says nothing."""
    cli(site, "install", "--node-role", "worker")
    fake = tmp_path / "slurm-bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/sh\necho "real srun: $*"\nexit 3\n')
    os.chmod(fake / "srun", 0o755)
    ours = site / "lib" / "bin"
    env = {"PATH": f"{ours}:{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "5"}
    result = subprocess.run(
        ["srun", "-n", "2", "--", "echo", "a b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout == "real srun: -n 2 -- echo a b\n" and result.stderr == ""
    assert result.returncode == 3
    # Even told that it runs in job 5's tree: not in a PID namespace, so not ours to run.
    result = subprocess.run(
        ["srun", "true"],
        env={**env, "STASIS_SLURM_STEPS": "5"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout == "real srun: true\n" and result.returncode == 3
    (ours / "srun").write_text((ours / "srun").read_text() + "# edited\n")
    cli(site, "uninstall")
    assert not ours.exists()


def test_fresh_files_and_missing_keys(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text("ClusterName=bare")  # no newline at the end, no plugins
    opts = inst.InstallOptions(
        roles=frozenset({"controller"}),
        slurm_conf=etc / "slurm.conf",
        lib_dir=tmp_path / "lib",
        systemd_dir=None,
    )
    inst.install(opts, out=None)
    assert (etc / "slurm.conf").read_text() == (
        "ClusterName=bare\nJobSubmitPlugins=lua\nCliFilterPlugins=lua\n"
        "SlurmctldParameters=preempt_send_user_signal\n"
    )
    assert (etc / "job_submit.lua").read_text().startswith(inst.BEGIN)
    inst.uninstall(etc / "slurm.conf", out=None)
    assert sorted(p.name for p in etc.iterdir()) == ["slurm.conf"]
    assert (etc / "slurm.conf").read_text() == "ClusterName=bare"


def test_hostile_paths_are_refused(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text("ClusterName=x\n")
    for bad in ("lib dir", "lib#1"):
        opts = inst.InstallOptions(
            roles=frozenset({"worker"}),
            slurm_conf=etc / "slurm.conf",
            lib_dir=tmp_path / bad,
            systemd_dir=None,
        )
        with pytest.raises(UsageError, match="without spaces"):
            inst.install(opts, out=None)
    assert (etc / "slurm.conf").read_text() == "ClusterName=x\n"
    with pytest.raises(UsageError, match="unknown node role"):
        inst.plan(inst.InstallOptions(roles=frozenset({"gpu"}), slurm_conf=etc / "slurm.conf"))


def test_pipeable_install_script(site: Path) -> None:
    script = (ROOT / "stasis" / "slurm" / "files" / "install.sh").read_text()
    etc = site / "etc"
    result = subprocess.run(
        [
            "bash",
            "-s",
            "--",
            "--node-role",
            "worker",
            "--slurm-conf",
            str(etc / "slurm.conf"),
            "--lib-dir",
            str(site / "lib"),
            "--no-systemd",
        ],
        input=script,
        capture_output=True,
        text=True,
        env={**os.environ, "STASIS_BIN": STASIS, "STASIS_CONFIG": ""},
    )
    assert result.returncode == 0, result.stderr
    assert (site / "lib" / "stasis_spank.so").exists()
    result = subprocess.run(
        ["bash", "-s", "--", "uninstall", "--slurm-conf", str(etc / "slurm.conf")],
        input=script,
        capture_output=True,
        text=True,
        env={**os.environ, "STASIS_BIN": STASIS},
    )
    assert result.returncode == 0, result.stderr
    assert not (site / "lib" / "stasis_spank.so").exists()
    assert (etc / "slurm.conf").read_text() == SLURM_CONF.format(etc=etc)


@pytest.mark.parametrize("problem", ["link", "group-writable", "world-writable", "other-owner"])
def test_a_site_script_others_could_write_is_refused_in_one_line(site: Path, problem: str) -> None:
    etc = site / "etc"
    script = etc / "cli_filter.lua"
    if problem == "link":
        target = site / "elsewhere.lua"
        target.write_text("-- someone's\n")
        script.symlink_to(target)
    else:
        script.write_text("-- the site's\n")
        if problem == "other-owner":
            os.chown(script, 65534, 65534)
        else:
            os.chmod(script, 0o664 if problem == "group-writable" else 0o646)
    before = snapshot(site)
    result = cli(site, "install", "--node-role", "controller", check=False)
    assert result.returncode != 0
    error = result.stderr.strip()
    assert len(error.splitlines()) == 1 and f"refusing the site's {script}" in error, error
    assert snapshot(site) == before  # nothing written, the link not followed
    assert not (etc / inst.RECORD_NAME).exists()


def test_a_site_cli_filter_is_chained_and_given_back_byte_for_byte(site: Path) -> None:
    etc = site / "etc"
    site_filter = "function slurm_cli_pre_submit(options, pack_offset)\n  return slurm.SUCCESS\nend"
    (etc / "cli_filter.lua").write_text(site_filter)  # no newline at the end, on purpose
    os.chmod(etc / "cli_filter.lua", 0o600)
    before = snapshot(site)
    cli(site, "install", "--node-role", "controller")
    merged = (etc / "cli_filter.lua").read_text()
    assert merged.startswith(site_filter + "\n")
    assert "local stasis_site_pre_submit = slurm_cli_pre_submit" in merged
    assert (etc / "cli_filter.lua").stat().st_mode & 0o777 == 0o600
    again = snapshot(site)
    assert "nothing to change" in cli(site, "install", "--node-role", "controller").stdout
    assert snapshot(site) == again
    cli(site, "uninstall")
    assert snapshot(site) == before
    assert (etc / "cli_filter.lua").stat().st_mode & 0o777 == 0o600


def test_a_configless_worker_gets_only_its_own_files(tmp_path: Path) -> None:
    """No slurm.conf at --slurm-conf, slurmd's cached copy present: the node's own files only
    (slurm.conf, plugstack.conf and cli_filter.lua are the controller's, served to it), the
    unit without SLURM_CONF; uninstall removes them all."""
    cache = tmp_path / "run-slurm-conf" / "slurm.conf"
    cache.parent.mkdir()
    cache.write_text("ClusterName=site\nSlurmctldParameters=enable_configless\n")
    etc = tmp_path / "etc" / "slurm"
    opts = inst.InstallOptions(
        roles=frozenset({"worker"}),
        slurm_conf=etc / "slurm.conf",
        lib_dir=tmp_path / "lib",
        systemd_dir=tmp_path / "systemd",
        configless_conf=cache,
    )
    inst.install(opts, out=None)
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert made == [
        "etc/slurm/.stasis-install.json",
        "lib/bin/srun",
        "lib/bin/stasis-rsh",
        "lib/stasis-slurm-launch",
        "lib/stasis_spank.c",
        "lib/stasis_spank.so",
        "run-slurm-conf/slurm.conf",
        "systemd/stasis.service",
    ]
    unit = (tmp_path / "systemd" / "stasis.service").read_text()
    assert "SLURM_CONF" not in unit and "ExecStart=" in unit
    inst.uninstall(etc / "slurm.conf", out=None)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["run-slurm-conf/slurm.conf"]
    # Any other role needs the slurm.conf it edits, on the controller.
    with pytest.raises(UsageError, match="only --node-role worker installs"):
        inst.plan(
            inst.InstallOptions(
                roles=frozenset({"worker", "login"}),
                slurm_conf=etc / "slurm.conf",
                configless_conf=cache,
            )
        )
