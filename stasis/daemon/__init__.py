"""The node daemon (root): starts jobs so that they can be checkpointed, checkpoints them with
the engine into the store, restores them, and follows them until they end.

    models   wire formats of the API
    api      HTTP/JSON handlers on the unix socket (caller identity from SO_PEERCRED)
    jobs     what the handlers do: run, dump, restore, kill, follow
    shim     the per-job supervisor process (parent of the job, writes its exit status)
    db       the SQLite job table
    users    callers, accounts, job environments
    server   `stasis daemon`: socket, signals, the follow loop
    client   the unix-socket HTTP client the CLI (and scheduler plugins) use

It must not print to a terminal or parse command lines: that is the CLI's job.
"""
