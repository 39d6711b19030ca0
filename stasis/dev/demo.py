"""`make demo`: a job is checkpointed, killed, restored, and goes on from where it was.

Starts a private daemon (own socket, state and store under a temporary directory), so it never
touches a daemon that may already run on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from stasis.poll import poll

console = Console()
STASIS = str(Path(sys.executable).parent / "stasis")


def _stasis(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([STASIS, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"demo failed: stasis {' '.join(args)}: {out.stderr.strip()}")
    return json.loads(out.stdout) if "--json" in args else out.stdout


def _lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("count")]


def _wait(predicate: Any, timeout_s: float = 30) -> None:
    if not poll(predicate, timeout_s, interval_s=0.1):
        raise SystemExit("demo failed: timed out")


def checkpoint_demo() -> None:
    root = Path(tempfile.mkdtemp(prefix="stasis-demo-"))
    env = {
        **os.environ,
        "STASIS_SOCKET": str(root / "stasis.sock"),
        "STASIS_STATE_DIR": str(root / "state"),
        "STASIS_STORE": str(root / "store"),
        "STASIS_CONFIG": "",
    }
    daemon = subprocess.Popen(
        [STASIS, "daemon"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "daemon.log", "ab"),
    )
    log = root / "job.log"
    try:
        _wait(lambda: (root / "stasis.sock").exists())
        console.rule("[bold]stasis demo: checkpoint, kill, restore")
        job = _stasis(
            env,
            "run",
            "--json",
            "--label",
            "demo",
            "--log",
            str(log),
            "--",
            sys.executable,
            "-u",
            "-m",
            "stasis.dev.demojob",
        )
        console.print(f"started job {job['job']} (pid {job['pid']}), output in {log}")
        _wait(lambda: len(_lines(log)) >= 5)
        cp = _stasis(env, "dump", "--json", job["job"])
        before = _lines(log)
        console.print(
            f"checkpointed into {cp['checkpoint']}: {cp['size_bytes'] >> 20} MiB in "
            f"{cp['duration_s']:.2f} s; the job is gone:"
        )
        console.print(_stasis(env, "ps"))
        console.print("last lines before the checkpoint:")
        for line in before[-3:]:
            console.print(f"  {line}")
        restored = _stasis(env, "restore", "--json", "--label", "demo")
        console.print(f"restored as job {restored['job']} (pid {restored['pid']})")
        _wait(lambda: len(_lines(log)) >= len(before) + 4)
        after = _lines(log)[len(before) :]
        console.print("first lines after the restore (same counter, same memory digest):")
        for line in after[:4]:
            console.print(f"  {line}")
        last_count = int(before[-1].split()[1])
        first_count = int(after[0].split()[1])
        digest_ok = before[-1].split()[-1] == after[0].split()[-1]
        if first_count != last_count + 1 or not digest_ok:
            raise SystemExit("demo failed: the job did not continue from its checkpoint")
        console.print(
            f"[green]the counter went on from {last_count} to {first_count}, "
            "and the memory digest is unchanged[/green]"
        )
        _stasis(env, "kill", restored["job"])
    finally:
        daemon.terminate()
        daemon.wait(timeout=20)


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("run the demo as root (make demo)")
    checkpoint_demo()
    from stasis.dev import slurmdemo

    slurmdemo.run_preemption_demo(console)


if __name__ == "__main__":
    main()
