"""`stasis slurm install` / `uninstall`: put the plugin set in place with minimal, reversible edits.

Per role:
  every role   slurm.conf: `lua` appended to JobSubmitPlugins and CliFilterPlugins,
               `preempt_send_user_signal` to SlurmctldParameters, with slurm_multinode set
               `Alloc` to PrologFlags (existing lists are kept; a key that is missing is added);
               cli_filter.lua (srun/sbatch read it on every node)
  controller   job_submit.lua beside slurm.conf
  worker       the SPANK plugin built from its C source against <slurm/spank.h>, the launcher,
               our srun for the steps of opted-in jobs (bin/srun: stasis.slurm.steps), one
               `optional ...stasis_spank.so ...` line in plugstack.conf, the node daemon's
               systemd unit (enabled only where systemd runs)
An existing job_submit.lua or cli_filter.lua is merged with, not replaced: our block is appended
and wraps the site's own function (ours runs first, then the site's, whose answer is the one
returned: a rejection by the site's script still rejects). Slurm runs these scripts as root or
SlurmUser, and the installer reads and rewrites them as root: a site script that is a link, not
owned by root, or writable by group or others is refused, never read or followed. Every touched file's original bytes are recorded beside
slurm.conf (`.stasis-install.json`), so that `uninstall` restores them byte for byte (a file
edited since is reverted by taking our block and lines out instead). Installing twice changes
nothing. Applying it needs `scontrol reconfigure`, not a restart.

Configless (slurmctld serves slurm.conf, plugstack.conf and cli_filter.lua; a node has no
slurm.conf but slurmd's cached copy in /run/slurm/conf): installed on the controller with every
role it serves (`--node-role controller --node-role worker`: the files it serves), then on each
node where --slurm-conf does not exist and that copy does, `--node-role worker` puts only the
node's own files in place (plugin, launcher, srun, unit without SLURM_CONF: Slurm finds its copy).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any

from stasis.config import load_settings
from stasis.errors import SlurmError, StasisError, UsageError
from stasis.slurm import steps
from stasis.slurm.partnames import RSH_NAME

ROLES = ("controller", "worker", "login")
RECORD_NAME = ".stasis-install.json"
BEGIN = "-- >>> stasis >>>"
END = "-- <<< stasis <<<"
SO_NAME = "stasis_spank.so"
C_NAME = "stasis_spank.c"
LAUNCHER_NAME = "stasis-slurm-launch"
UNIT_NAME = "stasis.service"
DEFAULT_SLURM_CONF = Path("/etc/slurm/slurm.conf")
DEFAULT_LIB_DIR = Path("/usr/local/lib/stasis")
DEFAULT_SYSTEMD_DIR = Path("/etc/systemd/system")
# A configless node's slurm.conf: slurmd (22.05 and later) links it to what it fetched.
CONFIGLESS_CONF = Path("/run/slurm/conf/slurm.conf")


@dataclass(frozen=True)
class InstallOptions:
    roles: frozenset[str]
    slurm_conf: Path = DEFAULT_SLURM_CONF
    lib_dir: Path = DEFAULT_LIB_DIR
    stasis_config: Path | None = None  # the node daemon's config file (default: its own default)
    systemd_dir: Path | None = DEFAULT_SYSTEMD_DIR  # None: no unit file
    python: str = sys.executable
    warn_s: int = 60  # --signal=B:URG@N, capped at a sixth of the job's time limit
    configless_conf: Path = CONFIGLESS_CONF
    # slurm_multinode for job_submit.lua; None: the setting as stasis_config (or, without it or
    # with a per-node "%n" path, the environment) has it.
    multinode: int | None = None


@dataclass
class Change:
    path: Path
    before: bytes | None
    after: bytes | None  # None: delete
    mode: int = 0o644

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        a = (self.before or b"").decode(errors="replace").splitlines(keepends=True)
        b = (self.after or b"").decode(errors="replace").splitlines(keepends=True)
        lines = difflib.unified_diff(
            a,
            b,
            fromfile=str(self.path) if self.before is not None else "/dev/null",
            tofile=str(self.path) if self.after is not None else "/dev/null",
        )
        return "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            for line in lines
        )


@dataclass
class Plan:
    changes: list[Change] = field(default_factory=list)
    build_so: bool = False
    so_path: Path | None = None
    c_path: Path | None = None
    unit: Path | None = None


def _asset(name: str) -> str:
    return resources.files("stasis.slurm").joinpath("files", name).read_text()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _sha(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _check_plain(path: Path | str, what: str) -> None:
    text = str(path)
    if any(c.isspace() for c in text) or "#" in text or not text.startswith("/"):
        raise UsageError(
            f"{what} {text!r}: Slurm's config files need an absolute path without " "spaces or '#'"
        )


def check_site_script(path: Path) -> None:
    """Refuse a site's lua script that someone other than root could have written or pointed
    elsewhere (a link, another owner, group- or world-writable): root would run their code."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    why = ""
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid not in (0, os.geteuid()):
        why = f"is owned by uid {st.st_uid}, not root"
    elif st.st_mode & 0o022:
        why = f"is writable by {'group' if st.st_mode & 0o020 else 'others'} (mode {st.st_mode & 0o7777:o})"
    if why:
        raise UsageError(
            f"refusing the site's {path}: it {why}, and Slurm runs it as root; make it a plain "
            f"file owned by root, mode 644 or stricter (chown root: {path}; chmod go-w {path}), "
            "then install again"
        )


# -- slurm.conf ---------------------------------------------------------------------------------


def _key_re(key: str) -> re.Pattern[str]:
    return re.compile(rf"^(\s*{key}\s*=\s*)([^\s#]*)(.*)$", re.IGNORECASE)


def conf_value(text: str, key: str) -> str | None:
    """The value of `key` in slurm.conf text (keys are case-insensitive), or None."""
    pattern = _key_re(key)
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            return m.group(2)
    return None


def add_to_list(text: str, key: str, item: str, aliases: tuple[str, ...] = ()) -> str:
    """`key`'s comma list with `item` appended (unless there already), or `key=item` added."""
    pattern = _key_re(key)
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        body = line.rstrip("\n")
        m = pattern.match(body)
        if not m:
            continue
        items = [v for v in m.group(2).split(",") if v]
        if item in items or any(a in items for a in aliases):
            return text
        value = ",".join([*items, item])
        lines[i] = m.group(1) + value + m.group(3) + line[len(body) :]
        return "".join(lines)
    if text and not text.endswith("\n"):
        text += "\n"
    return text + f"{key}={item}\n"


def edit_slurm_conf(text: str, multinode: bool = False) -> str:
    """`multinode` (slurm_multinode set): PrologFlags gets Alloc, so that every node of a job
    runs its prolog (our plugin's job_prolog, which makes the node's part of the job's network)
    when the job is allocated: a node must route the job's subnet before srun, inside that
    network, connects to its slurmd (the first step's launch would otherwise be what runs it)."""
    text = add_to_list(text, "JobSubmitPlugins", "lua", ("job_submit/lua",))
    text = add_to_list(text, "CliFilterPlugins", "lua", ("cli_filter/lua",))
    if multinode:
        text = add_to_list(text, "PrologFlags", "Alloc", ("alloc", "Contain", "contain"))
    return add_to_list(text, "SlurmctldParameters", "preempt_send_user_signal")


# -- lua blocks, plugstack line -----------------------------------------------------------------


def merge_block(text: str | None, block: str) -> str:
    """`text` with our marked block appended, or the block already there replaced by `block`."""
    if text is None or not text.strip():
        return block
    start, end = text.find(BEGIN), text.find(END)
    if start >= 0 and end > start:
        end += len(END)
        if text[end : end + 1] == "\n":
            end += 1
        return text[:start] + block + text[end:]
    sep = "" if text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
    return text + sep + block


def remove_block(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return text
    end += len(END)
    if text[end : end + 1] == "\n":
        end += 1
    head = text[:start]
    if head.endswith("\n\n"):
        head = head[:-1]
    return head + text[end:]


def plugstack_line(opts: InstallOptions) -> str:
    parts = [
        f"optional {opts.lib_dir / SO_NAME}",
        f"python={opts.python}",
        f"launcher={opts.lib_dir / LAUNCHER_NAME}",
    ]
    if opts.stasis_config:
        parts.append(f"conf={opts.stasis_config}")
    parts.append(f"slurm_conf={opts.slurm_conf}")
    if _multinode(opts):
        # Only then does the plugin's job prolog run Python (every job, every node).
        parts.append("multinode=1")
    return " ".join(parts) + "\n"


def _is_our_plugstack_line(line: str) -> bool:
    words = line.split()
    return len(words) >= 2 and words[1].endswith("/" + SO_NAME)


def merge_plugstack(text: str | None, line: str) -> str:
    lines = (text or "").splitlines(keepends=True)
    for i, old in enumerate(lines):
        if _is_our_plugstack_line(old):
            lines[i] = line
            return "".join(lines)
    body = "".join(lines)
    if body and not body.endswith("\n"):
        body += "\n"
    return body + line


def launcher_text(python: str) -> str:
    return (
        f"#!{python} -I\n"
        '"""The batch step\'s first process for jobs under stasis (see '
        'stasis.slurm.launcher)."""\n'
        "from stasis.slurm.launcher import main\n\nmain()\n"
    )


def srun_text(python: str) -> str:
    return (
        f"#!{python} -I\n"
        '"""srun for the steps of jobs under stasis: those that stay on the node run in the '
        'job\'s tree (see stasis.slurm.steps)."""\n'
        "from stasis.slurm.steps import main\n\nmain()\n"
    )


def srun_path(lib_dir: Path) -> Path:
    return steps.install_dir(lib_dir) / steps.SRUN_NAME


def rsh_text(python: str) -> str:
    return (
        f"#!{python} -I\n"
        '"""The launch agent of a protected job on several nodes: MPI starts its daemons on the '
        'job\'s other nodes through it (see stasis.slurm.rsh)."""\n'
        "import sys\n\nfrom stasis.slurm.rsh import main\n\nsys.exit(main())\n"
    )


def rsh_path(lib_dir: Path) -> Path:
    return steps.install_dir(lib_dir) / RSH_NAME


def unit_text(opts: InstallOptions, configless: bool = False) -> str:
    stasis = Path(opts.python).parent / "stasis"
    # configless: no SLURM_CONF (a path that does not exist stops scontrol; Slurm finds its copy).
    env = [] if configless else [f"Environment=SLURM_CONF={opts.slurm_conf}"]
    if opts.stasis_config:
        env.append(f"Environment=STASIS_CONFIG={opts.stasis_config}")
    return "\n".join(
        [
            "[Unit]",
            "Description=stasis node daemon: checkpoint and restore of Slurm jobs",
            "After=network.target",
            "",
            "[Service]",
            f"ExecStart={stasis} daemon",
            *env,
            "Restart=on-failure",
            "# Jobs outlive a restart of the daemon: stop only the daemon's own process.",
            "KillMode=process",
            "# A stop waits for lazy restores' pages (lazy_drain_timeout_s, 60 s) before the daemon ends.",
            "TimeoutStopSec=120",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


# -- plan, apply, uninstall ---------------------------------------------------------------------


def _record_path(slurm_conf: Path) -> Path:
    return slurm_conf.parent / RECORD_NAME


def _load_record(slurm_conf: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(_record_path(slurm_conf).read_text())
        return data
    except FileNotFoundError:
        return {"version": 1, "files": {}}
    except ValueError as e:
        raise SlurmError(f"{_record_path(slurm_conf)} is unreadable: {e}") from e


def plan(opts: InstallOptions) -> Plan:
    bad = set(opts.roles) - set(ROLES)
    if bad or not opts.roles:
        raise UsageError(
            f"unknown node role {', '.join(sorted(bad)) or '(none)'}: " f"use {', '.join(ROLES)}"
        )
    conf_text = _read(opts.slurm_conf)
    configless = conf_text is None and opts.configless_conf.exists()
    if conf_text is None and not (configless and opts.roles == {"worker"}):
        raise UsageError(
            f"{opts.slurm_conf} does not exist; point --slurm-conf at slurm.conf"
            + (
                " (on a configless node, only --node-role worker installs: the controller's "
                "install writes what slurmctld serves)"
                if configless
                else ""
            )
        )
    etc = opts.slurm_conf.parent
    p = Plan()

    def text_change(path: Path, make: Callable[[str | None], str], mode: int = 0o644) -> None:
        before = _read(path)
        after = make(before.decode() if before is not None else None).encode()
        p.changes.append(Change(path, before, after, mode))

    if conf_text is None:
        _plan_node_files(opts, p, text_change, configless=True)
        return p
    multinode = _multinode(opts) > 0
    text_change(opts.slurm_conf, lambda t: edit_slurm_conf(t or "", multinode))
    for name in ("cli_filter.lua", "job_submit.lua"):
        check_site_script(etc / name)
    cli_block = _asset("cli_filter.lua").replace("@WARN_S@", str(int(opts.warn_s)))
    text_change(etc / "cli_filter.lua", lambda t: merge_block(t, cli_block))
    if "controller" in opts.roles:
        submit_block = _asset("job_submit.lua").replace("@MULTINODE@", str(_multinode(opts)))
        text_change(etc / "job_submit.lua", lambda t: merge_block(t, submit_block))
    if "worker" in opts.roles:
        for path, what in (
            (opts.lib_dir, "--lib-dir"),
            (Path(opts.python), "python"),
            (opts.slurm_conf, "--slurm-conf"),
        ):
            _check_plain(path, what)
        if opts.stasis_config:
            _check_plain(opts.stasis_config, "stasis config")
        plugstack = Path(
            conf_value(conf_text.decode(), "PlugStackConfig") or etc / "plugstack.conf"
        )
        text_change(plugstack, lambda t: merge_plugstack(t, plugstack_line(opts)))
        _plan_node_files(opts, p, text_change, configless=False)
    return p


def _multinode(opts: InstallOptions) -> int:
    """The slurm_multinode job_submit.lua is written with."""
    if opts.multinode is not None:
        return int(opts.multinode)
    environ = dict(os.environ)
    if opts.stasis_config is not None and "%n" not in str(opts.stasis_config):
        environ["STASIS_CONFIG"] = str(opts.stasis_config)
    try:
        return load_settings(environ).slurm_multinode
    except StasisError:  # no config written yet: off, the safe side (install again to change)
        return 0


def _plan_node_files(
    opts: InstallOptions,
    p: Plan,
    text_change: Callable[[Path, Callable[[str | None], str], int], None],
    *,
    configless: bool,
) -> None:
    """A worker's own files: the launcher, our srun, the plugin's source (built if changed), the
    daemon's unit."""
    if configless:
        for path, what in ((opts.lib_dir, "--lib-dir"), (Path(opts.python), "python")):
            _check_plain(path, what)
    text_change(opts.lib_dir / LAUNCHER_NAME, lambda t: launcher_text(opts.python), 0o755)
    text_change(srun_path(opts.lib_dir), lambda t: srun_text(opts.python), 0o755)
    text_change(rsh_path(opts.lib_dir), lambda t: rsh_text(opts.python), 0o755)
    c_path = opts.lib_dir / C_NAME
    text_change(c_path, lambda t: _asset(C_NAME), 0o644)
    p.so_path, p.c_path = opts.lib_dir / SO_NAME, c_path
    p.build_so = p.changes[-1].changed or not p.so_path.exists()
    if opts.systemd_dir is not None:
        p.unit = opts.systemd_dir / UNIT_NAME
        text_change(p.unit, lambda t: unit_text(opts, configless), 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.stasis-tmp")
    tmp.write_bytes(data)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        pass
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def build_so(c_path: Path, so_path: Path) -> None:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if not gcc:
        raise UsageError("gcc is needed to build the SPANK plugin; run scripts/install-slurm.sh")
    if not Path("/usr/include/slurm/spank.h").exists():
        raise UsageError("<slurm/spank.h> is missing: apt-get install libslurm-dev")
    tmp = so_path.with_name(f".{so_path.name}.stasis-tmp")
    result = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(c_path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SlurmError(f"building the SPANK plugin failed: {result.stderr.strip()}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, so_path)


def _systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


def _say(out: IO[str] | None, text: str) -> None:
    if out is not None:
        out.write(text)


def install(opts: InstallOptions, out: IO[str] | None = sys.stdout, dry_run: bool = False) -> Plan:
    p = plan(opts)
    changed = [c for c in p.changes if c.changed]
    if dry_run:
        for c in changed:
            _say(out, c.diff())
        if p.build_so and p.so_path:
            _say(out, f"# would build {p.so_path} from {p.c_path} (gcc -shared -fPIC)\n")
        if p.unit and _systemd_running():
            _say(out, f"# would run: systemctl enable --now {UNIT_NAME}\n")
        if not changed and not p.build_so:
            _say(out, "# nothing to change: stasis is installed\n")
        return p
    record = _load_record(opts.slurm_conf)
    files: dict[str, Any] = record["files"]
    for c in changed:
        key = str(c.path)
        if key not in files:
            files[key] = {
                "original": base64.b64encode(c.before).decode() if c.before is not None else None,
                "mode": (c.path.stat().st_mode & 0o7777) if c.before is not None else None,
            }
        assert c.after is not None
        _write(c.path, c.after, c.mode)
        _say(out, f"updated {c.path}\n")
    for c in p.changes:
        if str(c.path) in files:
            files[str(c.path)]["installed_sha256"] = _sha(c.after)
    if p.build_so and p.so_path and p.c_path:
        build_so(p.c_path, p.so_path)
        files.setdefault(str(p.so_path), {"original": None, "mode": None})
        _say(out, f"built {p.so_path}\n")
    if p.so_path and str(p.so_path) in files:
        files[str(p.so_path)]["installed_sha256"] = _sha(_read(p.so_path))
    _write(_record_path(opts.slurm_conf), (json.dumps(record, indent=1) + "\n").encode(), 0o600)
    if p.unit and _systemd_running():
        subprocess.run(["systemctl", "daemon-reload"], check=False)
        subprocess.run(["systemctl", "enable", "--now", UNIT_NAME], check=False)
        _say(out, f"enabled {UNIT_NAME}\n")
    if changed:
        _say(out, "run `scontrol reconfigure` to apply\n")
    else:
        _say(out, "nothing to change: stasis is installed\n")
    return p


def _revert_text(path: Path, data: bytes, original: bytes | None) -> bytes | None:
    """Take our edits out of a file changed since install (best effort)."""
    if path.name in (LAUNCHER_NAME, steps.SRUN_NAME, C_NAME, SO_NAME, UNIT_NAME):
        return None
    text = data.decode(errors="replace")
    if path.name.endswith(".lua"):
        text = remove_block(text)
        return None if (original is None and not text.strip()) else text.encode()
    lines = [ln for ln in text.splitlines(keepends=True) if not _is_our_plugstack_line(ln)]
    text = "".join(lines)
    if original is not None:
        # Lines we changed go back to what they were; lines we added go away.
        orig_text = original.decode(errors="replace")
        for key, item in (
            ("JobSubmitPlugins", "lua"),
            ("CliFilterPlugins", "lua"),
            ("SlurmctldParameters", "preempt_send_user_signal"),
        ):
            was = conf_value(orig_text, key)
            pattern = _key_re(key)
            out_lines = []
            for ln in text.splitlines(keepends=True):
                m = pattern.match(ln.rstrip("\n"))
                if m and was is None and m.group(2) == item:
                    continue
                if m and was is not None:
                    ln = m.group(1) + was + m.group(3) + ln[len(ln.rstrip("\n")) :]
                out_lines.append(ln)
            text = "".join(out_lines)
    return text.encode()


def uninstall(
    slurm_conf: Path = DEFAULT_SLURM_CONF, out: IO[str] | None = sys.stdout, dry_run: bool = False
) -> None:
    record_path = _record_path(slurm_conf)
    if not record_path.exists():
        _say(out, f"nothing to uninstall: no {record_path}\n")
        return
    files: dict[str, Any] = _load_record(slurm_conf)["files"]
    unit = next((Path(p) for p in files if Path(p).name == UNIT_NAME), None)
    if unit and _systemd_running() and not dry_run:
        subprocess.run(["systemctl", "disable", "--now", UNIT_NAME], check=False)
    for name, entry in files.items():
        path = Path(name)
        current = _read(path)
        original = (
            base64.b64decode(entry["original"]) if entry.get("original") is not None else None
        )
        if current is None or _sha(current) == entry.get("installed_sha256"):
            target = original
        else:
            _say(out, f"warning: {path} changed since install; taking out stasis' edits only\n")
            target = _revert_text(path, current, original)
        if dry_run:
            _say(out, Change(path, current, target).diff())
            continue
        if target is None:
            if current is not None:
                path.unlink()
                _say(out, f"removed {path}\n")
        elif target != current:
            _write(path, target, entry.get("mode") or 0o644)
            os.chmod(path, entry.get("mode") or 0o644)
            _say(out, f"restored {path}\n")
        if path.name in (steps.SRUN_NAME, RSH_NAME) and target is None:
            try:
                path.parent.rmdir()  # the directory install made for them, when left empty
            except OSError:
                pass
    if not dry_run:
        record_path.unlink()
        _say(out, "run `scontrol reconfigure` to apply\n")
