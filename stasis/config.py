"""One Settings object for the daemon and the CLI: a TOML file plus STASIS_* environment variables.

The environment is read once, in `load_settings()`, called at the entry point; everything below
receives the Settings object explicitly. Precedence: environment > file > defaults. The file is
STASIS_CONFIG, else /etc/stasis/config.toml when it exists.

    STASIS_SOCKET        unix socket of the daemon            (/run/stasis/stasis.sock)
    STASIS_STATE_DIR     daemon state: database, job logs    (/var/lib/stasis)
    STASIS_STORE         checkpoint store: directory or fsspec URL  (<state_dir>/checkpoints)
    STASIS_SOCKET_GROUP  restrict the socket to this group     ("": every local user)
    STASIS_KEEP          checkpoints kept per label, 0 = all  (5)
    STASIS_KEEP_FINISHED_JOBS       rows of finished jobs the job table keeps (the newest),
                         0 = all  (1000)
    STASIS_FINISHED_JOBS_MAX_AGE_S  rows of jobs that ended longer ago are dropped; 0 = never
                         (2592000: 30 days)
    STASIS_KEEP_CRIU_LOGS           CRIU logs kept (the newest), 0 = all  (500)
    STASIS_CRIU_LOGS_MAX_AGE_S      CRIU logs older than this are removed; 0 = never
                         (1209600: 14 days)
    STASIS_CRIU          criu binary                          (first of /usr/local/sbin/criu, PATH)
    STASIS_TINI          tini binary (Slurm jobs' init)       (tini-static, tini on PATH)
    STASIS_INIT          stasis-init binary (jobs' init)      (/usr/local/libexec/stasis/)
    STASIS_STAGE_DIR     node-local memory (tmpfs) where leave-running dumps are staged
                         first; "auto" = a tmpfs the daemon mounts on /run/stasis-stage, used
                         while the disk is behind; "" = never  ("auto")
    STASIS_LAZY_RESTORE  restore lazily by default (userfaultfd; `restore --lazy`)  (false)
    STASIS_NODE_LOCAL_LIMIT  bytes of node-local files (/tmp, /var/tmp, /dev/shm, $TMPDIR...)
                         a job's checkpoint carries; a dump over it is refused  (268435456)
    STASIS_SITE_KEY      a key file every node of the site shares: checkpoints are signed with
                         it and trusted by every node that has it  ("": each node signs with
                         its own <state_dir>/keys/node.key)
    STASIS_TRUSTED_KEYS  key files (or directories of them) of other nodes whose checkpoints
                         this node restores; ':'-separated, a list in the file  (none)
    STASIS_REMOVE_CORRUPT_AFTER_S  checkpoints whose manifest is garbage are removed by the
                         daemon this long after it was written; 0 = never  (604800: 7 days)
    STASIS_REQUEST_TIMEOUT_S  seconds a client has to send a request's headers once connected,
                         and again its body once the headers are in; then it is cut off;
                         0 = no limit  (10)
    STASIS_MAX_CONNECTIONS_PER_UID  connections one user (not root) may hold open on the
                         daemon's socket at once; 0 = no cap  (64)
    STASIS_NODE_NAME     this node's name in checkpoints it makes and notes it leaves in the
                         store  (the host name)
    STASIS_SLURM_NODE_NAME  this node's NodeName in slurm.conf, for a drain  (the short host
                         name)
    STASIS_SLURM_REMOTE_PORT  the TCP port every node's daemon of the Slurm cluster listens on
                         for `stasis dump --slurm-job` and `stasis slurm drain` from other nodes
                         (munge-authenticated), and the CLI sends them to; one port cluster-wide;
                         0 = off  (0; 6821, beside Slurm's own 6817-6819, is the suggested one)
    STASIS_SLURM_REMOTE_ADDRESS  the address that listener binds  ("": every address)
    STASIS_STORE_ID      the id a local (shared directory) store must have, the one in its
                         .stasis-store marker: a store without it (an empty mount point,
                         also on a node that never used the store) or with another id is
                         "cannot tell", never empty  ("": only the stores this node used)
    STASIS_STORE_WAIT_S  seconds a starting Slurm job waits for the store or the node daemon
                         when it cannot tell whether it has a checkpoint; then it is requeued
                         held, never started from the beginning  (300)
    STASIS_NETLOCK_TIMEOUT_S  seconds this node keeps CRIU's network lock (the firewall rules
                         that hold a stopped job's TCP peers waiting) for a checkpoint that is
                         neither restored nor deleted; 0 = until then  (900)
    STASIS_TEST_PAGE_DELAY_MS  TESTS ONLY: milliseconds the page server of a lazy restore from
                         a store holds back each answer (a deterministic window before all
                         pages are back)  (0)
    STASIS_KEEP_MAX_AGE_S  checkpoints older than this are deleted (a label's newest one
                         always stays); 0 = no age limit  (0)
    STASIS_KILL_TIMEOUT_S  seconds `stasis kill` gives a job to end on its signal (TERM)
                         before it sends SIGKILL; 0 = SIGKILL at once  (10)
    STASIS_ENCRYPT       encrypt every dump's images (AES-256-GCM; `dump --encrypt` per dump)
                         (false)
    STASIS_ENCRYPTION_KEY_FILE  root-only file of 32 random bytes (raw or base64) whose key
                         wraps each checkpoint's data key; read by the daemon  ("": none)
    STASIS_OLD_ENCRYPTION_KEY_FILES  earlier key files, still accepted for reading (restore,
                         `checkpoints rekey`); ':'-separated, a list in the file  (none)
    STASIS_RUNC          the runc that containers run on (stasis-runc hands everything to it)
                         ("": /usr/sbin/runc, else the first on PATH)
    STASIS_K8S_MIN_INTERVAL_S  floor on containers' checkpoint intervals (STASIS_INTERVAL,
                         stasis.dev/interval): a shorter one is raised to it; 0 = none  (60)
    STASIS_INTERVAL_MIN_S  floor on the interval `STASIS_INTERVAL=auto` chooses (Young/Daly,
                         stasis/interval.py)  (300)
    STASIS_INTERVAL_MAX_S  ceiling on it; also the interval of a job whose partition shows no
                         interruption in Slurm's accounting  (86400)
    STASIS_K8S_STOP_TIMEOUT_S  seconds a container's checkpoint at its stop may take before
                         the container is stopped as usual without it  (20)
    STASIS_K8S_RESTORE_ATTEMPTS  failed restores of one good checkpoint on a node (each
                         fails the container's create, retried by the kubelet) before the
                         label's previous checkpoint is tried; 0 = never give up  (3)
    STASIS_CONTAINERD_ADDRESS  containerd's socket, whose task events tell how containers
                         ended  (/run/containerd/containerd.sock)
    STASIS_KUBECONFIG    the kubeconfig file the node agent (`stasis k8s agent`) and
                         `stasis k8s checkpoint` use; "" = the pod's service account
                         (in-cluster), else $KUBECONFIG or ~/.kube/config  ("")
    STASIS_K8S_CHECK_INTERVAL_S  seconds between the node agent's checks of its node (the
                         not-ready taint follows them)  (10)
    STASIS_CONTROLPLANE_URL  the control plane this node joins, and the admin CLI talks to;
                         "" = none  (""; CEDANA_URL accepted too)
    STASIS_CLUSTER_ID    the cluster this node belongs to (checked against its token)  ("";
                         CEDANA_CLUSTER_ID)
    STASIS_AUTH_TOKEN    the cluster's token (a node) or the admin token (the CLI); never
                         logged  (""; CEDANA_AUTH_TOKEN)
    STASIS_CONTROLPLANE_HEARTBEAT_S  seconds between a node's heartbeats  (10)
    STASIS_CONTROLPLANE_COMMIT_TIMEOUT_S  how long a job a control plane's restore brought
                         back waits, stopped, for the control plane to confirm the restore is
                         still this node's before it resumes; past it the job is killed
                         unresumed, its checkpoint kept, the restore retried or re-targeted
                         (30)
    STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP  let the node and the CLI send their token over plain
                         http:// to a control plane that is not on this host's loopback (anyone
                         on the network between reads it); without it such a URL is refused
                         (false)

An s3:// store takes its endpoint, region and credentials where AWS tools look for them
(AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the
shared files ~/.aws/config and ~/.aws/credentials, read by botocore itself), or from the file:

    s3_endpoint_url = "http://10.0.0.5:8333"
    s3_region = "us-east-1"
    s3_access_key_id = "..."
    s3_secret_access_key_file = "/etc/stasis/s3-secret"   # root-only; holds the secret

The secret goes in a root-only file of its own (`s3_secret_access_key_file`), so that the config
file stays readable by the users whose `stasis` commands read it too; `s3_secret_access_key`
in the config file itself only suits a config file nobody but root reads. Never logged. The
file's values win over the environment's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from stasis.errors import UsageError
from stasis.layout import StateLayout

DEFAULT_CONFIG_FILE = Path("/etc/stasis/config.toml")

_ENV_KEYS = {
    "STASIS_RUNC": "runc",
    "STASIS_CONTAINERD_ADDRESS": "containerd_address",
    "STASIS_K8S_STOP_TIMEOUT_S": "k8s_stop_timeout_s",
    "STASIS_K8S_MIN_INTERVAL_S": "k8s_min_interval_s",
    "STASIS_INTERVAL_MIN_S": "interval_min_s",
    "STASIS_INTERVAL_MAX_S": "interval_max_s",
    "STASIS_K8S_RESTORE_ATTEMPTS": "k8s_restore_attempts",
    "STASIS_KUBECONFIG": "kubeconfig",
    "STASIS_K8S_CHECK_INTERVAL_S": "k8s_check_interval_s",
    # Cedana's spellings first: the STASIS_ ones, read after them, win.
    "CEDANA_URL": "controlplane_url",
    "CEDANA_CLUSTER_ID": "cluster_id",
    "CEDANA_AUTH_TOKEN": "auth_token",
    "STASIS_CONTROLPLANE_URL": "controlplane_url",
    "STASIS_CLUSTER_ID": "cluster_id",
    "STASIS_AUTH_TOKEN": "auth_token",
    "STASIS_CONTROLPLANE_HEARTBEAT_S": "controlplane_heartbeat_s",
    "STASIS_CONTROLPLANE_COMMIT_TIMEOUT_S": "controlplane_commit_timeout_s",
    "STASIS_CONTROLPLANE_ALLOW_PLAIN_HTTP": "controlplane_allow_plain_http",
    "STASIS_CONTROLPLANE_DB": "controlplane_db",
    "STASIS_CONTROLPLANE_LISTEN": "controlplane_listen",
    "STASIS_CONTROLPLANE_ADMIN_TOKEN_FILE": "controlplane_admin_token_file",
    "STASIS_CONTROLPLANE_CERT": "controlplane_cert",
    "STASIS_CONTROLPLANE_KEY": "controlplane_key",
    "STASIS_CONTROLPLANE_SERVE_PLAIN_HTTP": "controlplane_serve_plain_http",
    "STASIS_CONTROLPLANE_BEHIND_TLS": "controlplane_behind_tls",
    "STASIS_CONTROLPLANE_LOST_AFTER_S": "controlplane_lost_after_s",
    "STASIS_CONTROLPLANE_COMMAND_LEASE_S": "controlplane_command_lease_s",
    "STASIS_CONTROLPLANE_SESSION_TTL_S": "controlplane_session_ttl_s",
    "STASIS_CONTROLPLANE_MIN_INTERVAL_S": "controlplane_min_interval_s",
    "STASIS_SOCKET": "socket",
    "STASIS_STATE_DIR": "state_dir",
    "STASIS_STORE": "store",
    "STASIS_SOCKET_GROUP": "socket_group",
    "STASIS_KEEP": "keep",
    "STASIS_KEEP_FINISHED_JOBS": "keep_finished_jobs",
    "STASIS_FINISHED_JOBS_MAX_AGE_S": "finished_jobs_max_age_s",
    "STASIS_KEEP_CRIU_LOGS": "keep_criu_logs",
    "STASIS_CRIU_LOGS_MAX_AGE_S": "criu_logs_max_age_s",
    "STASIS_CRIU": "criu",
    "STASIS_TINI": "tini",
    "STASIS_INIT": "init",
    "STASIS_STAGE_DIR": "stage_dir",
    "STASIS_LAZY_RESTORE": "lazy_restore",
    "STASIS_LAZY_DRAIN_TIMEOUT_S": "lazy_drain_timeout_s",
    "STASIS_VERIFY_NEW_CHECKPOINTS": "verify_new_checkpoints",
    "STASIS_VERIFY_TIMEOUT_S": "verify_timeout_s",
    "STASIS_NODE_LOCAL_LIMIT": "node_local_limit",
    "STASIS_PRIVATE_TMP": "private_tmp",
    "STASIS_SITE_KEY": "site_key",
    "STASIS_TRUSTED_KEYS": "trusted_keys",
    "STASIS_REMOVE_CORRUPT_AFTER_S": "remove_corrupt_after_s",
    "STASIS_REQUEST_TIMEOUT_S": "request_timeout_s",
    "STASIS_MAX_CONNECTIONS_PER_UID": "max_connections_per_uid",
    "STASIS_KILL_TIMEOUT_S": "kill_timeout_s",
    "STASIS_NETLOCK_TIMEOUT_S": "netlock_timeout_s",
    "STASIS_DB_BUSY_TIMEOUT_S": "db_busy_timeout_s",
    "STASIS_NODE_NAME": "node_name",
    "STASIS_SLURM_NODE_NAME": "slurm_node_name",
    "STASIS_SLURM_REMOTE_PORT": "slurm_remote_port",
    "STASIS_SLURM_REMOTE_ADDRESS": "slurm_remote_address",
    "STASIS_STORE_WAIT_S": "store_wait_s",
    "STASIS_STORE_ID": "store_id",
    "SLURM_CONF": "slurm_conf",  # Slurm's own variable: which cluster scontrol talks to
    "STASIS_TEST_PAGE_DELAY_MS": "test_page_delay_ms",
    "STASIS_TEST_FAULT_POINTS": "test_fault_points",
    "STASIS_KEEP_MAX_AGE_S": "keep_max_age_s",
    "STASIS_ENCRYPT": "encrypt",
    "STASIS_ENCRYPTION_KEY_FILE": "encryption_key_file",
    "STASIS_OLD_ENCRYPTION_KEY_FILES": "old_encryption_key_files",
}
# Variables whose empty value means something ("" turns staging off), not "unset".
_EMPTY_MEANS_SOMETHING = {"STASIS_STAGE_DIR"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


# A NamedTuple, not a pydantic model or a dataclass: every CLI call builds one, and importing
# pydantic costs ~70 ms of each `stasis` invocation, dataclasses (through inspect) ~12 ms.
class Settings(NamedTuple):
    socket: Path = Path("/run/stasis/stasis.sock")
    state_dir: Path = Path("/var/lib/stasis")
    store: str = ""
    # "" (default): every local user may talk to the daemon, each acting on their own jobs and
    # checkpoints only (peer credentials). A group name restricts the socket to its members.
    socket_group: str = ""
    keep: int = 5
    # What would grow without bound otherwise (the daemon prunes at its start, then hourly):
    # 5,000 rows made `stasis ps --json` take 244 ms; CRIU writes ~110 KB of log per dump.
    # A live job's row and its CRIU logs are never pruned. 0 = no limit.
    keep_finished_jobs: int = 1000
    finished_jobs_max_age_s: int = 30 * 86400
    keep_criu_logs: int = 500
    criu_logs_max_age_s: int = 14 * 86400
    criu: str = ""
    tini: str = ""
    init: str = ""
    # "auto": the page cache while the disk keeps up (as fast, no second copy), a tmpfs while
    # it is behind (the job would stay frozen on writeback): daemon/staging.py, bench/freeze.py.
    stage_dir: str = "auto"
    lazy_restore: bool = False
    # A graceful stop (SIGTERM) waits this long for lazily restored jobs to have all their
    # memory back: the pages come from the daemon, which takes its page server with it.
    lazy_drain_timeout_s: float = 60.0
    # Each checkpoint this node publishes is verified (`stasis verify`: restored in a sandbox,
    # stopped, removed) in the background at low priority; off: verified only when asked.
    verify_new_checkpoints: bool = False
    # How long one `stasis verify` may take (fetch, sandboxed restore, check) before it fails.
    verify_timeout_s: float = 600.0
    # The node-local files a job has open travel in its checkpoint (engine/nodelocal.py); 256 MiB
    # holds JVM perf data, sockets' dirs, SQLite files, scratch files, not a whole dataset.
    node_local_limit: int = 256 << 20
    # `stasis run` without --private-tmp/--no-private-tmp: the job gets its own /tmp and /var/tmp
    # (tmpfs's of node_local_limit each, in its checkpoint, gone with it; engine/privatetmp.py).
    private_tmp: bool = False
    # Manifests are signed (stasis/store/signing.py): with the site key when there is one, else
    # with the node's own key. Both are trusted, and so is every key file named here.
    site_key: str = ""
    trusted_keys: tuple[str, ...] = ()
    # Nobody can restore a checkpoint whose manifest is garbage, nor tell whose it is; after this
    # long it is removed (long enough for someone to look at it first). Unsigned or untrusted
    # ones are never removed by themselves: a shared store may hold another site's.
    remove_corrupt_after_s: int = 7 * 86400
    # Our own clients send a whole request at once; a slow or stalled one (or a hostile one)
    # must not hold the daemon's files for long.
    request_timeout_s: int = 10
    # Enough for one user's jobs, their Slurm hooks and their commands at once; root is not
    # counted (its requests are always served).
    max_connections_per_uid: int = 64
    # Long enough for a server to finish its requests and write its state, short enough that a
    # job which ignores TERM is not left running for long (`stasis kill --timeout` overrides).
    kill_timeout_s: int = 10
    # A peer's TCP gives up on a silent connection after ~15 minutes (Linux: tcp_retries2=15);
    # a lock held longer only keeps that address/port pair blocked.
    netlock_timeout_s: int = 900
    # How long a write to the daemon's job database waits for another process's lock before
    # the daemon falls back (a dump still ends its job; the record is retried).
    db_busy_timeout_s: float = 5.0
    node_name: str = ""  # "" = the host name (`Settings.node`)
    slurm_node_name: str = ""  # this node's NodeName in slurm.conf; "" = the short host name
    slurm_conf: str = ""  # "" = Slurm's default, /etc/slurm/slurm.conf
    # Off unless asked: it is root's daemon listening on the network, a port the site's
    # firewall must let through between its nodes, and a node without Slurm (containers, a
    # laptop, the test suite's many daemons) must not open one.
    slurm_remote_port: int = 0
    slurm_remote_address: str = ""
    # "Cannot tell" is never "no checkpoint": how long a starting job waits it out (issue 28).
    store_wait_s: int = 300
    # A node remembers the local stores it used (stasis/store/marker.py); a node that never
    # used its store (new, reinstalled) needs this to tell an unmounted one from an empty one.
    store_id: str = ""
    # Encryption at rest (stasis/store/crypt.py): the key file wraps a fresh data key per
    # checkpoint; rotating it means a new file here, the old one in old_encryption_key_files,
    # and `stasis checkpoints rekey`.
    encrypt: bool = False
    encryption_key_file: str = ""
    old_encryption_key_files: tuple[str, ...] = ()
    # Tests only: see STASIS_TEST_PAGE_DELAY_MS.
    test_page_delay_ms: int = 0
    # Tests only: where this process SIGKILLs itself (stasis/faults.py).
    test_fault_points: tuple[str, ...] = ()
    keep_max_age_s: int = 0
    # Containers (stasis/k8s): the real runc, and the part of a pod's grace period (30 s by
    # default) a checkpoint at the container's stop may use.
    runc: str = ""
    k8s_stop_timeout_s: int = 20
    k8s_min_interval_s: int = 60
    # `auto` intervals (stasis/interval.py): never more often than the floor (each checkpoint
    # takes a dump slot and store space), never rarer than the ceiling (a rate of zero in the
    # accounting window proves no rate of zero).
    interval_min_s: float = 300.0
    interval_max_s: float = 86400.0
    # Failed `runc restore`s of one good checkpoint on a node (each fails the container's
    # create, which the kubelet retries) before the label's previous checkpoint is tried
    # instead; 0 = never give up on it (issue 28).
    k8s_restore_attempts: int = 3
    containerd_address: str = "/run/containerd/containerd.sock"
    kubeconfig: str = ""
    k8s_check_interval_s: float = 10.0
    # The control plane (stasis/controlplane): where this node reports, with which token.
    controlplane_url: str = ""
    cluster_id: str = ""
    auth_token: str = ""
    controlplane_heartbeat_s: float = 10.0
    # A restore's fence (stasis.controlplane.node): the wait for the control plane's commit.
    controlplane_commit_timeout_s: float = 30.0
    # Off: a token sent over plain HTTP off this host is anyone's on the path (issue 27).
    controlplane_allow_plain_http: bool = False
    # The control plane service (`stasis controlplane serve`), the same defaults as its flags:
    # "" db = <state_dir>/controlplane.db; "" admin token file = printed once at the first
    # start; cert and key both set = HTTPS. serve_plain_http: plain HTTP on a non-loopback
    # address (tokens in the clear); behind_tls: a TLS-terminating proxy is in front.
    controlplane_db: str = ""
    controlplane_listen: str = "127.0.0.1:8470"
    controlplane_admin_token_file: str = ""
    controlplane_cert: str = ""
    controlplane_key: str = ""
    controlplane_serve_plain_http: bool = False
    controlplane_behind_tls: bool = False
    controlplane_lost_after_s: float = 60.0
    controlplane_command_lease_s: float = 60.0
    controlplane_session_ttl_s: int = 8 * 3600
    controlplane_min_interval_s: int = 60
    # Only from the file: the environment has AWS's own variables for these (botocore reads
    # them). "" = leave it to botocore.
    s3_endpoint_url: str = ""
    s3_region: str = ""
    s3_access_key_id: str = ""
    s3_secret_access_key: str = ""
    s3_secret_access_key_file: str = ""

    def __repr__(self) -> str:
        # Settings end up in tracebacks and debug output; the secret must not.
        shown = self._replace(
            s3_secret_access_key="***" if self.s3_secret_access_key else "",
            auth_token="***" if self.auth_token else "",
        )
        fields = ", ".join(f"{k}={v!r}" for k, v in zip(self._fields, tuple(shown)))
        return f"Settings({fields})"

    @property
    def store_url(self) -> str:
        return self.store or str(self.state_dir / "checkpoints")

    @property
    def layout(self) -> StateLayout:
        return StateLayout(self.state_dir)

    @property
    def slurm_conf_present(self) -> bool:
        """Whether this node has a Slurm configuration (scontrol would find a cluster)."""
        return Path(self.slurm_conf or "/etc/slurm/slurm.conf").exists()

    @property
    def node(self) -> str:
        if self.node_name:
            return self.node_name
        import socket  # here: most commands never ask

        return socket.gethostname()


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


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build the Settings from the config file and the environment (os.environ by default)."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    file = Path(env["STASIS_CONFIG"]) if env.get("STASIS_CONFIG") else DEFAULT_CONFIG_FILE
    if env.get("STASIS_CONFIG") or file.exists():
        import tomllib  # here: most nodes have no config file, and every CLI call comes here

        try:
            values.update(tomllib.loads(file.read_text()))
        except FileNotFoundError:
            raise UsageError(f"config file {file} does not exist; fix STASIS_CONFIG") from None
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"cannot read config file {file}: {e}") from e
    for key, name in _ENV_KEYS.items():
        if env.get(key) or (key in _EMPTY_MEANS_SOMETHING and key in env):
            values[name] = env[key]
    defaults = Settings._field_defaults
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise UsageError(f"bad setting {unknown[0]!r}: no such setting (see stasis/config.py)")
    settings = Settings(**{k: _convert(k, v, defaults[k]) for k, v in values.items()})  # type: ignore[arg-type]
    if settings.store_id and not re.fullmatch(r"[0-9a-f]{32}", settings.store_id):
        raise UsageError(
            f"bad setting 'store_id': {settings.store_id[:40]!r} is not a store "
            "id (32 hex digits, as in the store's .stasis-store file)"
        )
    if settings.slurm_remote_port > 65535:
        raise UsageError(
            f"bad setting 'slurm_remote_port': {settings.slurm_remote_port} is not "
            "a TCP port (1..65535, or 0 for off)"
        )
    return settings


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
