"""Slurm integration: transparent checkpoint on preemption and time limit, restore on requeue.

Owns everything that makes stasis work under Slurm, and nothing of the engine, store or daemon
internals (it uses their public entry points):

    files/      the SPANK plugin (C, built at install time), job_submit.lua and cli_filter.lua
                blocks, the pipeable installer script
    install     `stasis slurm install/uninstall`: files in place, minimal reversible edits of
                slurm.conf / plugstack.conf / the lua scripts, byte-for-byte uninstall
    taskinit    the root helper the SPANK plugin runs in the job's task: restore or fresh start
    launcher    the batch "shell" as Slurm sees it: runs or adopts the workload, forwards signals,
                asks the node daemon for a checkpoint on SIGURG and periodically
    report, report_html  `stasis slurm report`: what time limits, over-requests and
                preemptions cost, from sacct
    remote      munge-authenticated requests to another node's daemon (`dump --slurm-job`,
                `slurm drain`): credential, slurm.conf keys, client
    steps       our srun: steps that stay on the node run inside the job's tree; others go to
                Slurm's srun and block checkpoints while they run
    scontrol    what Slurm says (job info, pidinfo, requeue), its failures as SlurmError
    labels      which checkpoints a job may resume from; the variables that opt a job in
    models      the /slurm routes' requests and answers, as the daemon validates them
    registrations  the daemon's side: jobs under stasis, checkpoint + requeue, retiring labels
    integration the daemon plug-in: /slurm routes, the remote listener, the slurm_jobs table,
                housekeeping

It plugs into the daemon through stasis.daemon.integration and talks to it through
stasis.client; nothing outside this package knows Slurm. It must not change how jobs that did
not opt in (STASIS_ENABLE=1) run. The throwaway local cluster of the tests and demos is
stasis.dev's (`stasis-dev local-cluster`).
"""
