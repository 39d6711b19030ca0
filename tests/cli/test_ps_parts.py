"""`stasis ps` on a node of a Slurm job across several nodes (issue 31): a daemon job labelled
`slurm-<job>-part-<key>` (stasis.slurm.partnames: what the launch agent names the part it
starts) is shown as that Slurm job's part, in the table (column `of`) and in --json (`slurm_job`,
`part`); other jobs are as before. The node knows only its own parts: the job's other nodes list theirs."""

from __future__ import annotations

import pwd

from tests.conftest import Daemon, MakeDaemon, wait_for, workload


def test_ps_shows_a_part_as_its_slurm_jobs(daemon: Daemon, test_user: pwd.struct_passwd) -> None:
    user = test_user.pw_name
    part = daemon.run(*workload("counter.py"), label="slurm-4242-part-0a1b2c3d", user=user)["job"]
    own = daemon.run(*workload("counter.py"), label="ps-own", user=user)["job"]
    # Near misses of a part's label are jobs of their own.
    near = daemon.run(*workload("counter.py"), label="slurm-4242-part-0A1B2C3D", user=user)["job"]
    try:
        wait_for(lambda: len(daemon.log_of(part).split()) >= 2, 30, "the part to count")
        listed = {j["job"]: j for j in daemon.json("ps")}
        assert (listed[part]["slurm_job"], listed[part]["part"]) == ("4242", "0a1b2c3d")
        assert listed[part]["state"] == "running"
        for other in (own, near):
            assert "slurm_job" not in listed[other] and "part" not in listed[other]
        # The owner sees it so too.
        mine = {j["job"]: j for j in daemon.json("ps", user=user)}
        assert mine[part]["slurm_job"] == "4242"

        table = daemon.cli("ps").stdout.splitlines()
        header = table[0].split()
        assert header[:5] == ["job", "pid", "state", "label", "of"], table[0]
        (row,) = [line for line in table if line.startswith(part + " ")]
        assert "slurm job 4242 part 0a1b2c3d" in row
        (row,) = [line for line in table if line.startswith(own + " ")]
        assert "slurm job" not in row
    finally:
        for job in (part, own, near):
            daemon.cli("kill", job, check=False)


def test_ps_without_parts_has_no_part_column(
    make_daemon: MakeDaemon, test_user: pwd.struct_passwd
) -> None:
    d = make_daemon()
    job = d.run(*workload("counter.py"), label="ps-alone", user=test_user.pw_name)["job"]
    assert d.cli("ps").stdout.splitlines()[0].split()[:5] == [
        "job",
        "pid",
        "state",
        "label",
        "exit_code",
    ]
    assert "slurm_job" not in d.job(job)
