"""The node daemon (root): starts jobs so that they can be checkpointed, checkpoints them with
the engine into the store, restores them, and follows them until they end.

    models       the API's requests and answers, as the daemon validates them (stasis/wire.py
                 is the same shapes for clients)
    http         what every route does with a request: caller (SO_PEERCRED), body, answer
    api          the core's routes on the unix socket
    integration  how an integration (Slurm, ...) adds routes, tables and background tasks
    jobs         what the handlers do: run, dump, restore, kill, follow
    shim         the per-job supervisor process (parent of the job, writes its exit status)
    db           the SQLite database: jobs, network locks, integrations' tables
    netlocks     CRIU's network locks this node holds for its checkpoints
    users        callers, accounts, job environments
    server       `stasis daemon`: socket, signals, background tasks

It knows no scheduler: integrations plug in (stasis.daemon.integration).

It must not print to a terminal or parse command lines: that is the CLI's job.
"""
