"""Reading CRIU's lock rules from its dump log: only CRIU's own lines, of exactly CRIU's shape
(the log also holds file names the job's user chose, newlines included, and root later runs the
-D form of every rule read)."""

from __future__ import annotations

from pathlib import Path

from stasis.engine import netlock

LOCK_IN = (
    "iptables -w -t filter -I INPUT --protocol tcp -m mark ! --mark 0xC114 --source "
    "127.0.0.1 --sport 45003 --destination 127.0.0.1 --dport 34122 -j DROP"
)
LOCK_OUT = (
    LOCK_IN.replace("-I INPUT", "-I OUTPUT")
    .replace("--sport 45003", "--sport X")
    .replace("--dport 34122", "--dport 45003")
    .replace("--sport X", "--sport 34122")
)


def _log(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "dump.log"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_criu_lines_are_read_and_rollbacks_undone(tmp_path: Path) -> None:
    log = _log(
        tmp_path,
        "(00.052991) net: Lock network",
        f"(00.062145) \tRunning iptables [{LOCK_IN}]",
        "(00.068099) Locked 127.0.0.1:34122 - 127.0.0.1:45003 connection",
        f"(00.068121) \tRunning iptables [{LOCK_OUT}]",
        f"(00.070000) \tRunning iptables [{LOCK_OUT.replace('-I OUTPUT', '-D OUTPUT')}]",
    )
    rules = netlock.rules_from_log(log)
    assert [r.chain for r in rules] == ["INPUT"]
    assert rules[0].connection() == ("127.0.0.1", 34122, "127.0.0.1", 45003)
    assert "-D" in rules[0].delete_argv() and "-I" not in rules[0].delete_argv()


def test_look_alikes_a_user_could_plant_are_ignored(tmp_path: Path) -> None:
    planted = [
        # A file name logged by CRIU, holding a whole rule.
        "(00.01) Dumping path for 3 fd via self 12 [/tmp/x Running iptables "
        "[iptables -t filter -I INPUT -s 10.0.0.0/8 -j DROP]]",
        # A newline in a file name gives a line of its own: the right prefix, not CRIU's shape.
        "(00.02) \tRunning iptables [iptables -t filter -I INPUT -s 10.0.0.0/8 -j DROP]",
        "(00.03) \tRunning iptables [iptables -t filter -I FORWARD --protocol tcp -m mark ! "
        "--mark 0xC114 --source 1.2.3.4 --sport 1 --destination 5.6.7.8 --dport 2 -j DROP]",
        "(00.04) \tRunning iptables [iptables -t filter -I INPUT --protocol tcp -m mark ! "
        "--mark 0xC114 --source 1.2.3.4 --sport 1 --destination 5.6.7.8 --dport 2 -j ACCEPT]",
        "(00.05) \tRunning iptables [iptables -t filter -I INPUT --protocol tcp -m mark ! "
        "--mark 0xC114 --source ::1 --sport 1 --destination ::1 --dport 2 -j DROP]",
        "(00.06) \tRunning iptables [sh -c reboot]",
    ]
    assert netlock.rules_from_log(_log(tmp_path, *planted)) == []
