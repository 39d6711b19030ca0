"""CRIU's network lock: the firewall rules a dump leaves behind, and undoing them.

A dump of a tree with established TCP connections (tcp_established) drops every packet of those
connections (one iptables rule per direction, in the node's own network namespace, which jobs
share) and puts their sockets in repair mode, so that the peers meet silence, not a reset, until a
restore brings the sockets back. CRIU lifts the lock itself when the dump fails, when it leaves
the tree running, and when it restores that very checkpoint on this node. After a dump that stops
the tree nothing else ever does: after `checkpoints rm`, a restore on another node, or no restore
at all, the peers hang and those address/port pairs stay blocked until reboot. And a tree that a
dump left stopped (leave_stopped) and that is resumed because its checkpoint was not published
keeps its sockets in repair mode: it runs, but its connections are dead.

Here: which rules a dump put in (CRIU's dump log names each iptables command it ran), taking
them out again, bringing a resumed tree's connections back, and the CRIU-shaped rules a node has.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import shlex
import socket
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stasis.engine import proctree

# CRIU's own mark: packets CRIU itself sends while restoring carry it and pass the rules.
CRIU_MARK = "0xc114"
# CRIU's own log line, from its start: the log also holds the job's file names, which the job's
# user chooses (a newline included), so nothing but a line of exactly this shape is believed.
_RUNNING = re.compile(r"^\(\d+\.\d+\) \tRunning ip6?tables \[(.*)\]$")
_TOOLS = ("iptables", "ip6tables")
_LOCK_FLAGS = ("-I", "-A")
_TCP_REPAIR = 19  # linux/tcp.h
_TCP_REPAIR_OFF = 0  # off, and send a window probe so the peer hears from us at once
_SYS_PIDFD_GETFD = 438  # the same number on x86_64 and the asm-generic architectures


@dataclass(frozen=True)
class LockRule:
    """One DROP rule of CRIU's network lock, as the command that inserted it."""

    argv: tuple[str, ...]

    @property
    def chain(self) -> str:
        return self._value(*_LOCK_FLAGS) or "?"

    def _value(self, *flags: str) -> str | None:
        for i, arg in enumerate(self.argv[:-1]):
            if arg in flags:
                return self.argv[i + 1]
        return None

    def connection(self) -> tuple[str, int, str, int] | None:
        """(local address, local port, peer address, peer port) of the locked connection, as the
        job's socket sees it: INPUT rules match packets from the peer, OUTPUT ones packets to it."""
        src, dst = self._value("--source", "-s"), self._value("--destination", "-d")
        sport, dport = self._value("--sport"), self._value("--dport")
        if not (src and dst and sport and dport and sport.isdigit() and dport.isdigit()):
            return None
        if self.chain == "INPUT":
            return dst, int(dport), src, int(sport)
        return src, int(sport), dst, int(dport)

    def delete_argv(self) -> list[str]:
        return [("-D" if a in _LOCK_FLAGS else a) for a in self.argv]

    def __str__(self) -> str:
        return shlex.join(self.argv)


def rules_from_log(log_path: Path) -> list[LockRule]:
    """The lock rules a dump's CRIU log says it put in and did not take out again (CRIU rolls
    back the first rule of a connection whose second one failed)."""
    rules: list[LockRule] = []
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return rules
    for line in text.splitlines():
        found = _RUNNING.search(line)
        if not found:
            continue
        try:
            argv = tuple(shlex.split(found.group(1)))
        except ValueError:
            continue
        if not _criu_shaped(argv):
            continue
        if "-D" in argv:
            for i, rule in enumerate(rules):
                if rule.delete_argv() == list(argv):
                    del rules[i]
                    break
        elif any(flag in argv for flag in _LOCK_FLAGS):
            rules.append(LockRule(argv))
    return rules


def _criu_shaped(argv: tuple[str, ...]) -> bool:
    """Whether `argv` is exactly what CRIU runs to lock (-I/-A) or unlock (-D) one direction of a
    TCP connection: root runs the -D form of it later, so a look-alike a user planted in the log
    must not pass (at worst it names another CRIU lock rule, never a rule of the site's own)."""
    words = list(argv)
    if words[1:2] == ["-w"]:
        del words[1]
    if len(words) != 22 or words[0] not in _TOOLS:
        return False
    shape = [
        words[0],
        "-t",
        "filter",
        "",
        "",
        "--protocol",
        "tcp",
        "-m",
        "mark",
        "!",
        "--mark",
        "0xC114",
        "--source",
        "",
        "--sport",
        "",
        "--destination",
        "",
        "--dport",
        "",
        "-j",
        "DROP",
    ]
    if any(want and got != want for got, want in zip(words, shape)):
        return False
    if words[3] not in (*_LOCK_FLAGS, "-D") or words[4] not in ("INPUT", "OUTPUT"):
        return False
    family = 6 if words[0] == "ip6tables" else 4
    try:
        if any(ipaddress.ip_address(words[i]).version != family for i in (13, 17)):
            return False
    except ValueError:
        return False
    return all(words[i].isdigit() and 0 < int(words[i]) < 65536 for i in (15, 19))


def remove(rules: Iterable[LockRule]) -> list[str]:
    """Take `rules` out of the firewall. A rule already gone (a restore of the checkpoint on this
    node lifted it, say) is not a problem; what could not be removed is returned, one line each."""
    problems: list[str] = []
    for rule in rules:
        try:
            done = subprocess.run(rule.delete_argv(), capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            problems.append(f"cannot run {rule.argv[0]}: {e}")
            continue
        if done.returncode != 0 and not _already_gone(done.stderr):
            problems.append(
                f"{shlex.join(rule.delete_argv())}: "
                f"{done.stderr.strip() or f'exit {done.returncode}'}"
            )
    return problems


def _already_gone(stderr: str) -> bool:
    # iptables-legacy and iptables-nft word it differently.
    text = stderr.lower()
    return "bad rule" in text or "does a matching rule exist" in text or "no chain" in text


def reopen_connections(pid: int, rules: Sequence[LockRule]) -> list[str]:
    """Bring back the TCP connections a dump locked, in the tree under `pid` that it left
    stopped and that is to run on: their rules go, and their sockets leave repair mode. What
    could not be done is returned, one line each."""
    problems = remove(rules)
    locked = {c for c in (r.connection() for r in rules) if c is not None}
    if not locked:
        return problems
    for task in proctree.tree(pid):
        problems.extend(_repair_off(task, locked))
    return problems


def _repair_off(pid: int, locked: set[tuple[str, int, str, int]]) -> list[str]:
    problems: list[str] = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        pidfd = os.pidfd_open(pid)
    except OSError:
        return problems  # gone
    try:
        for name in fds:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue
            fd = _pidfd_getfd(pidfd, int(name))
            if fd < 0:
                continue
            try:
                with socket.socket(fileno=fd) as sock:
                    problems.extend(_repair_off_socket(sock, locked, pid))
            except OSError:
                os.close(fd)
    finally:
        os.close(pidfd)
    return problems


def _repair_off_socket(
    sock: socket.socket, locked: set[tuple[str, int, str, int]], pid: int
) -> list[str]:
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return []
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return []  # not connected
    if (local[0], local[1], peer[0], peer[1]) not in locked:
        return []
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_REPAIR, _TCP_REPAIR_OFF)
    except OSError as e:
        return [
            f"cannot take the connection {local[0]}:{local[1]} - {peer[0]}:{peer[1]} of "
            f"pid {pid} out of repair mode: {e.strerror}"
        ]
    return []


def _pidfd_getfd(pidfd: int, target: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, target, 0))


def present() -> list[str]:
    """The CRIU-shaped lock rules in this node's firewall, as iptables-save prints them."""
    found: list[str] = []
    for tool in ("iptables-save", "ip6tables-save"):
        try:
            done = subprocess.run(
                [tool, "-t", "filter"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in done.stdout.splitlines():
            if line.startswith("-A ") and CRIU_MARK in line.lower() and line.endswith("-j DROP"):
                found.append(line)
    return found


def matches(saved: str, rule: LockRule) -> bool:
    """Whether an iptables-save line is `rule` (same chain, addresses and ports)."""
    conn = rule.connection()
    if conn is None:
        return False
    words = saved.split()
    if len(words) < 2 or words[1] != rule.chain:
        return False

    def value(*flags: str) -> str | None:
        for i, w in enumerate(words[:-1]):
            if w in flags:
                return words[i + 1].removesuffix("/32").removesuffix("/128")
        return None

    src, dst = rule._value("--source", "-s"), rule._value("--destination", "-d")
    return (
        value("-s", "--source"),
        value("--sport"),
        value("-d", "--destination"),
        value("--dport"),
    ) == (src, rule._value("--sport"), dst, rule._value("--dport"))


def remove_command(saved: str) -> str:
    """The command that takes out the rule iptables-save printed as `saved`."""
    words = saved.split()
    source = next((words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-s", "--source")), "")
    tool = "ip6tables" if ":" in source else "iptables"
    return f"{tool} -t filter -D {saved.removeprefix('-A ')}"
