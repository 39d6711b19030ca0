"""Opted-in jobs whose batch script runs its work in `srun` steps, on a real Slurm cluster.

Our srun (stasis.slurm.steps) runs the steps that stay on the node inside the job's checkpointed
tree: a step checkpointed mid-run resumes after the requeue (its tasks, their pipes, SysV memory
and loopback connections together), a step that had ended is not run again. A step handed to
Slurm's own srun makes checkpoints refused while it runs, with a line saying so; the job goes on.
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import pytest

from stasis.slurm import registrations
from tests.conftest import TEST_USER
from tests.e2e.conftest import Cluster, until, wait_gone

MARKER = "stasis: restored checkpoint"
OUTSIDE = "stasis: this srun step runs outside stasis"

# One task of a step whose tasks talk to each other at every tick, each check failing loudly
# ("BROKEN ...", exit 3) if anything was lost, repeated or went stale across a restore:
#   a token goes round a ring of named FIFOs (task r reads fifo r, writes fifo r+1): task r
#     reads i*n+r-1 at tick i;
#   a SysV segment holds one counter per task: each task finds its own at i, sets i+1, and
#     task 0 finds task r's at i+1 when r reports tick i;
#   task 0 serves loopback TCP, each other task reports "r i" and waits for "ack i".
RING = """\
import ctypes, os, socket, struct, sys, time
stop, port, interval, where = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
r, n = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
step = int(os.environ["SLURM_STEP_ID"])
base = os.path.join(where, f"ring-{os.environ['SLURM_JOB_ID']}-{step}")


def broken(what):
    print(f"BROKEN task {r}: {what}", flush=True)
    sys.exit(3)


for k in range(n):
    try:
        os.mkfifo(f"{base}-{k}")
    except FileExistsError:
        pass
rd = os.open(f"{base}-{r}", os.O_RDWR)
wr = os.open(f"{base}-{(r + 1) % n}", os.O_RDWR)


def get():
    data = b""
    while len(data) < 8:
        data += os.read(rd, 8 - len(data))
    return struct.unpack("q", data)[0]


libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
shm = libc.shmget(0x1000 + step, 8 * n, 0o1000 | 0o600)
slots = (ctypes.c_long * n).from_address(libc.shmat(shm, None, 0))

if r == 0:
    server = socket.create_server(("127.0.0.1", port))
    peers = {}
    while len(peers) < n - 1:
        conn, _ = server.accept()
        f = conn.makefile("rw")
        peers[int(f.readline().split()[1])] = f
else:
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.05)
    f = conn.makefile("rw")
    f.write(f"hello {r}\\n")
    f.flush()

for i in range(stop):
    if slots[r] != i:
        broken(f"tick {i}: my counter in shared memory is {slots[r]}")
    if r == 0:
        if i > 0 and (t := get()) != i * n - 1:
            broken(f"tick {i}: token {t}, not {i * n - 1}")
        slots[0] = i + 1
        os.write(wr, struct.pack("q", i * n))
        for p in range(1, n):
            if (line := peers[p].readline().strip()) != f"{p} {i}":
                broken(f"tick {i}: task {p} said {line!r}")
            if slots[p] != i + 1:
                broken(f"tick {i}: task {p}'s counter is {slots[p]}")
            peers[p].write(f"ack {i}\\n")
            peers[p].flush()
        time.sleep(interval)
    else:
        if (t := get()) != i * n + r - 1:
            broken(f"tick {i}: token {t}, not {i * n + r - 1}")
        slots[r] = i + 1
        os.write(wr, struct.pack("q", i * n + r))
        f.write(f"{r} {i}\\n")
        f.flush()
        if (line := f.readline().strip()) != f"ack {i}":
            broken(f"tick {i}: task 0 said {line!r}")
    print(f"tick {i}", flush=True)
"""


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The session's shared cluster (conftest): this module leaves it as it found it."""
    (shared_cluster.work / "ring.py").write_text(RING)
    return shared_cluster


def after(text: str, marker: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", text[text.index(marker) :], re.M)]


def before(text: str, marker: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)$", text[: text.index(marker)], re.M)]


def ticks(text: str, task: int) -> list[int]:
    return [int(n) for n in re.findall(rf"^{task}: tick (\d+)$", text, re.M)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_issue_script_resumes_mid_step_and_never_reruns_a_finished_one(cluster: Cluster) -> None:
    """The reported job: `srun bash -c 'echo first'`, then an srun counter step, warned as
    Slurm warns at preemption (URG to the batch step) at a count well past 0. A step after
    them gets the next step id, and the records of the steps survived with the job. The
    counter step's time limit (20 s) is more than it runs (12 s), less than the wall time it
    spans with the requeue here (about 25 s): the time the job was away does not count."""
    work = cluster.work
    body = "\n".join(
        [
            "srun bash -c 'echo first'",
            f"srun -t 0:20 python3 -u {work}/counter.py 24 0.5 0",
            "srun bash -c 'echo last step $SLURM_STEP_ID'",
            "srun --stasis-steps",
        ]
    )
    script = cluster.script(
        "issue", body, "--export=ALL,STASIS_ENABLE=1", f"--output={work}/issue-%j.out"
    )
    job = cluster.sbatch(script, user=TEST_USER)
    cluster.wait_number(job, 5)
    pids = cluster.pids(job)
    # The step's task is the job's, inside its tree: no slurmstepd step was made for it.
    assert any("counter.py" in _cmdline(p) for p in pids)
    cluster.run("scancel", "--batch", "--signal=URG", job)
    wait_gone(pids)
    until(lambda: MARKER in cluster.output(job), 90, "the restore")
    cluster.wait_state(job, ("COMPLETED", "FAILED"), 120)
    out = cluster.output(job)
    assert "SIGURG: taking a checkpoint" in out
    at_dump = before(out, MARKER)[-1]
    assert at_dump >= 5
    assert after(out, MARKER)[0] == at_dump + 1, out  # resumed where it was
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(24)], out
    assert out.count("first\n") == 1, out  # the finished step did not run again
    assert out.count("last step 2\n") == 1, out
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    assert [(r["step"], r["where"], r.get("exit")) for r in records] == [
        (0, "stasis", 0),
        (1, "stasis", 0),
        (2, "stasis", 0),
    ], out
    assert records[0]["argv"] == ["bash", "-c", "echo first"]
    assert OUTSIDE not in out and "TIME LIMIT" not in out
    info = cluster.job(job)
    assert info["Restarts"] == "1"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0"
    assert ("COMPLETED", "0:0") in cluster.sacct(job)


def test_multi_task_steps_resume_together_with_pipes_shared_memory_and_tcp(
    cluster: Cluster,
) -> None:
    """`srun -l -n 2` and `srun -l -n 4` steps (two jobs at once), each checkpointed mid-run
    with `stasis dump --slurm-job` by its user: after the requeue every task goes on from its
    tick, its token, its counter in the segment and its connection, none repeated or lost."""
    jobs: dict[int, str] = {}
    stop = 60
    for n in (2, 4):
        script = cluster.script(
            f"ring{n}",
            f"srun -l -n {n} python3 -u {cluster.work}/ring.py {stop} "
            f"{free_port()} 0.2 {cluster.work}",
            "--export=ALL,STASIS_ENABLE=1",
            f"--ntasks={n}",
            f"--output={cluster.work}/ring{n}-%j.out",
        )
        jobs[n] = cluster.sbatch(script, user=TEST_USER)
    for n, job in jobs.items():
        until(lambda: len(ticks(cluster.output(job), n - 1)) >= 8, 90, f"ring of {n} at tick 8")
    answers: dict[int, Any] = {}
    pids: list[int] = []
    # Both dumped before waiting for either's processes to end: on a loaded machine the second
    # ring must not run out of ticks meanwhile.
    for n, job in jobs.items():
        pids += cluster.pids(job)
        answers[n] = json.loads(
            cluster.stasis("dump", "--slurm-job", job, "--json", user=TEST_USER).stdout
        )
        assert answers[n]["requeued"] is True
    wait_gone(pids)
    for n, job in jobs.items():
        until(lambda: MARKER in cluster.output(job), 90, f"the restore of the ring of {n}")
    for n, job in jobs.items():
        cluster.wait_state(job, ("COMPLETED", "FAILED"), 120)
        out = cluster.output(job)
        assert "BROKEN" not in out, out
        head, tail = out.split(MARKER)
        for task in range(n):
            assert ticks(out, task) == list(range(stop)), (task, out)
            # Checkpointed mid-run: every task has ticks on both sides of the restore.
            assert ticks(head, task) and ticks(tail, task), (task, out)
        info = cluster.job(job)
        assert info["Restarts"] == "1"
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out


def test_step_handed_to_slurms_srun_refuses_checkpoints_and_the_job_goes_on(
    cluster: Cluster,
) -> None:
    """A step with an option our srun leaves to Slurm (--wait): the job says so; while it
    runs, the preemption warning and periodic checkpoints are refused with one line each (a
    restored client would talk to a step that is gone), and the job completes, never hangs."""
    work = cluster.work
    script = cluster.script(
        "outside",
        f"srun --wait=60 python3 -u {work}/counter.py 16 0.5 0\necho after-step",
        "--export=ALL,STASIS_ENABLE=1,STASIS_INTERVAL=2",
        f"--output={work}/outside-%j.out",
    )
    job = cluster.sbatch(script, user=TEST_USER)
    cluster.wait_number(job, 3)
    cluster.run("scancel", "--batch", "--signal=URG", job)
    until(
        lambda: "no checkpoint: a step runs outside stasis" in cluster.output(job),
        30,
        "the refusal",
    )
    cluster.wait_state(job, ("COMPLETED", "FAILED"), 90)
    out = cluster.output(job)
    assert f"{OUTSIDE} (option --wait is not handled by stasis)" in out, out
    refusal = re.search(
        r"^stasis: warning: no checkpoint: a step runs outside stasis "
        r"\(srun --wait=60 python3 -u \S+counter.py 16 0.5 0\)",
        out,
        re.M,
    )
    assert refusal, out
    assert "stasis: periodic checkpoint skipped: a step runs outside stasis" in out
    assert MARKER not in out and "SIGURG: taking a checkpoint" not in out
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(16)], out
    assert out.rstrip().endswith("after-step")
    info = cluster.job(job)
    assert info["Restarts"] == "0"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0"
    # One line per step, not one per interval.
    assert out.count("stasis: periodic checkpoint skipped") == 1, out


def test_manual_dump_is_refused_while_a_step_runs_outside(cluster: Cluster) -> None:
    """`stasis dump --slurm-job` (the daemon's side) refuses as the launcher does: one line,
    exit 1, the job untouched, going on to complete."""
    if "real_srun_running" not in _source(registrations):
        # Until the daemon asks steps.real_srun_running, the dump would be taken and the job
        # restored with a dead client: not tried.
        pytest.skip("registrations._checkpoint does not call steps.real_srun_running yet")
    work = cluster.work
    script = cluster.script(
        "outside-dump",
        f"STASIS_SRUN=slurm srun python3 -u {work}/counter.py 12 0.5 0",
        "--export=ALL,STASIS_ENABLE=1",
        f"--output={work}/outside-dump-%j.out",
    )
    job = cluster.sbatch(script, user=TEST_USER)
    cluster.wait_number(job, 2)
    dump = cluster.stasis("dump", "--slurm-job", job, user=TEST_USER, check=False)
    assert dump.returncode == 1, dump.stderr
    assert len(dump.stderr.strip().splitlines()) == 1
    assert "a step runs outside stasis (srun python3 -u " in dump.stderr, dump.stderr
    assert cluster.checkpoints(job, user=TEST_USER) == []
    cluster.wait_state(job, ("COMPLETED", "FAILED"), 90)
    out = cluster.output(job)
    assert f"{OUTSIDE} (STASIS_SRUN=slurm)" in out
    assert re.findall(r"^(\d+)$", out, re.M) == [str(i) for i in range(12)], out
    info = cluster.job(job)
    assert info["Restarts"] == "0" and info["JobState"] == "COMPLETED"


def test_step_environment_exit_codes_labels_and_files(cluster: Cluster) -> None:
    """What a script sees of the steps we run: srun's task environment, step ids in order,
    srun's exit code (the highest task's; 128+N for a signal), -l labels, -o per-task files;
    a script ending with a failing step ends the job with that code."""
    work = cluster.work
    body = "\n".join(
        [
            "srun -n 2 bash -c 'echo env $SLURM_STEP_ID $SLURM_PROCID $SLURM_LOCALID "
            "$SLURM_NODEID $SLURM_NTASKS $SLURM_STEP_NUM_TASKS $SLURM_STEP_NUM_NODES "
            "$SLURM_STEP_NODELIST ${SLURM_CPUS_PER_TASK:-unset}' | sort",
            "srun -n 2 bash -c 'exit $((SLURM_PROCID * 3 + 2))'; echo step-exit $?",
            "srun bash -c 'kill -TERM $$'; echo signal-exit $?",
            f"srun -l -n 2 -o {work}/task-%j-%s-%t.out bash -c 'echo task $SLURM_PROCID'",
            "srun -n 2 -c 2 -l bash -c 'echo cpus $SLURM_STEP_ID $SLURM_CPUS_PER_TASK'",
            "srun --stasis-steps",
            "srun bash -c 'exit 7'",
        ]
    )
    job = cluster.sbatch(
        cluster.script(
            "codes",
            body,
            "--export=ALL,STASIS_ENABLE=1",
            "--ntasks=4",
            f"--output={work}/codes-%j.out",
        ),
        user=TEST_USER,
    )
    cluster.wait_state(job, ("COMPLETED", "FAILED"), 90)
    out = cluster.output(job)
    assert "env 0 0 0 0 2 2 1 n1 unset\nenv 0 1 1 0 2 2 1 n1 unset\n" in out, out
    assert "step-exit 5" in out and "srun: error: n1: task 1: Exited with exit code 5" in out
    assert "signal-exit 143" in out and "srun: error: n1: task 0: Terminated" in out
    for task in (0, 1):
        assert (work / f"task-{job}-3-{task}.out").read_text() == f"{task}: task {task}\n"
    assert "0: cpus 4 2\n" in out and "1: cpus 4 2\n" in out
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    assert [(r["step"], r["where"], r.get("exit")) for r in records] == [
        (0, "stasis", 0),
        (1, "stasis", 5),
        (2, "stasis", 143),
        (3, "stasis", 0),
        (4, "stasis", 0),
    ]
    assert records[1]["argv"] == ["-n", "2", "bash", "-c", "exit $((SLURM_PROCID * 3 + 2))"]
    assert OUTSIDE not in out
    info = cluster.job(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "7:0"
    assert ("FAILED", "7:0") in cluster.sacct(job)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _source(module: Any) -> str:
    import inspect

    return inspect.getsource(module)
