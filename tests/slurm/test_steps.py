"""Our srun (stasis.slurm.steps) without Slurm: its option parser and which steps it keeps, the
environment its tasks get, and running real tasks (exit codes, labels, files, signals,
--kill-on-bad-exit); the step records in a private IPC namespace; finding Slurm's srun among a
tree's processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stasis.engine import proctree
from stasis.slurm import steps
from stasis.slurm.steps import Handoff, Plan, parse, plan

ENV = {
    "SLURM_JOB_ID": "42",
    "SLURMD_NODENAME": "n1",
    "SLURM_CPUS_ON_NODE": "4",
    "SLURM_JOB_NUM_NODES": "1",
    "PATH": "/usr/bin:/bin",
    "HOME": "/home/u",
    "SLURM_JOB_NAME": "train",
}


def planned(*args: str, env: dict[str, str] | None = None) -> Plan:
    return plan(parse(list(args)), {**ENV, **(env or {})}, mpi_default="none")


def handoff(*args: str, env: dict[str, str] | None = None, mpi: str = "none") -> Handoff:
    with pytest.raises(Handoff) as e:
        plan(parse(list(args)), {**ENV, **(env or {})}, mpi_default=mpi)
    return e.value


# -- the parser -------------------------------------------------------------------------------


def test_options_as_getopt_reads_them() -> None:
    s = parse(
        [
            "-n",
            "4",
            "-c2",
            "-l",
            "--job-name=solve",
            "--mem",
            "1G",
            "--export=ALL,A=1",
            "-K",
            "./solver",
            "-n",
            "9",
            "--x",
        ]
    )
    # Options stop at the command: what follows is the command's.
    assert s.command == ["./solver", "-n", "9", "--x"]
    assert s.options == {
        "ntasks": "4",
        "cpus-per-task": "2",
        "label": "",
        "job-name": "solve",
        "mem": "1G",
        "export": "ALL,A=1",
        "kill-on-bad-exit": "",
    }
    # Clustered short flags, a value glued to the last one, `--` ending the options.
    s = parse(["-lun3", "--", "-weird-name", "arg"])
    assert s.options == {"label": "", "unbuffered": "", "ntasks": "3"}
    assert s.command == ["-weird-name", "arg"]
    # An optional value only when glued (-K1 / --kill-on-bad-exit=0).
    assert parse(["-K0", "true"]).options == {"kill-on-bad-exit": "0"}
    assert parse(["--kill-on-bad-exit", "true"]).command == ["true"]
    assert parse(
        ["--exclusive", "--overlap", "--cpu-bind=cores", "-o", "o-%t", "true"]
    ).options == {"exclusive": "", "overlap": "", "cpu-bind": "cores", "output": "o-%t"}


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--pty", "bash"], "option --pty is not handled by stasis"),
        (["--gres=gpu:1", "x"], "option --gres is not handled by stasis"),
        (["--wait=5", "x"], "option --wait is not handled by stasis"),
        (["-ln2", "-W", "3", "x"], "option -W is not handled by stasis"),
        (["--ntask=2", "x"], "option --ntask is not handled by stasis"),  # no abbreviations
        (["--multi-prog", "conf"], "option --multi-prog is not handled by stasis"),
    ],
)
def test_an_option_we_do_not_handle_goes_to_slurms_srun(args: list[str], reason: str) -> None:
    with pytest.raises(Handoff) as e:
        parse(args)
    assert e.value.reason == reason and not e.value.quiet


@pytest.mark.parametrize("args", [[], ["-n"], ["-n", "2"], ["--label=yes", "x"], ["--ntasks"]])
def test_bad_usage_is_left_to_slurms_srun_quietly(args: list[str]) -> None:
    with pytest.raises(Handoff) as e:
        parse(args)
    assert e.value.quiet  # Slurm's srun prints its own error


# -- which steps stay here ---------------------------------------------------------------------


def test_steps_that_stay_on_this_node_are_ours() -> None:
    p = planned("-n", "2", "-c", "2", "-l", "-K", "-J", "s", "-o", "out-%t", "python3", "x.py")
    assert (p.ntasks, p.cpus_per_task, p.label, p.kill_on_bad_exit, p.name, p.output) == (
        2,
        2,
        True,
        True,
        "s",
        "out-%t",
    )
    assert p.command == ["python3", "x.py"] and p.export == "ALL" and not p.append
    # The job's own task count is the default, as for srun.
    assert planned("true", env={"SLURM_NTASKS": "3"}).ntasks == 3
    assert planned("true").ntasks == 1
    assert planned("-N", "1", "-w", "n1", "--mpi=none", "--jobid=42", "true").ntasks == 1
    # One task of a two-node job lands on one node: ours.
    assert planned("-n", "1", "true", env={"SLURM_JOB_NUM_NODES": "2"}).ntasks == 1
    assert planned("-N", "1", "-n", "2", "true", env={"SLURM_JOB_NUM_NODES": "2"}).ntasks == 2
    # --overcommit lets more tasks than CPUs run here, as Slurm would.
    assert planned("-O", "-n", "8", "true").ntasks == 8
    assert planned("--open-mode=append", "-x", "n2,n3", "true").append
    assert planned("-N", "1-2", "--ntasks-per-node=2", "true").ntasks == 2


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("5", 300.0),
        ("1:30", 90.0),
        ("1:00:05", 3605.0),
        ("2-0", 172800.0),
        ("1-1:01", 90060.0),
        ("1-0:0:7", 86407.0),
        ("0", None),
        ("UNLIMITED", None),
        ("infinite", None),
        ("-1", None),
    ],
)
def test_time_limits_in_slurms_formats(text: str, seconds: float | None) -> None:
    assert steps.time_limit_s(text) == seconds
    assert planned("-t", text, "true").time_limit_s == seconds


@pytest.mark.parametrize("text", ["soon", "1:2:3:4", "1-", "-5", "1h"])
def test_bad_time_limits_are_left_to_slurms_srun(text: str) -> None:
    assert handoff("--time", text, "true").quiet


@pytest.mark.parametrize(
    "args, env, reason",
    [
        (["-N", "2", "true"], {}, "the step asks for 2 nodes"),
        (["-N", "2-3", "true"], {}, "the step asks for 2-3 nodes"),
        (["-n", "2", "true"], {"SLURM_JOB_NUM_NODES": "2"}, "2 tasks over the job's 2 nodes"),
        (
            ["true"],
            {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2"},
            "the job has 2 nodes and the step asks for no single one",
        ),
        (["-w", "n2", "true"], {}, "the step names nodes n2"),
        (["-w", "n[1-2]", "true"], {}, "the step names nodes n[1-2]"),
        (["-x", "n1", "true"], {}, "the step excludes nodes n1"),
        (
            ["-n", "5", "true"],
            {},
            "5 task(s) x 1 CPU(s) is more than the job's 4 CPU(s) on this node",
        ),
        (
            ["-n", "2", "-c", "3", "true"],
            {},
            "2 task(s) x 3 CPU(s) is more than the job's 4 CPU(s) on this node",
        ),
        (["--mpi=pmix", "true"], {}, "MPI plugin pmix"),
        (["true"], {"SLURM_MPI_TYPE": "pmi2"}, "MPI plugin pmi2"),
        (["--jobid=7", "true"], {}, "the step runs in another job (7)"),
        (["-i", "0", "true"], {}, "--input 0"),
        (["-n", "4", "--ntasks-per-node=2", "true"], {}, "4 tasks at 2 per node"),
        (["-N", "1-2", "true"], {"SLURM_JOB_NUM_NODES": "2"}, "the step asks for 1-2 nodes"),
    ],
)
def test_steps_that_leave_the_node_or_need_slurm_are_handed_over(
    args: list[str], env: dict[str, str], reason: str
) -> None:
    assert handoff(*args, env=env).reason == reason


def test_slurms_mpi_default_counts() -> None:
    assert handoff("true", mpi="pmix").reason == "MPI plugin pmix"
    assert plan(parse(["--mpi=none", "true"]), ENV, mpi_default="pmix").ntasks == 1


@pytest.mark.parametrize(
    "args", [["-n", "0", "x"], ["-n", "two", "x"], ["-c", "-1", "x"], ["--open-mode=sideways", "x"]]
)
def test_bad_values_are_left_to_slurms_srun(args: list[str]) -> None:
    e = handoff(*args)
    assert e.quiet


# -- what the tasks get ------------------------------------------------------------------------


def test_task_environment_as_srun_gives_it() -> None:
    env = steps.task_env(planned("-n", "3", "-c", "1", "true"), ENV, 5)
    assert {
        k: env[k]
        for k in (
            "SLURM_STEP_ID",
            "SLURM_STEPID",
            "SLURM_NTASKS",
            "SLURM_NPROCS",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_STEP_NUM_NODES",
            "SLURM_NODEID",
            "SLURM_STEP_NODELIST",
            "SLURM_GTIDS",
            "SLURM_CPUS_PER_TASK",
            "SLURM_JOB_ID",
            "SLURM_JOB_NAME",
            "HOME",
        )
    } == {
        "SLURM_STEP_ID": "5",
        "SLURM_STEPID": "5",
        "SLURM_NTASKS": "3",
        "SLURM_NPROCS": "3",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "n1",
        "SLURM_GTIDS": "0,1,2",
        "SLURM_CPUS_PER_TASK": "1",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "train",
        "HOME": "/home/u",
    }
    assert "SLURM_CPUS_PER_TASK" not in steps.task_env(planned("true"), ENV, 0)


def test_export_as_srun_reads_it() -> None:
    none = steps.task_env(planned("--export=NONE", "true"), ENV, 0)
    assert "HOME" not in none and "PATH" not in none and none["SLURM_JOB_ID"] == "42"
    some = steps.task_env(planned("--export=HOME,A=b c", "true"), ENV, 0)
    assert some["HOME"] == "/home/u" and some["A"] == "b c" and "PATH" not in some
    both = steps.task_env(planned("--export=ALL,A=1", "true"), ENV, 0)
    assert both["A"] == "1" and both["PATH"] == "/usr/bin:/bin"
    # sbatch --export=X leaves SLURM_EXPORT_ENV=X in the batch environment: srun's default.
    inherited = planned("true", env={"SLURM_EXPORT_ENV": "STASIS_ENABLE=1"})
    assert "HOME" not in steps.task_env(inherited, ENV, 0)


def test_filename_patterns() -> None:
    env = {**ENV, "SLURM_JOB_USER": "alice"}
    assert (
        steps.expand("o-%j.%s.%t-%N-%u-%x-%J-%n-%%-%4t", env, 2, 3)
        == "o-42.2.3-n1-alice-train-42.2-0-%-0003"
    )


# -- running tasks -------------------------------------------------------------------------------


def run_step(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, step: int = 0
) -> tuple[int, str, str]:
    """Our Runner in a child process (it installs signal handlers and reaps children): the
    step's exit code, and what it wrote to its stdout and stderr."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    code = textwrap.dedent(f"""
        import os, sys
        from stasis.slurm import steps
        env = {{**os.environ, **{dict(ENV, **(env or {}))!r}}}
        p = steps.plan(steps.parse(sys.argv[1:]), env, mpi_default="none")
        sys.exit(steps.Runner(p, env, {step}).run())
    """)
    with out.open("wb") as o, err.open("wb") as e:
        result = subprocess.run(
            [sys.executable, "-c", code, *args], stdout=o, stderr=e, cwd=tmp_path, timeout=60
        )
    return result.returncode, out.read_text(), err.read_text()


def test_exit_code_is_the_highest_tasks_and_failures_are_said(tmp_path: Path) -> None:
    code, out, err = run_step(
        tmp_path, "-n", "3", "bash", "-c", "echo t$SLURM_PROCID; exit $((SLURM_PROCID * 2))"
    )
    assert code == 4
    assert sorted(out.split()) == ["t0", "t1", "t2"]
    assert err.splitlines() == [
        "srun: error: n1: task 1: Exited with exit code 2",
        "srun: error: n1: task 2: Exited with exit code 4",
    ]
    code, _, err = run_step(tmp_path, "bash", "-c", "kill -KILL $$")
    assert code == 137 and err == "srun: error: n1: task 0: Killed\n"
    code, _, err = run_step(tmp_path, "no-such-command-here")
    assert code == 2
    assert "srun: error: execve(): no-such-command-here: No such file or directory" in err
    # Without PATH in the tasks' environment a bare name is not found (as under slurmstepd).
    code, _, err = run_step(tmp_path, "--export=NONE", "true")
    assert code == 2 and "execve(): true" in err
    assert run_step(tmp_path, "--export=NONE", "/bin/true")[0] == 0


def test_labels_files_and_input(tmp_path: Path) -> None:
    code, out, err = run_step(
        tmp_path,
        "-l",
        "-n",
        "2",
        "bash",
        "-c",
        "echo a$SLURM_PROCID; echo b$SLURM_PROCID >&2; printf tail",
    )
    assert code == 0
    # Each line labelled, a last line without its newline too; stderr stays stderr.
    assert sorted(out.splitlines()) == ["0: a0", "0: tail", "1: a1", "1: tail"]
    assert sorted(err.splitlines()) == ["0: b0", "1: b1"]
    (tmp_path / "in-0").write_text("zero\n")
    (tmp_path / "in-1").write_text("one\n")
    (tmp_path / "old-1.out").write_text("from before\n")
    code, out, _ = run_step(
        tmp_path,
        "-n",
        "2",
        "-i",
        "in-%t",
        "-o",
        "old-%t.out",
        "-e",
        "err-%j.txt",
        "bash",
        "-c",
        "cat; echo e$SLURM_PROCID >&2",
        step=3,
    )
    assert code == 0 and out == ""
    assert (tmp_path / "old-0.out").read_text() == "zero\n"
    assert (tmp_path / "old-1.out").read_text() == "one\n"  # truncated, as srun's default
    assert sorted((tmp_path / "err-42.txt").read_text().split()) == ["e0", "e1"]
    code, _, _ = run_step(tmp_path, "--open-mode=append", "-o", "old-1.out", "echo", "more")
    assert (tmp_path / "old-1.out").read_text() == "one\nmore\n"


def test_time_limit_ends_the_step(tmp_path: Path) -> None:
    start = time.monotonic()
    code, out, err = run_step(
        tmp_path,
        "-t",
        "0:1",
        "-n",
        "2",
        "bash",
        "-c",
        "trap 'echo term $SLURM_PROCID; exit 9' TERM; sleep 30 & wait",
        step=4,
    )
    assert 0.9 < time.monotonic() - start < 15
    assert code == 9 and sorted(out.split("\n")) == ["", "term 0", "term 1"]
    assert "*** STEP 42.4 ON n1 CANCELLED DUE TO TIME LIMIT ***" in err
    assert run_step(tmp_path, "-t", "1", "true")[0] == 0


def test_time_our_srun_was_stopped_is_not_run_time(tmp_path: Path) -> None:
    """Frozen 4 s (as a checkpoint and a requeue freeze it, for longer), our srun counts at
    most a tick of it: a 3 s limit still leaves the step running a while after it thaws."""
    code = textwrap.dedent(f"""
        import os, sys
        from stasis.slurm import steps
        env = {{**os.environ, **{ENV!r}}}
        p = steps.plan(steps.parse(["-t", "0:3", "bash", "-c", "touch go; sleep 30"]), env,
                       mpi_default="none")
        sys.exit(steps.Runner(p, env, 0).run())
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "go").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(4)
        proc.send_signal(signal.SIGCONT)
        thawed = time.monotonic()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - thawed > 0.8
    finally:
        proc.kill()


def test_kill_on_bad_exit_ends_the_other_tasks(tmp_path: Path) -> None:
    start = time.monotonic()
    code, _, err = run_step(
        tmp_path, "-K", "-n", "3", "bash", "-c", "[ $SLURM_PROCID = 2 ] && exit 3; exec sleep 30"
    )
    assert time.monotonic() - start < 20
    assert code == 137  # the killed tasks' SIGKILL is the highest
    assert "task 2 failed: killing the step's other tasks (--kill-on-bad-exit)" in err
    assert "srun: error: n1: task 2: Exited with exit code 3" in err
    # Without -K the others run to their end.
    code, _, _ = run_step(
        tmp_path, "-n", "2", "bash", "-c", "[ $SLURM_PROCID = 1 ] && exit 3; sleep 0.5; exit 1"
    )
    assert code == 3


def test_signals_reach_every_task_and_what_it_started(tmp_path: Path) -> None:
    script = tmp_path / "task.sh"
    script.write_text(
        textwrap.dedent("""\
        trap 'echo "$SLURM_PROCID got TERM"; kill $child; exit 5' TERM
        sleep 60 & child=$!
        echo "ready $SLURM_PROCID $child" > ready-$SLURM_PROCID
        wait
    """)
    )
    code = textwrap.dedent(f"""
        import os, sys
        from stasis.slurm import steps
        env = {{**os.environ, **{ENV!r}}}
        p = steps.plan(steps.parse(["-n", "2", "bash", "{script}"]), env, mpi_default="none")
        sys.exit(steps.Runner(p, env, 0).run())
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready-{t}").exists() for t in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 5
    assert sorted(out.splitlines()) == ["0 got TERM", "1 got TERM"]


def test_a_task_is_killed_when_our_srun_dies(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import os, sys
        from stasis.slurm import steps
        env = {{**os.environ, **{ENV!r}}}
        p = steps.plan(steps.parse(["bash", "-c", "echo $$ > pid; exec sleep 60"]), env,
                       mpi_default="none")
        steps.Runner(p, env, 0).run()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        task = int((tmp_path / "pid").read_text())
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(task):
            assert time.monotonic() < deadline, "the task outlived our srun"
            time.sleep(0.05)
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# -- step records ----------------------------------------------------------------------------------


def test_step_ids_count_in_order_and_records_keep_exit_codes() -> None:
    """In an IPC namespace of its own, as in a job: concurrent sruns get distinct ids, each
    record with its end folded in."""
    code = textwrap.dedent("""
        import json, os
        from stasis.slurm import steps
        ids = []
        for i in range(4):
            if os.fork() == 0:
                b = steps.Book()
                n = b.start({"where": "stasis", "argv": ["step", str(i)]})
                b.end(n, n + 10)
                os._exit(0)
        for _ in range(4):
            os.wait()
        b = steps.Book()
        n = b.start({"where": "slurm", "argv": ["--pty", "bash"], "reason": "r"})
        print(json.dumps(b.records()))
    """)
    result = subprocess.run(
        ["unshare", "--ipc", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all(r["exit"] == r["step"] + 10 for r in records[:4])
    assert sorted(r["argv"][1] for r in records[:4]) == ["0", "1", "2", "3"]
    assert records[4] == {"step": 4, "where": "slurm", "argv": ["--pty", "bash"], "reason": "r"}


# -- Slurm's srun ----------------------------------------------------------------------------------


def test_find_real_srun_skips_ours(tmp_path: Path) -> None:
    ours, real = tmp_path / "ours", tmp_path / "real"
    ours.mkdir()
    real.mkdir()
    (ours / "srun").write_text("#!/usr/bin/python3 -I\nfrom stasis.slurm.steps import main\n")
    (real / "srun").write_text("#!/bin/sh\n")
    for d in (ours, real):
        os.chmod(d / "srun", 0o755)
    assert steps.find_real_srun(f"{ours}:{real}", str(ours)) == str(real / "srun")
    # Ours elsewhere on PATH is recognised by what it runs.
    assert steps.find_real_srun(f"{ours}:{real}", "") == str(real / "srun")
    assert steps.find_real_srun(f"{ours}", str(ours)) is None


def test_real_srun_running_finds_slurms_srun_among_descendants(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    shutil.copy("/bin/sleep", fake)  # an executable named srun, as Slurm's is
    ours = tmp_path / "ours" / "srun"
    ours.parent.mkdir()
    ours.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    os.chmod(ours, 0o755)
    tree = subprocess.Popen(["bash", "-c", f"{ours} & (sleep 0.1; {fake} 30) & wait"])
    try:
        deadline = time.monotonic() + 20
        # an srun caught in its execve is named by its path: wait for its arguments
        while (found := steps.real_srun_running(tree.pid)) in ([], [str(fake)]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert found == [f"{fake} 30"]  # ours (a script) is not listed
        assert "a step runs outside stasis" in steps.refusal(found)
    finally:
        for pid in reversed(proctree.tree(tree.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tree.wait()
