"""`make test`'s two workers (tests/parallel.py): an exclusive module runs alone, the early
modules run on the first worker, and a process a worker's test left running still fails the run.
Each runs a small session of its own under pytest-xdist with the suite's own hooks."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

from tests.parallel import EARLY_GROUP, next_unit
from tests.test_leftovers import _assert_killed, nested_session

CONFTEST = """
from tests.conftest import (
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_configure_node,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_testnodedown,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
"""

# Each test notes when it ran, and where.
NOTE = """
import json, os, time

def note(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    line = {{"test": name, "worker": os.environ["PYTEST_XDIST_WORKER"],
             "start": start, "end": time.monotonic()}}
    with open({log!r}, "a") as f:
        f.write(json.dumps(line) + "\\n")
"""


def _session(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    for name, body in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    # importlib: the session's tests/ must not shadow the suite's `tests` package.
    return nested_session(
        tmp_path,
        CONFTEST,
        tmp_path / "tests",
        "--import-mode=importlib",
        "-n",
        "2",
        "--dist",
        "loadgroup",
    )


def _timed(log: Path, name: str, seconds: float, count: int) -> str:
    tests = "".join(
        f"\ndef test_{i}():\n    note({name + str(i)!r}, {seconds})\n" for i in range(count)
    )
    return NOTE.format(log=str(log)) + tests


def test_the_slow_directories_go_first_and_the_early_group_late_to_the_first_worker() -> None:
    queued = {"tests/store/test_a.py": 30, EARLY_GROUP: 10, "tests/e2e/test_b.py": 5}
    assert next_unit(queued, 100, "gw1") == "tests/e2e/test_b.py"
    assert next_unit(queued, 100, "gw0") == "tests/e2e/test_b.py"
    # Once a quarter of the tests is left for the other worker, the first takes the group.
    assert next_unit(queued, 140, "gw0") == EARLY_GROUP
    assert next_unit(queued, 140, "gw1") == "tests/e2e/test_b.py"
    assert next_unit({EARLY_GROUP: 10}, 140, "gw1") is None  # never on another worker
    assert next_unit({EARLY_GROUP: 10}, 140, "gw0") == EARLY_GROUP


def test_an_exclusive_module_runs_alone_and_the_early_ones_on_the_first_worker(
    tmp_path: Path,
) -> None:
    log = tmp_path / "ran.jsonl"
    result = _session(
        tmp_path,
        {
            "tests/engine/test_privatetmp.py": _timed(log, "exclusive", 1.0, 2),
            "tests/e2e/test_time_limit.py": _timed(log, "early", 0.3, 2),
            "tests/e2e/test_slurm_poc.py": _timed(log, "early-poc", 0.3, 1),
            **{f"tests/store/test_{m}.py": _timed(log, m, 0.4, 3) for m in "abcd"},
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(ran) == 2 + 3 + 12
    assert {r["worker"] for r in ran} == {"gw0", "gw1"}
    assert {r["worker"] for r in ran if r["test"].startswith("early")} == {"gw0"}
    alone = [r for r in ran if r["test"].startswith("exclusive")]
    for r in alone:
        beside = [o for o in ran if o is not r and o["start"] < r["end"] and r["start"] < o["end"]]
        assert beside == [], (r, beside)
    # Not alone otherwise: the two workers ran tests at the same time.
    rest = [r for r in ran if r not in alone]
    assert any(
        a["worker"] != b["worker"] and a["start"] < b["end"] and b["start"] < a["end"]
        for a in rest
        for b in rest
    )


def test_a_process_a_worker_left_running_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    leak = f"""
        import subprocess
        def test_leaks():
            p = subprocess.Popen(["setsid", "sleep", "1001"], start_new_session=True)
            open({str(pidfile)!r}, "w").write(str(p.pid))
        """
    result = _session(
        tmp_path,
        {
            "tests/store/test_leak.py": leak,
            "tests/store/test_fine.py": "def test_fine():\n    pass\n",
        },
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    assert "processes left behind" in result.stdout and "sleep 1001" in result.stdout
    _assert_killed(pidfile)
