"""The node daemon (root): starts jobs so that they can be checkpointed, checkpoints them with
the engine into the store, restores them, and follows them until they end.

    models       the API's requests, as the daemon validates them (the answers are the typed
                 dicts of stasis/wire.py)
    http         what every route does with a request: caller (SO_PEERCRED), body, answer
    api          the core's routes on the unix socket
    integration  how an integration (Slurm, ...) adds routes, tables and background tasks
    jobs         JobManager, what the handlers call: run, queries, kill; the parts below
    core         what the parts share (settings, store, database, network locks, journal)
    tracking     whose a job is, whether it still runs, recording its end
    supervisor   starting a job's supervisor (a spare one waits), the restore gate, job logs
    dumping      dump, dump --check, publishing, undoing dumps a killed daemon left
    restoring    restore by id or label, verification, the lazy path
    lazystore    lazy restore from a store: scratch images, the page server, killing on failure
    streamed     full restore of compressed or encrypted images, decoded while CRIU reads them
    housekeeping pruning finished jobs and CRIU logs, freeing garbage checkpoints
    progress     bytes done while CRIU dumps or restores
    stopping     `stasis kill`: the signal, the grace period, SIGKILL
    inflight     dumps in flight, written down
    staging      the node-memory stage of leave-running dumps
    reaper       reaping orphans the daemon (a subreaper) inherits
    jobsupervisor the per-job supervisor process (parent of the job, writes its exit status)
    supervisorwire what passes between the daemon and a job's supervisor: spec, answer, files
    db           the SQLite database: jobs, network locks, integrations' tables
    netlocks     CRIU's network locks this node holds for its checkpoints
    users        callers, accounts, job environments
    server       `stasis daemon`: socket, signals, background tasks

It knows no scheduler: integrations plug in (stasis.daemon.integration).

It must not print to a terminal or parse command lines: that is the CLI's job.
"""
