"""`srun` steps of an opted-in job: the ones that stay on the job's node run inside its tree.

The launcher puts `<lib_dir>/bin` (holding our `srun`, which runs `main()`) first on the
workload's PATH. A batch script's `srun ...` then comes here, inside the job's PID and IPC
namespaces, and:

  - a step that stays on this node (one node, its tasks within the job's CPUs here, no MPI
    plugin, only options understood below) is run by us: its tasks are our children, so they
    are part of the checkpointed tree, resume with it, and a step that ended before a
    checkpoint is never run again (the restored script goes on after it);
  - any other step is handed to Slurm's own srun (exec'd by absolute path), with one line in
    the job's output saying why. Its tasks run outside the tree, so while it runs a checkpoint
    would capture a client talking to a step that is gone after the restore:
    `real_srun_running()` finds such steps and the callers refuse the checkpoint.

Step ids are the order of `srun` calls in the job (0, 1, ...: both kinds count), kept with a
record per step (argv, where it ran, exit code) in a SysV segment of the job's own IPC
namespace: CRIU checkpoints it with the job, so a restored job numbers its later steps as the
first run did. `srun --stasis-steps` prints the records (JSON lines) from inside the job. The
node daemon reads them from outside and records each of our steps in Slurm as well, for sacct
(stasis.slurm.mirrors).

What we run mimics srun: each task gets the environment srun gives (SLURM_STEP_ID, SLURM_PROCID,
SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS ...), the batch step's stdout/stderr (or -o/-e files,
%j %s %t ... expanded), `-l` labels, `--kill-on-bad-exit`, signals forwarded, and srun's exit
code: the highest of the tasks' (128+N for a task killed by signal N), and `-t` (counted in run
time: not the time the job spent checkpointed and requeued). Resource options that Slurm would
enforce per step (--mem, --cpu-bind, --exclusive, ...) are accepted and not enforced: the job's
own limits apply. Steps running at once are not queued for CPUs.

The modules, one concern each:

    parse     srun's command line, whether a step stays here (`plan`), time limits
    book      the step book: writing it (`Book`), reading it from outside (`read_records`)
    realsrun  Slurm's own srun: finding it, its steps running, the checkpoint's refusal
    runner    running a step's tasks here, as srun would (`Runner`)
    srun      our srun's `main`, which installed wrappers run
"""

from __future__ import annotations

from stasis.slurm.steps.book import (
    Book,
    BookRefused,
    SegmentStat,
    StepRecord,
    StepStart,
    Where,
    fold,
    parse_book,
    parse_record,
    read_records,
    segment_stat,
)

# The reader's innards, as tests/slurm/test_hostile_book.py plays with them.
from stasis.slurm.steps.book import _copy_out as _copy_out
from stasis.slurm.steps.book import _shm_libc as _shm_libc
from stasis.slurm.steps.parse import Handoff, Plan, Step, parse, plan, time_limit_s
from stasis.slurm.steps.realsrun import (
    SRUN_NAME,
    find_real_srun,
    install_dir,
    real_srun_running,
    refusal,
)
from stasis.slurm.steps.runner import OUR_STEP_VAR, Runner, expand, task_env
from stasis.slurm.steps.srun import LIST_OPTION, OPT_OUT_VAR, REAL_SRUN_VAR, STEPS_VAR, main

__all__ = [
    "LIST_OPTION",
    "OPT_OUT_VAR",
    "OUR_STEP_VAR",
    "REAL_SRUN_VAR",
    "SRUN_NAME",
    "STEPS_VAR",
    "Book",
    "BookRefused",
    "Handoff",
    "Plan",
    "Runner",
    "SegmentStat",
    "Step",
    "StepRecord",
    "StepStart",
    "Where",
    "expand",
    "find_real_srun",
    "fold",
    "install_dir",
    "main",
    "parse",
    "parse_book",
    "parse_record",
    "plan",
    "read_records",
    "real_srun_running",
    "refusal",
    "segment_stat",
    "task_env",
    "time_limit_s",
]
