"""One Settings object for the daemon, the CLI and the control plane: a TOML file plus STASIS_*
environment variables.

The environment is read once, in `load_settings()`, called at the entry point; everything below
receives the Settings object explicitly. Precedence: environment > file > defaults. The file is
STASIS_CONFIG, else /etc/stasis/config.toml when it exists.

The declarations below are the one table of settings: each field is declared in its area's
section with its default and a `Setting` (its area and what it does, as docs/configuration.md
says it: `python -m stasis.configdoc` writes that page from them). A setting's environment
variable is STASIS_ and its name in capitals; the exceptions are declared on the field
(`slurm_conf` is Slurm's own SLURM_CONF; the S3 credentials are read from the file only, the
environment having AWS's own variables) and in `DEPRECATED_ENV` (old spellings still accepted).
In the file a setting is a top-level key or a key of its area's table (`[storage]`, `[slurm]`, ...).
"""

# No `from __future__ import annotations`: the Setting in each field's Annotated[...] is read at
# run time (the environment's names, the file's tables, the secrets repr() hides).

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, NamedTuple

from stasis.errors import UsageError
from stasis.layout import StateLayout

DEFAULT_CONFIG_FILE = Path("/etc/stasis/config.toml")


class Area(NamedTuple):
    """A group of settings: its table in the config file, its section in the docs."""

    key: str  # the file's [table]
    title: str  # the docs' heading
    note: str = ""  # the docs' paragraph under the heading


CORE = Area("core", "The node daemon")
JOBS = Area("jobs", "Jobs, dumps and restores")
# Not [store]: `store = "..."` at the top of a file and a [store] table cannot both be TOML.
STORE = Area(
    "storage",
    "The checkpoint store and the keys it trusts",
    "An `s3://` store takes its endpoint, region and credentials where AWS tools look for them "
    "(`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, "
    "`AWS_PROFILE` and the shared files `~/.aws/config` and `~/.aws/credentials`, read by "
    "botocore itself), or from the file's `s3_*` settings, whose values win over AWS's "
    "variables. The secret goes in a root-only file of its own (`s3_secret_access_key_file`), "
    "so that the config file stays readable by the users whose `stasis` commands read it too.",
)
ENCRYPTION = Area("encryption", "Encryption at rest")
SLURM = Area("slurm", "Slurm")
KUBERNETES = Area("kubernetes", "Kubernetes (containerd)")
CONTROLPLANE = Area("controlplane", "The control plane, on each node and for the admin CLI")
CONTROLPLANE_SERVER = Area(
    "controlplane_server",
    "The control plane service (`stasis controlplane serve`)",
    "The same defaults as the flags of `stasis controlplane serve` "
    "([cli.md](cli.md#stasis-controlplane-serve)).",
)
TESTS = Area("tests", "Tests only")
AREAS = (CORE, JOBS, STORE, ENCRYPTION, SLURM, KUBERNETES, CONTROLPLANE, CONTROLPLANE_SERVER, TESTS)


class Setting(NamedTuple):
    """What a field of Settings is: its area, what it does (a line of docs/configuration.md,
    markdown), and where the environment gives it."""

    area: Area
    doc: str
    # None: STASIS_ and the name in capitals; "": the file only; else the variable named (another
    # program's, read as it means it there, or one kept apart from a job's own variable).
    env: str | None = None
    secret: bool = False  # never shown: repr() writes *** for it
    empty_is_a_value: bool = False  # the variable set to "" sets "" (else "" is unset)


# Old spellings of environment variables, still read (a one-line deprecation each time); the
# current name, read after them, wins when both are set.
DEPRECATED_ENV = {
    "CEDANA_URL": "controlplane_url",
    "CEDANA_CLUSTER_ID": "cluster_id",
    "CEDANA_AUTH_TOKEN": "auth_token",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


# A NamedTuple, not a pydantic model or a dataclass: every CLI call builds one, and importing
# pydantic costs ~70 ms of each `stasis` invocation, dataclasses (through inspect) ~12 ms.
class Settings(NamedTuple):
    # -- core: the node daemon --------------------------------------------------------------
    socket: Annotated[Path, Setting(CORE, "the daemon's unix socket (the CLI talks to it)")] = Path(
        "/run/stasis/stasis.sock"
    )
    state_dir: Annotated[
        Path,
        Setting(
            CORE,
            "the daemon's state: job database `jobs.db`, job logs, CRIU logs, keys "
            "([internals.md](internals.md))",
        ),
    ] = Path("/var/lib/stasis")
    socket_group: Annotated[
        str,
        Setting(
            CORE,
            '`""`: every local user may reach the socket (mode 0666; each acts on their own '
            "jobs and checkpoints only, by peer credentials); a group name restricts it to its "
            "members (0660; a group that does not exist stops the daemon)",
        ),
    ] = ""
    # What would grow without bound otherwise (the daemon prunes at its start, then hourly):
    # 5,000 rows made `stasis ps --json` take 244 ms; CRIU writes ~110 KB of log per dump.
    keep_finished_jobs: Annotated[
        int,
        Setting(
            CORE,
            "rows of finished jobs the job table keeps (the newest; their job directories go "
            "with them); `0` keeps all",
        ),
    ] = 1000
    finished_jobs_max_age_s: Annotated[
        int,
        Setting(CORE, "(30 days) rows of jobs that ended longer ago are dropped; `0` never"),
    ] = 30 * 86400
    keep_criu_logs: Annotated[
        int,
        Setting(CORE, "CRIU logs kept in `<state_dir>/criu-logs` (the newest); `0` keeps all"),
    ] = 500
    criu_logs_max_age_s: Annotated[
        int,
        Setting(
            CORE,
            "(14 days) older CRIU logs are removed; `0` never. A live job's row and CRIU logs "
            "are never pruned, nor logs younger than an hour; the daemon prunes at its start "
            "and then hourly",
        ),
    ] = 14 * 86400
    criu: Annotated[
        str,
        Setting(CORE, 'the criu binary; `""`: `/usr/local/sbin/criu`, else the first on PATH'),
    ] = ""
    tini: Annotated[
        str, Setting(CORE, 'tini (Slurm jobs\' init); `""`: tini-static, else tini on PATH')
    ] = ""
    init: Annotated[
        str,
        Setting(
            CORE,
            "stasis-init, the jobs' init (`make install` and the stasis package install it; "
            'jobs run it as their user); `""`: `/usr/libexec/stasis/stasis-init`, else '
            "`/usr/local/libexec/stasis/stasis-init`, else beside the Python",
        ),
    ] = ""
    # "auto": the page cache while the disk keeps up (as fast, no second copy), a tmpfs while
    # it is behind (the job would stay frozen on writeback): daemon/staging.py, bench/freeze.py.
    stage_dir: Annotated[
        str,
        Setting(
            CORE,
            "`auto`: leave-running dumps are staged in a tmpfs the daemon mounts on "
            "`/run/stasis-stage` while the node's disk is behind (it is writing more than "
            "32 MiB/s, or the dump would take the page cache past the kernel's background "
            "writeback threshold), else they go through the store's page cache; a directory: "
            'stage every leave-running dump there; `""` (also as an empty variable): never',
            empty_is_a_value=True,
        ),
    ] = "auto"
    # Our own clients send a whole request at once; a slow or stalled one (or a hostile one)
    # must not hold the daemon's files for long.
    request_timeout_s: Annotated[
        int,
        Setting(
            CORE,
            "seconds a client has to send a request's headers once connected, and again its "
            "body; then the daemon closes the connection (`0` no limit)",
        ),
    ] = 10
    # Enough for one user's jobs, their Slurm hooks and their commands at once.
    max_connections_per_uid: Annotated[
        int,
        Setting(
            CORE,
            "connections one user may hold open on the socket at once (root is never "
            "capped); beyond, a one-line refusal; `0` no cap",
        ),
    ] = 64
    # Long enough for a server to finish its requests and write its state, short enough that a
    # job which ignores TERM is not left running for long (`stasis kill --timeout` overrides).
    kill_timeout_s: Annotated[
        int,
        Setting(
            CORE,
            "seconds `stasis kill` gives a job to end on its signal before SIGKILL (`0`: "
            "SIGKILL at once)",
        ),
    ] = 10
    # A peer's TCP gives up on a silent connection after ~15 minutes (Linux: tcp_retries2=15);
    # a lock held longer only keeps that address/port pair blocked.
    netlock_timeout_s: Annotated[
        int,
        Setting(
            CORE,
            "seconds CRIU's network lock (the firewall rules that hold a stopped job's TCP "
            "peers waiting) of a checkpoint that is neither restored nor deleted is kept (`0`: "
            "until then)",
        ),
    ] = 900
    db_busy_timeout_s: Annotated[
        float,
        Setting(
            CORE,
            "seconds a write to the daemon's job database waits for another process's lock; "
            "then the write fails in one line (a stop-dump still ends its job once its "
            "checkpoint is published, and records it when the database frees)",
        ),
    ] = 5.0
    node_name: Annotated[
        str,
        Setting(
            CORE,
            "this node's name in its checkpoints' manifests, in the notes it leaves in the "
            'store and in the control plane; `""`: the host name',
        ),
    ] = ""

    # -- jobs: dumps and restores -----------------------------------------------------------
    lazy_restore: Annotated[
        bool,
        Setting(JOBS, "`true` makes `restore` lazy by default (`restore --no-lazy` overrides)"),
    ] = False
    # The pages of a lazily restored job come from the daemon, which takes its page server with
    # it when it stops.
    lazy_drain_timeout_s: Annotated[
        float,
        Setting(
            JOBS,
            "how long a graceful stop (SIGTERM) of the daemon waits for lazily restored jobs "
            "to have all their memory back (their pages come from the daemon; past it they are "
            "killed and their checkpoints stay)",
        ),
    ] = 60.0
    # engine/nodelocal.py; 256 MiB holds JVM perf data, sockets' dirs, SQLite files, scratch
    # files, not a whole dataset.
    node_local_limit: Annotated[
        int,
        Setting(
            JOBS,
            "(256 MiB) bytes of node-local files (under `/tmp`, `/var/tmp`, `/dev/shm`, ...) a "
            "checkpoint carries; over it a dump is refused at once, the job running on (see "
            "[What travels with a job](usage.md#what-travels-with-a-job))",
        ),
    ] = 256 << 20
    private_tmp: Annotated[
        bool,
        Setting(
            JOBS,
            "`true`: every `stasis run` job gets its own `/tmp` and `/var/tmp` (as "
            "`--private-tmp`; `--no-private-tmp` overrides)",
        ),
    ] = False
    verify_new_checkpoints: Annotated[
        bool,
        Setting(
            JOBS,
            "`true`: every checkpoint this node publishes is verified in the background "
            "(`stasis verify`: restored in a sandbox, stopped, removed), at low priority",
        ),
    ] = False
    verify_timeout_s: Annotated[
        float, Setting(JOBS, "seconds one verify may take before its verdict fails")
    ] = 600.0
    # Not STASIS_INTERVAL: that is each job's own (a Slurm job's environment, a container's), and
    # a `stasis` command run inside such a job would read the job's value as the node's.
    interval: Annotated[
        str,
        Setting(
            JOBS,
            "the periodic checkpoint interval of protected jobs that ask for none (a Slurm job "
            "opted in without `STASIS_INTERVAL`, a container without `STASIS_INTERVAL` or "
            '`stasis.dev/interval`): `""` none, `"auto"` (Young/Daly: see `interval_min_s`) or '
            'seconds (`"3600"`); a job\'s own `STASIS_INTERVAL` wins, and '
            "`STASIS_INTERVAL=off` (or `0`) asks for none. Its variable is "
            "`STASIS_DEFAULT_INTERVAL`, since `STASIS_INTERVAL` is the job's",
            env="STASIS_DEFAULT_INTERVAL",
        ),
    ] = ""

    # -- store: where checkpoints go, how long they stay, whose are trusted -----------------
    store: Annotated[
        str,
        Setting(
            STORE,
            "where checkpoints go: a directory, `s3://bucket/prefix`, or another fsspec URL; "
            '`""`: `<state_dir>/checkpoints`',
        ),
    ] = ""
    # A node remembers the local stores it used (stasis/store/marker.py); a node that never
    # used its store (new, reinstalled) needs this to tell an unmounted one from an empty one.
    store_id: Annotated[
        str,
        Setting(
            STORE,
            "the id in a local store's `.stasis-store`; when set, every node refuses a store "
            "directory without that marker (an unmounted filesystem), also one that never used "
            'the store; `""`: only the stores this node used are checked',
        ),
    ] = ""
    # "Cannot tell" is never "no checkpoint": how long a starting job waits it out (issue 28).
    store_wait_s: Annotated[
        int,
        Setting(
            STORE,
            "how long a starting job whose checkpoint cannot be looked up (store or node "
            "daemon unreachable) waits, retrying, before it fails in a way its scheduler "
            "retries (Slurm: requeued held, the reason in its Comment, and released by the "
            "node that held it once the store or its daemon answers again; Kubernetes: the "
            "create fails with the reason in the pod's events, at most 90 s there: the "
            "kubelet's own timeout is 2 minutes). `STASIS_FRESH=1` in the job's environment: "
            "start from the beginning instead",
        ),
    ] = 300
    keep: Annotated[int, Setting(STORE, "checkpoints kept per label (`0` keeps all)")] = 5
    keep_max_age_s: Annotated[
        int,
        Setting(
            STORE,
            "(no limit) checkpoints older than this are deleted, at each publish of their "
            "label and hourly for every label; a label's newest always stays",
        ),
    ] = 0
    # Nobody can restore a checkpoint whose manifest is garbage, nor tell whose it is; the
    # delay leaves time to look at it. Unsigned or untrusted ones are never removed by
    # themselves: a shared store may hold another site's.
    remove_corrupt_after_s: Annotated[
        int,
        Setting(
            STORE,
            "(7 days) a checkpoint whose manifest is garbage is removed this long after it was "
            "written; `0` never",
        ),
    ] = 7 * 86400
    # Manifests are signed (stasis/store/signing.py): with the site key when there is one, else
    # with the node's own key. Both are trusted, and so is every key file named here.
    site_key: Annotated[
        str,
        Setting(
            STORE,
            "a key file all nodes of the site share: they sign with it and trust each other "
            '(`""`: each node signs with its own `<state_dir>/keys/node.key`)',
        ),
    ] = ""
    trusted_keys: Annotated[
        tuple[str, ...],
        Setting(
            STORE,
            "other nodes' key files (or directories of them) whose checkpoints this node "
            "restores; `:`-separated, a list in the file",
        ),
    ] = ()
    # Only from the file: the environment has AWS's own variables for these (botocore reads
    # them). "" = leave it to botocore.
    s3_endpoint_url: Annotated[
        str,
        Setting(
            STORE,
            "the S3 endpoint (file only; else `AWS_ENDPOINT_URL` and botocore's own lookup)",
            env="",
        ),
    ] = ""
    s3_region: Annotated[
        str,
        Setting(
            STORE,
            "the S3 region (file only; else `AWS_REGION`, `AWS_PROFILE`, `~/.aws/config`)",
            env="",
        ),
    ] = ""
    s3_access_key_id: Annotated[
        str,
        Setting(
            STORE,
            "the S3 access key (file only; else `AWS_ACCESS_KEY_ID`, `~/.aws/credentials`)",
            env="",
        ),
    ] = ""
    s3_secret_access_key: Annotated[
        str,
        Setting(
            STORE,
            "the S3 secret itself: only in a config file nobody but root reads (users' "
            "`stasis` commands read the config file too); prefer `s3_secret_access_key_file`",
            env="",
            secret=True,
        ),
    ] = ""
    s3_secret_access_key_file: Annotated[
        str,
        Setting(
            STORE,
            "a root-only file holding the S3 secret (file only; else `AWS_SECRET_ACCESS_KEY`, "
            "`~/.aws/credentials`). Keys are never logged nor written to a manifest",
            env="",
        ),
    ] = ""

    # -- encryption at rest (stasis/store/crypt.py) ---------------------------------------
    # The key file wraps a fresh data key per checkpoint; rotating it means a new file here,
    # the old one in old_encryption_key_files, and `stasis checkpoints rekey`.
    encrypt: Annotated[
        bool,
        Setting(
            ENCRYPTION,
            "`true` encrypts every dump's images (AES-256-GCM; `dump --encrypt` asks per "
            "dump, `--no-encrypt` refuses per dump)",
        ),
    ] = False
    encryption_key_file: Annotated[
        str,
        Setting(
            ENCRYPTION,
            "a root-only file of 32 random bytes (raw or base64) whose key wraps each "
            'checkpoint\'s data key; read by the daemon; `""`: none',
        ),
    ] = ""
    old_encryption_key_files: Annotated[
        tuple[str, ...],
        Setting(
            ENCRYPTION,
            "earlier key files, still accepted for restore and `checkpoints rekey`; "
            "`:`-separated, a list in the file",
        ),
    ] = ()

    # -- slurm --------------------------------------------------------------------------------
    slurm_conf: Annotated[
        str,
        Setting(
            SLURM,
            "the cluster's slurm.conf, Slurm's own variable: which cluster `scontrol` talks "
            'to; `""`: Slurm\'s default, `/etc/slurm/slurm.conf`',
            env="SLURM_CONF",
        ),
    ] = ""
    slurm_node_name: Annotated[
        str,
        Setting(
            SLURM,
            "this node's NodeName in slurm.conf, for a drain and for requests from other "
            'nodes; `""`: the short host name',
        ),
    ] = ""
    # Off unless asked: it is root's daemon listening on the network, a port the site's
    # firewall must let through between its nodes, and a node without Slurm (containers, a
    # laptop, the test suite's many daemons) must not open one.
    slurm_remote_port: Annotated[
        int,
        Setting(
            SLURM,
            "(off) the TCP port every Slurm node's daemon listens on for `dump --slurm-job` and "
            "`slurm drain` from other nodes (munge-authenticated), and the CLI sends them to; "
            "one port cluster-wide (6821 suggested; open it between the nodes: "
            "[ports.md](ports.md))",
        ),
    ] = 0
    slurm_remote_address: Annotated[
        str, Setting(SLURM, 'the address that listener binds; `""`: every address')
    ] = ""
    # Off until checkpoints of jobs that span nodes are complete (issue 31): with it, such a
    # job runs, each node's tasks in the job's own network, but is not yet checkpointed.
    slurm_multinode: Annotated[
        int,
        Setting(
            SLURM,
            "(off) opted-in jobs may span nodes (`-N 2` and more), every srun task of theirs "
            "inside the job's own network (a VXLAN per job): this cluster's number, 1 to 15, "
            "among the clusters whose nodes share one network (each job's VXLAN id is "
            "`number << 20 | job id mod 2^20`: unique site-wide while a cluster's running jobs' "
            "ids are less than 2^20 apart); the same on every node and the controller "
            "(`stasis slurm install` writes it into job_submit.lua); 0: such jobs are refused "
            "at submission",
        ),
    ] = 0
    # `auto` intervals (stasis/interval.py): never more often than the floor (each checkpoint
    # takes a dump slot and store space), never rarer than the ceiling (a rate of zero in the
    # accounting window proves no rate of zero).
    interval_min_s: Annotated[
        float,
        Setting(
            SLURM,
            "floor on the interval `STASIS_INTERVAL=auto` chooses for a Slurm job (Young/Daly, "
            "from Slurm's accounting): never more often",
        ),
    ] = 300.0
    interval_max_s: Annotated[
        float,
        Setting(
            SLURM,
            "ceiling on it; also the interval of a job whose partition shows no interruption "
            "in Slurm's accounting",
        ),
    ] = 86400.0

    # -- kubernetes (containerd) ----------------------------------------------------------
    runc: Annotated[
        str,
        Setting(
            KUBERNETES,
            "the runc that containers run on (stasis-runc hands everything to it); `\"\"`: "
            "`/usr/sbin/runc`, else the first on PATH",
        ),
    ] = ""
    containerd_address: Annotated[
        str,
        Setting(KUBERNETES, "containerd's socket, whose task events tell how containers ended"),
    ] = "/run/containerd/containerd.sock"
    kubeconfig: Annotated[
        str,
        Setting(
            KUBERNETES,
            "the kubeconfig the node agent (`stasis k8s agent`) and `stasis k8s checkpoint` "
            "use; `\"\"`: the pod's service account (in-cluster), else `$KUBECONFIG` or "
            "`~/.kube/config`",
        ),
    ] = ""
    # The part of a pod's grace period (30 s by default) a checkpoint at the container's stop
    # may use.
    k8s_stop_timeout_s: Annotated[
        int,
        Setting(
            KUBERNETES,
            "seconds a container's checkpoint at its stop may take before the container is "
            "stopped as usual without it (the chart's `stopTimeoutSeconds`)",
        ),
    ] = 20
    k8s_min_interval_s: Annotated[
        int,
        Setting(
            KUBERNETES,
            "the floor on containers' checkpoint intervals (`STASIS_INTERVAL`, "
            "`stasis.dev/interval`); a shorter one is raised to it, said in the container's "
            "log; a pod owner's request by annotation sooner than this after the container's "
            "last checkpoint is refused (a Warning event on the pod); `0` none",
        ),
    ] = 60
    # `auto` for containers (stasis/k8s/intervals.py): no node can count its pods'
    # interruptions (a deleted pod's replacement runs elsewhere), so the site says.
    k8s_interruption_rate_per_hour: Annotated[
        float,
        Setting(
            KUBERNETES,
            "interruptions (evictions, preemptions, drains, node failures) per pod-hour on this "
            "cluster, for the interval `STASIS_INTERVAL=auto` / `stasis.dev/interval: auto` "
            "chooses (Young/Daly, within `interval_min_s`, `k8s_min_interval_s` and "
            "`interval_max_s`); `0`: none known, the ceiling",
        ),
    ] = 0.0
    # Each failed `runc restore` fails the container's create, which the kubelet retries
    # (issue 28).
    k8s_restore_attempts: Annotated[
        int,
        Setting(
            KUBERNETES,
            "failed restores of one checkpoint on a node before the label's previous one is "
            "tried (`0`: never give up)",
        ),
    ] = 3
    k8s_check_interval_s: Annotated[
        float,
        Setting(
            KUBERNETES,
            "seconds between the node agent's checks of its node (the `stasis.dev/not-ready` "
            "taint follows them)",
        ),
    ] = 10.0

    # -- controlplane: where this node reports, with which token (stasis/controlplane) -----
    controlplane_url: Annotated[
        str,
        Setting(
            CONTROLPLANE,
            "the control plane this node joins, and the admin CLI talks to; `\"\"`: none",
        ),
    ] = ""
    cluster_id: Annotated[
        str,
        Setting(CONTROLPLANE, "the cluster this node belongs to (checked against its token)"),
    ] = ""
    auth_token: Annotated[
        str,
        Setting(
            CONTROLPLANE,
            "the cluster's token (a node) or the admin token (the CLI); never logged. Keep it "
            "in a root-only config file, not on a command line",
            secret=True,
        ),
    ] = ""
    controlplane_heartbeat_s: Annotated[
        float, Setting(CONTROLPLANE, "seconds between a node's heartbeats")
    ] = 10.0
    # A restore's fence (stasis.controlplane.node): the wait for the control plane's commit.
    controlplane_commit_timeout_s: Annotated[
        float,
        Setting(
            CONTROLPLANE,
            "how long a job a control plane's restore brought back waits, stopped, for the "
            "control plane to confirm the restore is still this node's before it resumes; past "
            "it the job is killed unresumed, its checkpoint kept, the restore retried or "
            "re-targeted (fencing)",
        ),
    ] = 30.0
    # Off: a token sent over plain HTTP off this host is anyone's on the path (issue 27).
    controlplane_allow_plain_http: Annotated[
        bool,
        Setting(
            CONTROLPLANE,
            "`false`: a node and the admin CLI refuse an `http://` control plane whose host is "
            "not loopback (127.0.0.0/8, ::1, localhost), in one line; a refusing node says so "
            "in its log and protects its jobs without joining",
        ),
    ] = False

    # -- controlplane_server: the control plane service, the defaults of serve's flags -----
    controlplane_db: Annotated[
        str,
        Setting(
            CONTROLPLANE_SERVER,
            "SQLAlchemy URL (`postgresql+psycopg://...`) or an SQLite file; `\"\"`: "
            "`<state_dir>/controlplane.db`",
        ),
    ] = ""
    controlplane_listen: Annotated[
        str, Setting(CONTROLPLANE_SERVER, "HOST:PORT the control plane listens on")
    ] = "127.0.0.1:8470"
    controlplane_admin_token_file: Annotated[
        str,
        Setting(
            CONTROLPLANE_SERVER,
            "where the admin token made at the first start goes (0600); `\"\"`: printed once",
        ),
    ] = ""
    controlplane_cert: Annotated[
        str,
        Setting(CONTROLPLANE_SERVER, "TLS certificate (PEM): HTTPS; needs `controlplane_key`"),
    ] = ""
    controlplane_key: Annotated[str, Setting(CONTROLPLANE_SERVER, "its private key (PEM)")] = ""
    controlplane_serve_plain_http: Annotated[
        bool,
        Setting(
            CONTROLPLANE_SERVER,
            "serve plain HTTP on a non-loopback address (tokens in the clear)",
        ),
    ] = False
    controlplane_behind_tls: Annotated[
        bool,
        Setting(
            CONTROLPLANE_SERVER,
            "a TLS-terminating proxy is in front: the dashboard's session cookie is Secure and "
            "the installers name https:// though requests arrive over plain HTTP",
        ),
    ] = False
    controlplane_lost_after_s: Annotated[
        float, Setting(CONTROLPLANE_SERVER, "a node silent this long is shown as lost")
    ] = 60.0
    controlplane_command_lease_s: Annotated[
        float,
        Setting(
            CONTROLPLANE_SERVER,
            "seconds a node holds a command before it is given out again",
        ),
    ] = 60.0
    controlplane_session_ttl_s: Annotated[
        int, Setting(CONTROLPLANE_SERVER, "(8 hours) how long a dashboard log-in lasts")
    ] = 8 * 3600
    controlplane_min_interval_s: Annotated[
        int,
        Setting(
            CONTROLPLANE_SERVER,
            "the shortest period a policy may have: a shorter `--every` is refused; also the "
            "floor on the interval a policy's `--every auto` chooses",
        ),
    ] = 60
    controlplane_max_interval_s: Annotated[
        int,
        Setting(
            CONTROLPLANE_SERVER,
            "(1 day) the ceiling on the interval a policy's `--every auto` chooses (Young/Daly "
            "from each job's measured checkpoint cost and its cluster's interruption rate); "
            "also the interval of a job whose cluster showed no interruption in 30 days",
        ),
    ] = 86400

    # -- tests: never set on a real node ----------------------------------------------------
    test_page_delay_ms: Annotated[
        int,
        Setting(
            TESTS,
            "milliseconds the page server of a lazy restore from a store holds back each "
            "answer (a deterministic window before all pages are back); never set it on a "
            "real node",
        ),
    ] = 0
    test_fault_points: Annotated[
        tuple[str, ...],
        Setting(
            TESTS,
            "where this process SIGKILLs itself (`stasis/faults.py`, the fault-injection "
            "tests); never set it on a real node",
        ),
    ] = ()

    def __repr__(self) -> str:
        # Settings end up in tracebacks and debug output; the secrets must not.
        shown = (
            f"{k}={'***' if v and SETTINGS[k].secret else v!r}"
            for k, v in zip(self._fields, tuple(self))
        )
        return f"Settings({', '.join(shown)})"

    @property
    def store_url(self) -> str:
        return self.store or str(self.state_dir / "checkpoints")

    @property
    def layout(self) -> StateLayout:
        return StateLayout(self.state_dir)

    @property
    def slurm_conf_path(self) -> Path | None:
        """This node's slurm.conf as Slurm finds it: slurm_conf (SLURM_CONF), else
        /etc/slurm/slurm.conf, else the copy a configless node's slurmd fetched
        (/run/slurm/conf/slurm.conf, Slurm 22.05 and later); None where there is none."""
        for path in (self.slurm_conf or "/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf"):
            if Path(path).exists():
                return Path(path)
        return None

    @property
    def slurm_conf_present(self) -> bool:
        """Whether this node has a Slurm configuration (scontrol would find a cluster)."""
        return self.slurm_conf_path is not None

    @property
    def node(self) -> str:
        if self.node_name:
            return self.node_name
        import socket  # here: most commands never ask

        return socket.gethostname()


# Each field's declaration, by name, in the order of the fields.
SETTINGS: dict[str, Setting] = {
    name: Settings.__annotations__[name].__metadata__[0] for name in Settings._fields
}


def env_name(name: str) -> str:
    """The environment variable of setting `name` ("" for one read from the file only)."""
    declared = SETTINGS[name].env
    return f"STASIS_{name.upper()}" if declared is None else declared


def env_names(name: str) -> list[str]:
    """Every variable that sets `name`: its own first, then its deprecated spellings."""
    own = env_name(name)
    return ([own] if own else []) + [old for old, key in DEPRECATED_ENV.items() if key == name]


def _convert(name: str, value: object, default: object) -> object:
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise UsageError(f"bad setting {name!r}: {value!r} is not true or false")
    if isinstance(default, float):
        try:
            seconds = float(str(value))
        except ValueError:
            raise UsageError(f"bad setting {name!r}: {value!r} is not a number") from None
        if not seconds > 0:
            raise UsageError(f"bad setting {name!r}: {seconds} is not above 0")
        return seconds
    if isinstance(default, int):
        try:
            number = int(str(value))
        except ValueError:
            raise UsageError(f"bad setting {name!r}: {value!r} is not a whole number") from None
        if number < 0:
            raise UsageError(f"bad setting {name!r}: {number} is below 0")
        return number
    if isinstance(default, tuple):
        items = value.split(":") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
            raise UsageError(f"bad setting {name!r}: {value!r} is not a list of paths")
        return tuple(i for i in items if i)
    if isinstance(default, Path):
        return Path(str(value))
    if not isinstance(value, str):
        raise UsageError(f"bad setting {name!r}: {value!r} is not a string")
    return value


def _from_file(file: Path) -> dict[str, object]:
    """The file's settings, its areas' tables ([storage], [slurm], ...) flattened."""
    import tomllib  # here: most nodes have no config file, and every CLI call comes here

    try:
        table = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise UsageError(f"config file {file} does not exist; fix STASIS_CONFIG") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read config file {file}: {e}") from e
    areas = {a.key: a for a in AREAS}
    values = {k: v for k, v in table.items() if not (k in areas and isinstance(v, dict))}
    for key, section in table.items():
        if key not in areas or not isinstance(section, dict):
            continue
        for name, value in section.items():
            where = f"bad setting {name!r} in [{key}] of {file}"
            if name not in SETTINGS:
                raise UsageError(f"{where}: no such setting (see docs/configuration.md)")
            if SETTINGS[name].area.key != key:
                raise UsageError(
                    f"{where}: it is a setting of [{SETTINGS[name].area.key}]; "
                    "move it there or to the top of the file"
                )
            if name in values:
                raise UsageError(f"{where}: set at the top of the file too; keep one")
            values[name] = value
    return values


def _deprecated(old: str, name: str) -> None:
    import logging  # here: only an old spelling pays for it

    logging.getLogger(__name__).warning(
        "%s is deprecated: set %s instead (it is read all the same)", old, env_name(name)
    )


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build the Settings from the config file and the environment (os.environ by default)."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    file = Path(env["STASIS_CONFIG"]) if env.get("STASIS_CONFIG") else DEFAULT_CONFIG_FILE
    if env.get("STASIS_CONFIG") or file.exists():
        values.update(_from_file(file))
    for old, name in DEPRECATED_ENV.items():
        if env.get(old):
            _deprecated(old, name)
            values[name] = env[old]
    for name, setting in SETTINGS.items():
        var = env_name(name)
        if var and (env.get(var) or (setting.empty_is_a_value and var in env)):
            values[name] = env[var]
    if isinstance(values.get("interval"), int | float) and not isinstance(values["interval"], bool):
        values["interval"] = str(values["interval"])  # `interval = 3600` in the file
    defaults = Settings._field_defaults
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise UsageError(f"bad setting {unknown[0]!r}: no such setting (see docs/configuration.md)")
    settings = Settings(**{k: _convert(k, v, defaults[k]) for k, v in values.items()})  # type: ignore[arg-type]
    if settings.store_id and not re.fullmatch(r"[0-9a-f]{32}", settings.store_id):
        raise UsageError(
            f"bad setting 'store_id': {settings.store_id[:40]!r} is not a store "
            "id (32 hex digits, as in the store's .stasis-store file)"
        )
    if settings.interval:
        asked, _ = interval_asked(settings.interval)
        if asked is None:
            raise UsageError(
                f"bad setting 'interval': {settings.interval[:40]!r} is neither \"\" (none), "
                '"auto" nor seconds (e.g. "3600")'
            )
        settings = settings._replace(interval="" if asked == "off" else asked)
    if not 0 <= settings.slurm_multinode <= 15:
        raise UsageError(
            f"bad setting 'slurm_multinode': {settings.slurm_multinode} is not 0 (off) or a "
            "cluster number from 1 to 15"
        )
    if settings.slurm_remote_port > 65535:
        raise UsageError(
            f"bad setting 'slurm_remote_port': {settings.slurm_remote_port} is not "
            "a TCP port (1..65535, or 0 for off)"
        )
    return settings


_NO_INTERVAL = {"0", "off", "none", "no", "false"}


def interval_asked(value: str) -> tuple[str | None, str | None]:
    """What a job's or a container's STASIS_INTERVAL asks (the same on Slurm and Kubernetes):
    "auto", seconds (as text, above 0), "off" (none, whatever the node's default: `off`, `0`,
    `none`, `no`, `false`), or None: nothing (unset), the node's `interval` applies; and a
    warning line for a value that means nothing (then ignored: as when unset)."""
    said = value.strip().lower()
    if not said:
        return None, None
    if said == "auto":
        return "auto", None
    if said in _NO_INTERVAL:
        return "off", None
    try:
        seconds = float(said)
    except ValueError:
        seconds = -1.0
    if seconds == 0:
        return "off", None
    if 0 < seconds < float("inf"):
        text = f"{seconds:.6f}".rstrip("0").rstrip(".")
        return (text, None) if text != "0" else ("off", None)
    return None, (
        f"STASIS_INTERVAL={value.strip()[:40]!r} is neither seconds, auto nor off: ignored "
        "(the node's default interval applies)"
    )


def fresh_if_unreachable(value: str) -> tuple[bool, str | None]:
    """What a job's or a container's STASIS_FRESH asks (the same on Slurm and Kubernetes):
    (True: start from the beginning when nobody can tell whether it has a checkpoint, i.e. the
    store or the node daemon cannot be reached; a checkpoint that can be found is resumed all
    the same, since a requeued job or a restarted container keeps its environment), and a
    warning line for a value that means nothing (then ignored: wait, as when unset)."""
    said = value.strip().lower()
    if said in _TRUE or said == "if-unreachable":
        return True, None
    if said in _FALSE:
        return False, None
    return False, (
        f"STASIS_FRESH={value.strip()[:40]!r} is neither 1, true, yes or "
        "if-unreachable (start from the beginning when nobody can tell whether "
        "there is a checkpoint) nor 0 or false: ignored"
    )
