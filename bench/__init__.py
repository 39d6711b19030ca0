"""The benchmark suite: stasis dump/restore against the plain CRIU command line and a raw copy.

`python -m bench.run` (or `make bench`) measures, writes bench/results/<timestamp>.{json,md,png}
and asserts nothing: the figures are for people and for the targets of issue 4. Modules:

    workloads/memhold.py  the measured process (random, float32 or mostly-zero memory)
    modes.py              named dump/restore option sets (new fast paths are added there by name)
    dest.py               where images go: a private tmpfs, or a directory on /
    procs.py              starting namespaced workloads, reading their log, waiting on pids
    stasis_driver.py      a private stasis daemon and its CLI
    criu_cli.py           the plain `criu dump` / `criu restore` baseline
    raw.py                the physical limit: a raw write and read of the same bytes
    stats.py              decoder of CRIU's stats-dump / stats-restore images
    case.py               one run of one case: all three methods
    snapshot.py           a committed stasis to measure (--stasis-ref), immune to edits meanwhile
    slurm_e2e.py          --slurm: progress redone per preemption on the local Slurm cluster
    slurm_nodes.py        `python -m bench.slurm_nodes`: preemption and node failure on three
                          local nodes, stasis against requeue from scratch
    report.py, plot.py    summary (median/min/max, ratios, targets), Markdown, PNG

Nothing here is imported by stasis; the suite drives stasis only through its CLI, as a user would.
"""
